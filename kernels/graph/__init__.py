"""The decode step as replayed CUDA graphs: its plan (`plan.py`: buffers, the static arena, graph keys, why a
step falls back to MLX) and the recording of a step's launches that the plan is made from (`record.py`)."""
