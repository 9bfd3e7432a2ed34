"""Proof that a shortened or shared test still bites: each patch under tests/mutations/ breaks one behaviour, and the
test named on its first line must then fail.

    make mutation-check                      # every patch
    python scripts/mutation_check.py NAME    # the patches whose file name contains NAME

A patch's first line is ``# test: <pytest node id> [<node id> ...]``, the rest a ``git diff`` against the tree.
Each patch is applied to a fresh copy of the working tree (tracked and untracked-not-ignored files, with this
checkout's .venv linked in), never to the checkout itself; the named tests run there, on the copy's code: the copy
comes first on ``PYTHONPATH``, which every subprocess the tests start inherits, and the editable install's finder
comes after the path. The check fails if a patch no longer applies, or if any named test passes with it applied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MUTATIONS = ROOT / "tests" / "mutations"
sys.path.insert(0, str(ROOT))
from tests.support.tree import tree_files  # noqa: E402  (the repository root, put on the path above)


def tests_of(patch: Path) -> list[str]:
    first = patch.read_text().splitlines()[0]
    if not first.startswith("# test: "):
        raise SystemExit(f"{patch.name}: the first line must be '# test: <pytest node id> ...', not {first!r}")
    return first.removeprefix("# test: ").split()


def copy_tree(dest: Path) -> None:
    for rel in tree_files(ROOT):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    (dest / ".venv").symlink_to(ROOT / ".venv")


def check(patch: Path) -> tuple[bool, str]:
    """(the named tests failed with the patch applied, a line saying what happened)."""
    tests = tests_of(patch)
    with tempfile.TemporaryDirectory(prefix="bucketrl-mutant-") as tmp:
        tree = Path(tmp)
        copy_tree(tree)
        applied = subprocess.run(["git", "apply", str(patch)], cwd=tree, capture_output=True, text=True)
        if applied.returncode != 0:
            return False, f"does not apply: {applied.stderr.strip()[:400]}"
        env = {**os.environ, "PYTHONPATH": str(tree), "BUCKETRL_TEST_TIMES": str(tree / "build" / "times.json")}
        started = time.monotonic()
        run = subprocess.run(
            [str(ROOT / ".venv" / "bin" / "python"), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
        )
        took = time.monotonic() - started
        last = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
        if run.returncode == 1:
            return True, f"killed in {took:.0f} s ({last})"
        if run.returncode == 0:
            return False, f"SURVIVED: {' '.join(tests)} passed with the behaviour broken ({last})"
        return False, f"pytest exited {run.returncode} (not a test failure): {run.stdout[-1500:]}{run.stderr[-1500:]}"


def main() -> None:
    patches = sorted(MUTATIONS.glob("*.patch"))
    wanted = sys.argv[1:]
    if wanted:
        patches = [p for p in patches if any(w in p.name for w in wanted)]
    if not patches:
        raise SystemExit(f"no patch under {MUTATIONS.relative_to(ROOT)} matches {wanted}")
    survived = 0
    for patch in patches:
        ok, said = check(patch)
        survived += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {patch.name}: {said}", flush=True)
    print(f"{len(patches) - survived} of {len(patches)} mutations killed")
    if survived:
        sys.exit(1)


if __name__ == "__main__":
    main()
