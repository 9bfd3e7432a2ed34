"""Experiment trackers (TRL's ``report_to``): every metric the trainer pushes to the proxy also goes to TensorBoard,
Weights & Biases and/or trackio, under the same names, with the run spec as the config.

    trackers = open_trackers(settings, spec, run_id=..., resume_step=step)   # BUCKETRL_REPORT_TO=tensorboard,wandb
    trackers.log({"train/loss": 0.1, "reward": 0.5}, step=12)
    trackers.close()

The libraries are optional extras (``pip install bucketrl[trackers]``); naming one that is not installed is a
configuration error at start-up (:func:`check_report_to`). A tracker that FAILS (unreachable server, full
disk, a bug in the library) never stops training: its first failure is logged once as a warning and it is
dropped for the rest of the run.

Resume continues the same tracker run:

* TensorBoard: the same log directory, opened with ``purge_step = resume step + 1``: the events the previous
  trainer wrote after the checkpoint it resumed from (steps it trains again) are hidden by TensorBoard's own
  purge rule, so each step appears once.
* wandb: ``id`` derived from the run name and the run's creation time on the proxy, ``resume="allow"``.
* trackio: the run name plus the creation time, ``resume="allow"``.

Imports no tracker library until one is asked for.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("bucketrl.trainer")

TRACKERS = ("tensorboard", "wandb", "trackio")
# The module each tracker needs (tensorboard: torch's SummaryWriter writes, the tensorboard package must exist).
_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def parse_report_to(value: str) -> list[str]:
    """``"tensorboard,wandb"`` -> ``["tensorboard", "wandb"]``; ``none`` / empty -> ``[]``; ``all`` -> every one
    that is installed (TRL's meaning). Raises ValueError naming an unknown tracker."""
    names = [v.strip().lower() for v in value.replace(" ", ",").split(",") if v.strip()]
    if names in ([], ["none"]):
        return []
    if names == ["all"]:
        return [t for t in TRACKERS if installed(t)]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown or "none" in names:
        # No field name here: the settings' error printer and `up`'s flag check each name it their own way.
        raise ValueError(f"{', '.join(unknown) or 'none'} is not one of {', '.join(TRACKERS)}, none, all")
    return list(dict.fromkeys(names))


def installed(tracker: str) -> bool:
    return importlib.util.find_spec(_MODULES[tracker]) is not None


def default_report_to() -> str:
    """``bucketrl up``'s default: TensorBoard event files when tensorboard is installed, else nothing."""
    return "tensorboard" if installed("tensorboard") else "none"


def check_report_to(value: str) -> list[str]:
    """The trackers of ``value``, or ValueError naming one that is not installed and how to install it."""
    names = parse_report_to(value)
    missing = [n for n in names if not installed(n)]
    if missing:
        raise ValueError(
            f"BUCKETRL_REPORT_TO names {', '.join(missing)}, which is not installed: pip install 'bucketrl[trackers]' "
            f"(or the package itself), or drop it from BUCKETRL_REPORT_TO"
        )
    return names


class _Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...
    def close(self) -> None: ...


class _TensorBoard:
    def __init__(self, logdir: Path, config: dict[str, Any], resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        logdir.mkdir(parents=True, exist_ok=True)
        # purge_step: TensorBoard hides the events of earlier files at or after it (the steps retrained after a
        # resume). None on a fresh run.
        self.writer = SummaryWriter(str(logdir), purge_step=resume_step + 1 if resume_step > 0 else None)
        if resume_step == 0:
            self.writer.add_text("run_spec", "```json\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()  # one flush per step: a reader (or a crash) sees every finished step

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, project: str, name: str, run_id: str, directory: Path, config: dict[str, Any]) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow", dir=str(directory), config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _Trackio:
    def __init__(self, project: str, name: str, config: dict[str, Any]) -> None:
        import trackio

        self.run = trackio.init(project=project, name=name, config=config, resume="allow", embed=False)

    # The Run object's own methods: trackio.log() looks the run up in a context variable, which the uploader
    # thread (where the trainer logs from) does not see.
    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The open trackers; every call is guarded (a failing tracker is warned about once, then dropped)."""

    def __init__(self, sinks: dict[str, _Sink]) -> None:
        self.sinks = sinks

    @property
    def names(self) -> list[str]:
        return list(self.sinks)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for name in list(self.sinks):
            self._guarded(name, lambda s=self.sinks[name]: s.log(metrics, step))

    def close(self) -> None:
        for name in list(self.sinks):
            self._guarded(name, self.sinks[name].close)
        self.sinks = {}

    def _guarded(self, name: str, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # a tracker must never stop training
            log.warning("tracker %s failed (%s: %s); training goes on without it", name, type(exc).__name__, exc)
            self.sinks.pop(name, None)


def _warn_if_trackio_dir_is_fixed() -> None:
    # Importing TRL or transformers' integrations imports trackio, which fixes its directory then: a
    # TRACKIO_DIR set afterwards is not seen, and saying where the database really is saves a search.
    utils = sys.modules.get("trackio.utils")
    wanted = Path(os.environ["TRACKIO_DIR"])
    actual = getattr(utils, "TRACKIO_DIR", None)
    if actual is not None and Path(actual) != wanted:
        log.warning("trackio was imported before TRACKIO_DIR was set: its database is in %s, not %s", actual, wanted)


def tracker_run_id(run: str, created_at: float) -> str:
    """A stable id per training run: the same after a restart, new for a run recreated under the same name."""
    digest = hashlib.sha256(f"{run}\0{created_at!r}".encode()).hexdigest()[:10]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', run)[:40]}-{digest}"


def open_trackers(
    names: list[str],
    *,
    run: str,
    run_id: str,
    config: dict[str, Any],
    directory: str | Path,
    project: str,
    resume_step: int = 0,
) -> Trackers:
    """Open each named tracker; one that fails to open is warned about and left out (training goes on)."""
    base = Path(directory)
    sinks: dict[str, _Sink] = {}
    for name in names:
        try:
            if name == "tensorboard":
                sinks[name] = _TensorBoard(base / "tensorboard" / run, config, resume_step)
            elif name == "wandb":
                sinks[name] = _Wandb(project, run, run_id, base, config)
            elif name == "trackio":
                # trackio reads its storage directory from the environment at import.
                os.environ.setdefault("TRACKIO_DIR", str(base / "trackio"))
                _warn_if_trackio_dir_is_fixed()
                sinks[name] = _Trackio(project, run_id, config)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("tracker %s could not start (%s); training goes on without it", name, reason)
    if sinks:
        log.info("reporting metrics to %s (under %s)", ", ".join(sinks), base)
    return Trackers(sinks)
