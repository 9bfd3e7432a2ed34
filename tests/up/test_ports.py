"""Ports that no two processes can be handed (bucketrl.up.ports): several processes asking at once never get the same
number, never one the kernel could give to a bind(0) or an outgoing connection, and a killed owner's ports come back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bucketrl.up.ports import BLOCK, LOW, PortAllocator, _ephemeral_start

ASK = "import json, sys; from bucketrl.up.ports import free_port; print(json.dumps([free_port() for _ in range({n})]))"


def _ask_in_processes(count: int, per: int, env: dict[str, str]) -> list[list[int]]:
    procs = [
        subprocess.Popen([sys.executable, "-c", ASK.format(n=per)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(count)
    ]
    return [json.loads(p.communicate(timeout=60)[0]) for p in procs]


def test_processes_asking_at_once_never_share_a_port(tmp_path: Path) -> None:
    env = {**os.environ, "BUCKETRL_PORT_LOCK_DIR": str(tmp_path)}
    got = _ask_in_processes(4, 3 * BLOCK, env)  # each needs several blocks
    every = [p for ports in got for p in ports]
    assert len(every) == len(set(every)) == 4 * 3 * BLOCK
    assert all(LOW <= p < _ephemeral_start() for p in every), (min(every), max(every))


def test_a_live_owners_block_is_never_handed_out_and_a_killed_owners_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BUCKETRL_PORT_LOCK_DIR", str(tmp_path))
    hold = "from bucketrl.up.ports import free_port; print(free_port(), flush=True); import time; time.sleep(60)"
    owner = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        held = int(owner.stdout.readline())  # type: ignore[union-attr]
        start = LOW + (held - LOW) // BLOCK * BLOCK
        with pytest.raises(RuntimeError, match="held by another process"):
            PortAllocator(low=start, high=start + BLOCK).take()
        others = _ask_in_processes(2, 2 * BLOCK, dict(os.environ))
        assert not [p for ports in others for p in ports if start <= p < start + BLOCK]
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    # The kernel dropped the dead owner's lock with the process: its block can be taken again.
    assert start <= PortAllocator(low=start, high=start + BLOCK).take() < start + BLOCK
