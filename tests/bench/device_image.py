"""A Python that sees only what the GPU machine's image holds, to run ``bench/gpu_check.sh`` as it runs there.

The GPU image (``bench/gpu_image_packages.txt``) has torch, transformers, peft and tensorboard but not FastAPI,
pydantic, Redis or the rest of bucketrl's stack: those travel as wheels (``bench/gpu_wheels.sh``) and
``bench/gpu_check.sh`` installs them with ``pip --target``. :func:`device_python` makes a virtualenv whose
site-packages holds links to this interpreter's distributions named in that list and nothing else, so the check's
``import fastapi`` fails there until the wheels are installed, and an import of a package neither the image nor
the wheels carry (boto3, math-verify, openai...) fails as it would on the GPU machine.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
IMAGE_PACKAGES = ROOT / "bench" / "gpu_image_packages.txt"


def image_packages() -> set[str]:
    """Canonical names of the distributions the GPU image holds."""
    words: list[str] = []
    for line in IMAGE_PACKAGES.read_text().splitlines():
        words += line.split("#", 1)[0].split()
    return {canonicalize_name(w) for w in words}


def version_skew(image: set[str], carried: set[str]) -> set[str]:
    """Distributions that this machine's versions of the image's packages require but the image's list lacks, and
    that the wheels do not carry: the price of newer versions here (huggingface-hub here needs httpx2, its version
    there does not). They are let in so the view imports; a package the wheels carry (pydantic: typer here requires
    it) stays out, so only the wheels can provide it, as on the GPU machine."""
    installed = {canonicalize_name(d.metadata["Name"]): d for d in importlib.metadata.distributions()}
    todo = [n for n in image if n in installed]
    seen = set(todo)
    extra: set[str] = set()
    while todo:
        for spec in installed[todo.pop()].requires or []:
            req = Requirement(spec)
            name = canonicalize_name(req.name)
            if (req.marker and not req.marker.evaluate({"extra": ""})) or name in seen or name not in installed:
                continue
            seen.add(name)
            if name in carried:
                continue
            todo.append(name)
            if name not in image:
                extra.add(name)
    return extra


def device_python(dest: Path, allowed: set[str]) -> Path:
    """A virtualenv under ``dest`` whose only packages are this interpreter's distributions named in ``allowed``
    (linked, not copied); returns its python. pip comes along only if ``allowed`` names it (the image has it)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True)
    (site,) = (dest / "lib").glob("python3*/site-packages")
    # Who owns each top-level entry of site-packages: an entry only allowed distributions own is linked whole;
    # one shared with others (a namespace package, __pycache__) is rebuilt file by file from the allowed owners.
    owners: dict[str, set[str]] = {}
    allowed_files: dict[str, list[tuple[Path, Path]]] = {}  # top-level entry -> [(site-packages dir, relative path)]
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        base = Path(str(dist.locate_file("")))
        for record in dist.files or []:
            rel = Path(str(record))
            if rel.parts[0] == "..":
                continue  # console scripts under bin/: the check runs modules (python -m), never these
            owners.setdefault(rel.parts[0], set()).add(name)
            if name in allowed:
                allowed_files.setdefault(rel.parts[0], []).append((base, rel))
    for top, entries in allowed_files.items():
        if owners[top] <= allowed:
            base = entries[0][0]
            (site / top).symlink_to(base / top, target_is_directory=(base / top).is_dir())
            continue
        for base, rel in entries:
            target = site / rel
            if (base / rel).is_file() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(base / rel)
    return dest / "bin" / "python"
