"""Naming, ownership and cleanup of the lab's namespaces, including labs whose owner was SIGKILLed.

Everything a lab makes lives inside network namespaces it names ``bnl-<pid>-<starttime>-<tag>-<role>``: the veths
are created straight into them (never in the root namespace), the qdiscs and nft tables sit on those veths and in
those namespaces, and the relays and probes run inside them. So deleting the namespaces (after killing the
processes in them, which would otherwise keep a namespace alive past ``ip netns delete``) removes every trace.

The owner's pid *and* its start time (``/proc/<pid>/stat`` field 22) are in the name because pids are reused: a
name whose pid is alive but started at another time belongs to a dead owner. :func:`sweep` deletes every such
stale lab; a lab runs it when it starts, and ``python -m bucketrl.sim.netlab sweep`` runs it by hand.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass

PREFIX = "bnl"
_NAME = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-([0-9a-f]+)-([a-z0-9]+)$")


def proc_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces or ')': split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[19])  # field 22 overall; fields[0] is field 3


@dataclass(frozen=True)
class NsName:
    pid: int
    start: int
    tag: str
    role: str

    def __str__(self) -> str:
        return f"{PREFIX}-{self.pid}-{self.start}-{self.tag}-{self.role}"

    @classmethod
    def parse(cls, name: str) -> NsName | None:
        m = _NAME.match(name)
        if not m:
            return None
        return cls(int(m.group(1)), int(m.group(2)), m.group(3), m.group(4))

    def owner_alive(self) -> bool:
        return proc_start_time(self.pid) == self.start


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """``ip ARGS`` with its error text in the exception: a failed setup step must say which command failed."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def list_namespaces() -> list[str]:
    out = run_ip("netns", "list", check=False).stdout
    # Lines look like "name" or "name (id: 3)".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def lab_namespaces() -> list[NsName]:
    return [n for n in (NsName.parse(s) for s in list_namespaces()) if n is not None]


def pids_in(ns: str) -> list[int]:
    out = run_ip("netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def kill_namespace_processes(ns: str, grace_s: float = 1.0) -> None:
    """SIGTERM every process in the namespace, then SIGKILL what is left after ``grace_s``.

    A process inside keeps the namespace (and its veth, and so the peer namespace's link) alive after
    ``ip netns delete``; it would then vanish from ``ip netns list`` while still existing, which is worse than
    leaving it listed. Our own pid is never in a lab namespace (the harness runs in the namespace it was started
    in), but it is skipped anyway so a mistake cannot kill the caller.
    """
    me = os.getpid()
    pids = [p for p in pids_in(ns) if p != me]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline:
            pids = [p for p in pids_in(ns) if p != me]
            if not pids:
                return
            time.sleep(0.05)


def delete_namespace(ns: str) -> None:
    """Kill what runs in ``ns`` and delete it (its veth ends go with it, and so do their peers and qdiscs)."""
    kill_namespace_processes(ns)
    run_ip("netns", "delete", ns, check=False)


def sweep() -> list[str]:
    """Delete every lab namespace whose owner process is gone; return the names deleted."""
    gone = [n for n in lab_namespaces() if not n.owner_alive()]
    for n in gone:
        delete_namespace(str(n))
    return [str(n) for n in gone]
