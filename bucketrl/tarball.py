"""Adapter and checkpoint directories travel as uncompressed tars (``application/x-tar``).

``pack_dir`` is deterministic (sorted names, zeroed mtimes and owners) so the same directory always
gives the same sha256. ``unpack`` extracts a tar that came from the bucket, i.e. from someone else: it
refuses members that would escape the target directory, links, devices and sparse members (a 10 KB GNU
sparse member used to expand to a 3 GB allocation), members larger than the caller's ``expected`` sizes
say, and more than ``max_bytes`` in all; it streams each member to disk in chunks (never a member whole in
memory) and leaves nothing behind when it refuses.
"""

from __future__ import annotations

import io
import shutil
import tarfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO

MAX_MEMBERS = 10_000
_CHUNK = 1 << 20


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


def unpack(
    source: bytes | str | Path | IO[bytes],
    target: str | Path,
    *,
    max_bytes: int | None = None,
    expected: Mapping[str, int] | None = None,
) -> list[str]:
    """Extract the regular files of a tar (bytes, a path, or a binary file object) into ``target``; returns the
    member names. ``expected`` (name -> size, e.g. a manifest): refuse any other member and any member larger
    than it says. Raises ValueError on anything unsafe (after removing what it had written)."""
    dest = Path(target)
    existed = dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        try:
            return _open_and_extract(source, dest, max_bytes, expected)
        except tarfile.TarError as exc:  # not a ValueError: callers get one exception type for a bad archive
            raise ValueError(f"not a usable tar archive: {exc}") from exc
    except BaseException:
        if not existed:
            shutil.rmtree(dest, ignore_errors=True)
        raise


def _open_and_extract(
    source: bytes | str | Path | IO[bytes], dest: Path, max_bytes: int | None, expected: Mapping[str, int] | None
) -> list[str]:
    if isinstance(source, bytes | bytearray):
        return _extract(io.BytesIO(source), dest, max_bytes, expected)
    if isinstance(source, str | Path):
        with open(source, "rb") as fh:
            return _extract(fh, dest, max_bytes, expected)
    return _extract(source, dest, max_bytes, expected)


def _extract(fh: IO[bytes], dest: Path, max_bytes: int | None, expected: Mapping[str, int] | None) -> list[str]:
    names: list[str] = []
    total = 0
    with tarfile.open(fileobj=fh, mode="r:") as tar:
        for member in tar:
            if member.isdir():
                continue
            if member.issparse():
                raise ValueError(f"tar member {member.name!r} is a sparse file (refused)")
            if not member.isfile():
                raise ValueError(f"tar member {member.name!r} is not a regular file")
            rel = Path(member.name)
            if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                raise ValueError(f"tar member {member.name!r} escapes the target directory")
            name = rel.as_posix()
            if name in names:
                raise ValueError(f"tar member {name!r} appears twice")
            if len(names) >= MAX_MEMBERS:
                raise ValueError(f"tar has more than {MAX_MEMBERS} members")
            if expected is not None:
                if name not in expected:
                    raise ValueError(f"tar member {name!r} is not one of the expected files {sorted(expected)}")
                if member.size > expected[name]:
                    raise ValueError(
                        f"tar member {name!r} is {member.size} bytes, more than the {expected[name]} expected"
                    )
            total += member.size
            if max_bytes is not None and total > max_bytes:
                raise ValueError(f"tar members hold more than {max_bytes} bytes")
            out = dest / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            src = tar.extractfile(member)
            if src is None:
                raise ValueError(f"tar member {member.name!r} has no data")
            _copy_exactly(src, out, member.size, name)
            names.append(name)
    return names


def _copy_exactly(src: IO[bytes], out: Path, size: int, name: str) -> None:
    """Copy ``size`` bytes in chunks; a member whose data ends early (a truncated tar) is refused."""
    left = size
    with out.open("wb") as dst:
        while left > 0:
            block = src.read(min(_CHUNK, left))
            if not block:
                raise ValueError(f"tar member {name!r} is truncated")
            dst.write(block)
            left -= len(block)
