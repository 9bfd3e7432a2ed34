"""The lab: a "home" namespace and region namespaces, each region joined to home by its own veth link.

Region ``i`` (0-based, in the order given) gets the link ``10.77.<i+1>.0/24``: home's end is ``to-<region>`` with
``10.77.<i+1>.1``, the region's end is ``home`` with ``10.77.<i+1>.2``. Both ends get a ``tbf`` root qdisc at the
link's rate, so each direction is rate limited on its sender's egress. The namespaces have no other interface
and no default route: the only addresses any process in them can reach are the lab's own (and loopback).

A lab is owned by the process that made it (its pid and start time are in every namespace name, see
:mod:`bucketrl.sim.netlab.cleanup`); :meth:`Lab.close` removes everything, so do ``atexit`` and SIGTERM, and
the next lab started on the machine sweeps the remains of one whose owner was SIGKILLed.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import Any

from bucketrl.sim.netlab import cleanup
from bucketrl.sim.netlab.drop import DropMode, drop_ends, restore_ends

HOME = "home"
_REGION = re.compile(r"^[a-z0-9]{1,8}$")
_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    # os.setns is Python 3.12+; libc's is the same call.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@dataclass(frozen=True)
class LinkSpec:
    """One region's link to home: its round trip (split evenly, half per direction) and its rate."""

    rtt_ms: float
    mbit: float

    @property
    def one_way_ms(self) -> float:
        return self.rtt_ms / 2.0

    def tbf_args(self) -> list[str]:
        rate_bytes = self.mbit * 1e6 / 8
        # burst: 10 ms at the rate, at least 32 KiB (tbf needs more than one MTU, and a small bucket makes the
        # rate exact over short transfers). limit (the queue): 20 ms at the rate, at least two bursts, so a bulk
        # flow adds ~20 ms of queueing to the link instead of the 100s of ms a deep queue would.
        burst = max(32 * 1024, int(rate_bytes * 0.010))
        limit = max(2 * burst, int(rate_bytes * 0.020))
        return ["tbf", "rate", f"{int(self.mbit * 1000)}kbit", "burst", str(burst), "limit", str(limit)]


@dataclass
class Link:
    region: str
    spec: LinkSpec
    home_ns: str
    region_ns: str
    home_if: str
    region_if: str
    home_addr: str
    region_addr: str
    dropped: DropMode | None = None

    def ends(self) -> list[tuple[str, str]]:
        return [(self.home_ns, self.home_if), (self.region_ns, self.region_if)]


