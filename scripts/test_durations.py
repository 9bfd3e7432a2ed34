"""Write tests/durations.json (each test module's seconds) from a run's build/test-times.json.

``make test`` hands modules to its workers longest first (tests/support/schedule.py); this file is where it learns
how long each one takes. Refresh it after a full run when modules were added or got much slower or faster:

    make durations            # after make test
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.schedule import DURATIONS, module_of  # noqa: E402


def module_seconds(times: dict[str, object]) -> dict[str, float]:
    tests = times.get("tests")
    if not isinstance(tests, list) or not tests:
        raise SystemExit("the times file holds no tests: run make test first")
    totals: dict[str, float] = {}
    for t in tests:
        module = module_of(str(t["name"]))
        totals[module] = totals.get(module, 0.0) + float(t["seconds"])
    return {m: round(s, 1) for m, s in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--times", type=Path, default=ROOT / "build" / "test-times.json")
    parser.add_argument("--out", type=Path, default=DURATIONS)
    args = parser.parse_args(argv)
    try:
        times = json.loads(args.times.read_text())
    except OSError as e:
        print(f"error: cannot read {args.times} ({e.strerror}): run make test first", file=sys.stderr)
        return 2
    modules = module_seconds(times)
    body = {"from": {"wall_seconds": times.get("wall_seconds"), "load_1m": times.get("load_1m")}, "modules": modules}
    args.out.write_text(json.dumps(body, indent=1) + "\n")
    print(f"{len(modules)} modules, {sum(modules.values()):.0f} s in all -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
