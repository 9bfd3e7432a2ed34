"""Adapter and checkpoint directories travel as uncompressed tars (``application/x-tar``).

``pack_dir`` is deterministic (sorted names, zeroed mtimes and owners) so the same directory always
gives the same sha256. ``unpack`` refuses members that would escape the target directory.
"""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def pack_dir(directory: str | Path) -> bytes:
    root = Path(directory)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            info = tarfile.TarInfo(path.relative_to(root).as_posix())
            info.size = path.stat().st_size
            info.mode = 0o644
            with path.open("rb") as fh:
                tar.addfile(info, fh)
    return buf.getvalue()


def unpack(data: bytes, target: str | Path) -> list[str]:
    """Extract regular files only; returns the member names. Raises ValueError on unsafe members."""
    dest = Path(target)
    dest.mkdir(parents=True, exist_ok=True)
    names: list[str] = []
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if member.isdir():
                continue
            if not member.isfile():
                raise ValueError(f"tar member {member.name!r} is not a regular file")
            rel = Path(member.name)
            if rel.is_absolute() or ".." in rel.parts:
                raise ValueError(f"tar member {member.name!r} escapes the target directory")
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            assert src is not None
            out.write_bytes(src.read())
            names.append(rel.as_posix())
    return names