@dataclass
class Relay:
    """A running delay relay: connect to ``host:port`` from ``client_ns`` to reach ``target`` in ``ns``."""

    ns: str
    host: str
    port: int
    target: tuple[str, int]
    one_way_ms: float
    proc: subprocess.Popen[str] = field(repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


# Strong references: a lab dropped without close() must still be closed at exit, not forgotten by the GC.
_LIVE: set[Lab] = set()
_HOOKS_INSTALLED = False


def _close_all() -> None:
    for lab in list(_LIVE):
        lab.close()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Clean up, then die of SIGTERM as the default action would (exit status and all).
    _close_all()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _install_hooks() -> None:
    global _HOOKS_INSTALLED
    if _HOOKS_INSTALLED:
        return
    _HOOKS_INSTALLED = True
    atexit.register(_close_all)
    # Only take SIGTERM over when nobody else has (a framework's own handler stays theirs) and only from the main
    # thread (signal.signal raises elsewhere). SIGKILL cannot be caught: the sweep at the next start covers it.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class Lab:
    """Home plus regions, with tbf-limited links; delay relays on demand. Use as a context manager.

    >>> with Lab({"a": LinkSpec(rtt_ms=100, mbit=200)}) as lab:
    ...     relay = lab.expose("a", 8080)          # home's 127.0.0.1:8080, reachable from region a, delayed
    ...     subprocess.run([*lab.exec_prefix("a"), "curl", f"http://{relay.address}/"])
    """

    def __init__(self, regions: dict[str, LinkSpec], *, sweep: bool = True) -> None:
        for r in regions:
            if not _REGION.match(r) or r == HOME:
                raise ValueError(f"region name {r!r}: 1-8 of [a-z0-9], not {HOME!r}")
        self.specs = dict(regions)
        self.swept: list[str] = cleanup.sweep() if sweep else []
        me = os.getpid()
        start = cleanup.proc_start_time(me)
        assert start is not None
        self._owner = (me, start)
        self.tag = uuid.uuid4().hex[:6]
        self.links: dict[str, Link] = {}
        self.relays: list[Relay] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._timers: list[threading.Timer] = []
        self._namespaces: list[str] = []
        self._closed = False
        _install_hooks()
        _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # --- names and addresses -------------------------------------------------------------------------------------

    def ns(self, role: str) -> str:
        """The namespace name of ``home`` or a region."""
        return str(cleanup.NsName(self._owner[0], self._owner[1], self.tag, role))

    @property
    def home_ns(self) -> str:
        return self.ns(HOME)

    def exec_prefix(self, role: str) -> list[str]:
        """The argv prefix that runs a command inside ``home`` or a region: ``[*prefix, "python", ...]``."""
        return ["ip", "netns", "exec", self.ns(role)]

    def describe(self) -> dict[str, Any]:
        return {
            "home": self.home_ns,
            "links": {
                r: {
                    "region_ns": link.region_ns,
                    "home_addr": link.home_addr,
                    "region_addr": link.region_addr,
                    "rtt_ms": link.spec.rtt_ms,
                    "mbit": link.spec.mbit,
                }
                for r, link in self.links.items()
            },
            "relays": [
                {"ns": x.ns, "listen": x.address, "target": f"{x.target[0]}:{x.target[1]}", "one_way_ms": x.one_way_ms}
                for x in self.relays
            ],
        }

    # --- building ------------------------------------------------------------------------------------------------

    def _add_ns(self, role: str) -> str:
        name = self.ns(role)
        cleanup.run_ip("netns", "add", name)
        self._namespaces.append(name)
        # A new namespace's loopback is down; services bound to 127.0.0.1 there need it. IPv6 off: its router
        # solicitations and DAD would be the only unasked-for traffic on the links.
        cleanup.run_ip("-n", name, "link", "set", "lo", "up")
        for key in ("all", "default"):
            subprocess.run(
                ["ip", "netns", "exec", name, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1"],
                capture_output=True,
                timeout=30,
            )
        return name

    def _build(self) -> None:
        home = self._add_ns(HOME)
        for i, (region, spec) in enumerate(self.specs.items()):
            rns = self._add_ns(region)
            link = Link(
                region=region,
                spec=spec,
                home_ns=home,
                region_ns=rns,
                home_if=f"to-{region}",
                region_if=HOME,
                home_addr=f"10.77.{i + 1}.1",
                region_addr=f"10.77.{i + 1}.2",
            )
            # Both ends are created straight inside their namespaces: nothing of the lab ever exists in the caller's
            # namespace, so deleting the lab's namespaces removes the veth pair whatever state we died in.
            cleanup.run_ip(
                "link", "add", link.home_if, "netns", home, "type", "veth", "peer", "name", link.region_if, "netns", rns
            )
            for ns, ifname, addr in ((home, link.home_if, link.home_addr), (rns, link.region_if, link.region_addr)):
                cleanup.run_ip("-n", ns, "addr", "add", f"{addr}/24", "dev", ifname)
                cleanup.run_ip("-n", ns, "link", "set", ifname, "up")
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "replace", "dev", ifname, "root", *spec.tbf_args()],
                    check=True,
                    capture_output=True,
                    timeout=30,
                )
            self.links[region] = link

    # --- processes -----------------------------------------------------------------------------------------------

    def popen(self, role: str, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``home`` or a region; the lab kills it (and anything else in there) on close."""
        proc: subprocess.Popen[Any] = subprocess.Popen([*self.exec_prefix(role), *argv], **kw)
        self._procs.append(proc)
        return proc

    def start_relay(
        self,
        ns_role: str,
        listen: tuple[str, int],
        target: tuple[str, int],
        one_way_ms: float,
        window_bytes: int | None = None,
        timeout_s: float = 30.0,
    ) -> Relay:
        """A delay relay in ``ns_role`` listening on ``listen`` and forwarding to ``target`` (both in that ns)."""
        argv = [
            sys.executable,
            "-m",
            "bucketrl.sim.netlab.delay",
            "--listen",
            f"{listen[0]}:{listen[1]}",
            "--target",
            f"{target[0]}:{target[1]}",
            "--one-way-ms",
            str(one_way_ms),
            "--owner-pid",
            str(self._owner[0]),
            "--owner-start",
            str(self._owner[1]),
        ]
        if window_bytes is not None:
            argv += ["--window-bytes", str(window_bytes)]
        proc = self.popen(ns_role, argv, stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        # Wait for READY with a deadline: a relay that cannot bind exits, one that hangs must not hang the caller.
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            proc.kill()
            raise RuntimeError(f"delay relay in {ns_role} did not start (rc={proc.poll()}, said {line!r})")
        relay = Relay(self.ns(ns_role), listen[0], int(line.split()[1]), target, one_way_ms, proc)
        self.relays.append(relay)
        return relay

    def expose(self, region: str, target_port: int, listen_port: int = 0, target_host: str = "127.0.0.1") -> Relay:
        """Make home's ``target_host:target_port`` reachable from ``region`` through that link's delay.

        The relay runs in home on the link's home address (``listen_port`` 0: a free port); processes in the
        region connect to ``relay.address``. Give home's services 127.0.0.1 (not 0.0.0.0), or a region could
        also reach them directly on the link address, with the link's rate but without its delay.
        """
        link = self.links[region]
        return self.start_relay(HOME, (link.home_addr, listen_port), (target_host, target_port), link.spec.one_way_ms)

    @contextlib.contextmanager
    def entered(self, role: str) -> Iterator[None]:
        """Run the calling thread in ``home`` or a region's namespace, and back to where it was after.

        For a harness whose own sockets must live there (a benchmark polling Redis on home's 127.0.0.1). Only the
        calling thread moves, and what it starts inherits it: threads and child processes started inside the
        block, sockets opened inside it (they stay in that namespace after the block). Enter from the thread
        that starts the work, before it starts any. The lab never kills its owner (see
        :func:`bucketrl.sim.netlab.cleanup.kill_namespace_processes`), so closing the lab inside the block is safe.
        """
        back = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            there = os.open(f"/run/netns/{self.ns(role)}", os.O_RDONLY)
            try:
                _setns(there)
            finally:
                os.close(there)
            try:
                yield
            finally:
                _setns(back)
        finally:
            os.close(back)

    def link_bytes(self, region: str) -> dict[str, int]:
        """Bytes that crossed ``region``'s link so far, per direction, from home's end of the veth: ``down``
        (home to the region) and ``up`` (the region to home). Counted by the kernel, headers included; a dropped
        link's black-holed packets count as sent but not as received."""
        link = self.links[region]
        out = subprocess.run(
            ["ip", "-n", link.home_ns, "-j", "-s", "link", "show", "dev", link.home_if],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return {"down": int(stats["tx"]["bytes"]), "up": int(stats["rx"]["bytes"])}

    # --- dropping links ------------------------------------------------------------------------------------------

    def drop(self, region: str, mode: DropMode = "blackhole") -> None:
        """Cut ``region``'s link until :meth:`restore` (see :mod:`bucketrl.sim.netlab.drop` for what TCP sees)."""
        link = self.links[region]
        if link.dropped is not None and link.dropped != mode:
            self.restore(region)
        drop_ends(link.ends(), mode)
        link.dropped = mode

    def restore(self, region: str) -> None:
        link = self.links[region]
        if link.dropped is not None:
            restore_ends(link.ends(), link.dropped)
            link.dropped = None

    def drop_for(self, region: str, seconds: float, mode: DropMode = "blackhole") -> threading.Timer:
        """Drop the link now and restore it ``seconds`` later, without blocking; returns the restoring timer."""
        self.drop(region, mode)
        timer = threading.Timer(seconds, self._restore_quietly, args=(region,))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)
        return timer

    def _restore_quietly(self, region: str) -> None:
        if not self._closed:
            self.restore(region)

    # --- closing -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the lab's namespaces and delete them; veths, qdiscs and nft tables go with them."""
        if self._closed:
            return
        self._closed = True
        for t in self._timers:
            t.cancel()
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for name in reversed(self._namespaces):
            cleanup.delete_namespace(name)
        for p in self._procs:
            # Reap: a zombie holds no namespace, but it clutters the caller's process table.
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
            if p.stdout is not None:
                p.stdout.close()
        _LIVE.discard(self)

    def __enter__(self) -> Lab:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def uniform(regions: Sequence[str], rtt_ms: float, mbit: float) -> dict[str, LinkSpec]:
    """The same link to every region: the CLI's and most benchmarks' case."""
    return {r: LinkSpec(rtt_ms=rtt_ms, mbit=mbit) for r in regions}
