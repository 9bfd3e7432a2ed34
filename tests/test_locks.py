"""One resolution for every install: the dev lock (locks/dev.txt, `make lock`) is what .venv holds, covers what
pyproject.toml asks, and the images' locks and the GPU wheels take their versions from it."""

from __future__ import annotations

import re
import sysconfig
import tomllib
from importlib.metadata import distributions
from pathlib import Path

from packaging.requirements import Requirement

from tests.containers.podman import SERVICE_IMAGES, UNLOCKED, canonical, parse_pins

ROOT = Path(__file__).resolve().parent.parent
DEV = parse_pins((ROOT / "locks" / "dev.txt").read_text())


def test_venv_holds_exactly_the_dev_lock() -> None:
    # The venv's own site-packages only: distributions() walks sys.path, and once a test in the same worker has
    # imported setuptools, its vendored copies (packaging 24.2, tomli 2.0.1, ...) are on it too.
    site = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    installed = {canonical(d.metadata["Name"]): d.version for d in distributions(path=site)}
    differ = {name: (pin, installed.get(name)) for name, pin in DEV.items() if installed.get(name) != pin}
    assert not differ, f"(lock, installed) differ: {differ}; rerun `make setup`, or `make lock` if pyproject changed"
    unlocked = sorted(set(installed) - set(DEV) - UNLOCKED)
    assert not unlocked, f"installed but not in locks/dev.txt: {unlocked}: run `make lock`"


def test_dev_lock_meets_every_requirement_of_pyproject() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    problems = []
    for req in wanted:
        name = canonical(req.name)
        if name in UNLOCKED or name == "bucketrl":
            continue
        if name not in DEV:
            problems.append(f"{req} is not locked")
        elif not req.specifier.contains(DEV[name], prereleases=True):
            problems.append(f"{req} but the lock has {DEV[name]}")
    assert not problems, f"{problems}: run `make lock`"


def test_image_locks_agree_with_the_dev_lock() -> None:
    for image in SERVICE_IMAGES:
        pins = parse_pins((ROOT / "services" / "locks" / image.lock).read_text())
        differ = {name: (version, DEV[name]) for name, version in pins.items() if name in DEV and DEV[name] != version}
        assert not differ, f"services/locks/{image.lock} (image, dev) differ: {differ}: run `make lock`"


def test_gpu_wheels_take_their_versions_from_the_dev_lock() -> None:
    script = (ROOT / "bench" / "gpu_wheels.sh").read_text()
    assert not re.findall(r"[A-Za-z0-9_.-]+==[0-9]", script), "bench/gpu_wheels.sh pins a version of its own"
    names = re.search(r"PACKAGES=\(([^)]*)\)", script)
    assert names is not None
    assert [n for n in names.group(1).split() if canonical(n) not in DEV] == []
