# Sourced first by bench/gpu_session*.sh on the device machine: the repository root, MLX CUDA (staged by
# gpu-wheels.sh in /tmp/mlxsite) on the path, $OUT, ncu, the running code's provenance, and `pyt`.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH=/tmp/mlxsite:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/ncu"
NCU=/usr/local/cuda/bin/ncu
python3 bench/provenance.py
pyt() {  # pytest of the gpu-marked tests in files $2.., under a timeout of $1 s
  local t=$1; shift
  timeout "$t" python3 -m pytest "$@" -m gpu -q --tb=short -rf -p no:cacheprovider --durations=3 2>&1 | tail -14
}
