"""The working tree as git sees it: tracked files and untracked ones it does not ignore (what a build or a copy of
the checkout should hold)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def tree_files(root: Path) -> list[str]:
    """Paths (relative to ``root``) of the tree's files, excluding what .gitignore keeps out."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return [raw.decode() for raw in listed if raw and (root / raw.decode()).is_file()]
