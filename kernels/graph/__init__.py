"""The decode step as replayed CUDA graphs: its plan (`plan.py`: buffers, the static arena, graph keys, why a
step falls back to MLX), the recording of a step's launches that the plan is made from (`record.py`), the
kernels' translation units for NVRTC (`codegen.py`), the step inputs' staging (`staging.py`) and the cuda.core
runtime (`runtime.py`). docs/cuda_graphs.md."""
