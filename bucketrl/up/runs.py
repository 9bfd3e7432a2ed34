"""Several runs on one ``bucketrl up`` (docs/pool.md): which runs, from the command line, and their shares.

    bucketrl up --runs 2 --shares 2,1                       # two copies of the demo run: demo-1 (share 2), demo-2
    bucketrl up --run-spec lr-1e4=a.json --run-spec lr-3e4=b.json   # one run per file, named before the '='
    bucketrl up --run-spec lr-1e4.json --run-spec lr-3e4.json       # named by the file's stem

A run spec has no field for its run id (the id is the path ``/v1/runs/{run}``, and the same file may serve
several runs), so the name comes from ``NAME=FILE`` or the file's stem. One ``--run-spec FILE`` alone is the
one-run ``up`` it always was (the run is ``--run``). Each run gets its own trainer; the generators serve them all
in pool mode (``BUCKETRL_RUNS``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from bucketrl.wire.common import ID_PATTERN


class RunEntry(BaseModel):
    """One run of a several-run ``up``: its id, its run-spec file (None: the demo's spec), its share override."""

    model_config = ConfigDict(extra="forbid")

    run: str = Field(..., pattern=ID_PATTERN)
    spec: Path | None = None
    share: float | None = Field(None, gt=0)


def parse_runs(run_specs: list[str], runs: int | None, shares: str | None, base: str) -> list[RunEntry] | None:
    """The runs the options name (None: the one-run ``up``); ValueError with the one line to show."""
    share_list = _shares(shares)
    if runs is not None and run_specs:
        raise ValueError(
            "--runs and --run-spec: choose one (--runs N starts N copies of the demo run; --run-spec, repeated, "
            "one run per file)"
        )
    if runs is not None:
        if runs < 1:
            raise ValueError(f"--runs {runs}: must be at least 1")
        entries = [RunEntry(run=f"{base}-{i + 1}") for i in range(runs)]
    elif len(run_specs) > 1 or any("=" in s for s in run_specs):
        entries = [_entry(s) for s in run_specs]
    else:
        if share_list is not None:
            raise ValueError("--shares weighs several runs on one pool: add --runs N or repeat --run-spec")
        return None
    seen: dict[str, str] = {}
    for given, e in zip(run_specs or [e.run for e in entries], entries, strict=True):
        if e.run in seen:
            raise ValueError(
                f"--run-spec: two runs named {e.run!r} ({seen[e.run]} and {given}); give each its own name (NAME=FILE)"
            )
        seen[e.run] = given
    if share_list is not None:
        if len(share_list) != len(entries):
            raise ValueError(f"--shares {shares}: {len(share_list)} shares for {len(entries)} runs (one per run)")
        entries = [e.model_copy(update={"share": s}) for e, s in zip(entries, share_list, strict=True)]
    return entries


def _entry(text: str) -> RunEntry:
    name, eq, path = text.partition("=")
    if not eq:
        name, path = Path(text).stem, text
    if not re.match(ID_PATTERN, name):
        what = "the run name" if eq else f"the file's stem {name!r} (the run's name)"
        raise ValueError(f"--run-spec {text}: {what} is not a run id (letters, digits, _ . -); use NAME=FILE")
    if not path:
        raise ValueError(f"--run-spec {text}: no file after '='")
    if not Path(path).expanduser().is_file():
        raise ValueError(f"--run-spec {text}: no such file")
    return RunEntry(run=name, spec=Path(path))


def _shares(text: str | None) -> list[float] | None:
    if text is None:
        return None
    out = []
    for part in text.split(","):
        try:
            share = float(part)
        except ValueError:
            raise ValueError(f"--shares {text}: {part.strip()!r} is not a number (e.g. --shares 2,1)") from None
        if not share > 0 or share == float("inf"):
            raise ValueError(f"--shares {text}: each share must be > 0 (a run's weight on the pool), not {part}")
        out.append(share)
    return out


def check_pool_specs(specs: dict[str, dict[str, Any]]) -> None:
    """The runs' specs can share one pool of generators (bucketrl/generator/pool.py): one base model, single-turn;
    ValueError with the line to show, before any process starts."""
    models = {run: spec["base_model"] for run, spec in specs.items()}
    first = next(iter(specs))
    other = next((run for run, model in models.items() if model != models[first]), None)
    if other is not None:
        raise ValueError(
            f"runs {first!r} and {other!r} have different base models ({models[first]} and {models[other]}): one "
            "generator pool serves runs of one base model"
        )
    multi_turn = [run for run, spec in specs.items() if spec.get("env")]
    if multi_turn:
        raise ValueError(
            f"run {multi_turn[0]!r} is multi-turn (env): pool generators serve single-turn runs only; start it "
            "with its own `bucketrl up`"
        )
