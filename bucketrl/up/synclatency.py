"""End-to-end weight-sync latency, measured from the services' logs of one run directory.

For each version N: from the moment the trainer *called* publish (its log line ``published vN ... in Ss``,
written when the call returned, minus S) until every generator that was already serving has a version
>= N loaded (its log line ``loaded <run>-vM in ...`` with M >= N; a generator that skips straight to a
newer version counts as having N). Generators that started after the publish are left out for that
version: their first load measures their start-up, not the sync path. A log holds one section per process
start (``=== <time> start`` lines written by :class:`bucketrl.up.processes.Service`); each section is one
generator instance, and an instance that ended before loading a version is left out for it (it died).

Both sides log wall-clock time with millisecond resolution on the same machine, so the differences are
meaningful to ~1 ms. This measures; it asserts nothing.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_TS = r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2},\d{3})"
_LINE_TS = re.compile(_TS)
PUBLISHED = re.compile(_TS + r".*published v(\d+) \(step \d+, \d+ bytes\) in ([0-9.]+)s")


def _loaded_re(run: str) -> re.Pattern[str]:
    return re.compile(_TS + r".*loaded " + re.escape(run) + r"-v(\d+) in ")


def _ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


@dataclass
class SyncLatency:
    per_version: dict[int, float]  # version -> seconds until every serving generator had it

    @property
    def count(self) -> int:
        return len(self.per_version)

    @property
    def p50(self) -> float | None:
        return statistics.median(self.per_version.values()) if self.per_version else None

    @property
    def max(self) -> float | None:
        return max(self.per_version.values()) if self.per_version else None

    def describe(self) -> str:
        if not self.per_version:
            return "weight-sync latency: no version was published while generators were serving"
        return (
            f"weight-sync latency (trainer publish call -> every generator loaded) over {self.count} versions: "
            f"p50 {self.p50 * 1000:.0f} ms, max {self.max * 1000:.0f} ms"  # type: ignore[operator]
        )


def measure(logs_dir: Path, run: str, generator_logs: list[str] | None = None, trainer: str = "trainer") -> SyncLatency:
    """Parse ``<trainer>.log`` and the generator logs (default ``gen-*.log``) under ``logs_dir``."""
    publish_start: dict[int, float] = {}
    trainer_log = logs_dir / f"{trainer}.log"
    if trainer_log.exists():
        for line in trainer_log.read_text(errors="replace").splitlines():
            m = PUBLISHED.match(line)
            if m:
                # A resumed trainer may republish a number only if the first attempt never landed: keep the last.
                publish_start[int(m.group(2))] = _ts(m.group(1)) - float(m.group(3))
    paths = [logs_dir / n for n in generator_logs] if generator_logs else sorted(logs_dir.glob("gen-*.log"))
    instances = [inst for path in paths for inst in _instances(path.read_text(errors="replace"), _loaded_re(run))]
    per_version: dict[int, float] = {}
    for version, start in sorted(publish_start.items()):
        ready: list[float] = []
        complete = True
        for inst in instances:
            if not inst.loads or inst.loads[0][0] > start or inst.end < start:
                continue  # not serving when this version was published
            t = next((ts for ts, v in inst.loads if v >= version and ts >= start), None)
            if t is None:
                if inst.end - start < 0.5:  # it ended right after the publish: a stop, not a slow sync
                    continue
                complete = False  # still running but never got it (the run ended): no figure
                break
            ready.append(t)
        if complete and ready:
            per_version[version] = max(ready) - start
    return SyncLatency(per_version)


@dataclass
class _Instance:
    loads: list[tuple[float, int]]  # (time, version) of each adapter load
    end: float  # time of the instance's last log line


def _instances(text: str, loaded_re: re.Pattern[str]) -> list[_Instance]:
    out: list[_Instance] = []
    current: _Instance | None = None
    for line in text.splitlines():
        if line.startswith("=== ") and " start " in line:
            current = _Instance([], 0.0)
            out.append(current)
            continue
        m = _LINE_TS.match(line)
        if m is None:
            continue
        if current is None:
            current = _Instance([], 0.0)
            out.append(current)
        ts = _ts(m.group(1))
        current.end = max(current.end, ts)
        m = loaded_re.match(line)
        if m:
            current.loads.append((ts, int(m.group(2))))
    return out
