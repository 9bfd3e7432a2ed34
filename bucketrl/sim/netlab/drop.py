"""Dropping a lab link, two ways; what each looks like to TCP.

``blackhole`` (the default, and what a cloud link that fails usually looks like): an nft table in each of the
link's two namespaces drops every IP packet arriving on the link's interface, at the ``input`` hook. Packets
still leave; none arrive. Nothing errors locally: a ``connect()`` sends SYNs that go unanswered (retried after 1 s,
then 3 s, 7 s...: it fails only at the caller's timeout), and an established connection's sends sit unacknowledged
while TCP retransmits with a doubling timeout (from ~0.2 s). After the link is back, traffic resumes at the next
retransmission, so a stall lasts the outage plus up to one backed-off retransmission timeout (a 2 s outage:
~2-4 s). Connections survive an outage shorter than ``tcp_retries2``'s ~15 minutes. Dropping at ``input`` and not
``output`` matters: a packet dropped by ``output`` returns EPERM to the local sender, which no real outage does.
ARP is not IP and still passes, so neighbours stay resolved and recovery is immediate.

``down``: ``ip link set down`` on both ends. The kernel removes the link's routes, so a ``connect()`` from either
side fails at once with ENETUNREACH ("Network is unreachable"), and established connections stall as above
(their retransmissions fail locally and are retried). Bringing the link up restores the connected routes (the
lab adds no other routes, so nothing else needs restoring). This is an interface failure, rarer on a WAN.

The relay (:mod:`bucketrl.sim.netlab.delay`) is not involved in either: it keeps its connections, it just stops
hearing from the far side, as a process behind a real failed link would.
"""

from __future__ import annotations

import subprocess
from typing import Literal

from bucketrl.sim.netlab.cleanup import run_ip

DropMode = Literal["blackhole", "down"]


def _nft(ns: str, script: str) -> None:
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script, capture_output=True, text=True, timeout=30
    )
    if proc.returncode != 0:
        raise RuntimeError(f"nft in {ns} failed ({proc.returncode}): {proc.stderr.strip()}")


def _table(ifname: str) -> str:
    # One table per interface: home has one interface per region, and dropping region b must not undo a's drop.
    return "bnl_drop_" + ifname.replace("-", "_")


def blackhole(ns: str, ifname: str) -> None:
    t = _table(ifname)
    # "add" then "flush" makes this idempotent: dropping an already dropped link is not an error.
    _nft(
        ns,
        f"add table inet {t}\nflush table inet {t}\n"
        f"table inet {t} {{\n"
        f'  chain input {{ type filter hook input priority raw; policy accept; iifname "{ifname}" drop; }}\n'
        "}\n",
    )


def unblackhole(ns: str, ifname: str) -> None:
    t = _table(ifname)
    _nft(ns, f"add table inet {t}\ndelete table inet {t}\n")


def drop_ends(ends: list[tuple[str, str]], mode: DropMode) -> None:
    """Drop a link given as its (namespace, interface) ends."""
    for ns, ifname in ends:
        if mode == "blackhole":
            blackhole(ns, ifname)
        else:
            run_ip("-n", ns, "link", "set", ifname, "down")


def restore_ends(ends: list[tuple[str, str]], mode: DropMode) -> None:
    for ns, ifname in ends:
        if mode == "blackhole":
            unblackhole(ns, ifname)
        else:
            run_ip("-n", ns, "link", "set", ifname, "up")
