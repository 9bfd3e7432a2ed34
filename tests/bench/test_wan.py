"""``bench/wan.py``: one short point at 100 ms RTT (root: it builds a network lab), checking that the delay is
real in what it measures (weight sync takes at least one round trip, a long-poll wake-up at least one one-way
delay), that the links carried at least every loaded adapter, and that the proxy's accounting is exact; and its
arguments, anywhere."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from bucketrl.sim.netlab import cleanup

ROOT = Path(__file__).resolve().parents[2]
RTT_MS = 100.0


@pytest.fixture(scope="module")
def wan() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wan", ROOT / "bench" / "wan.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["wan"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_arguments(wan: ModuleType) -> None:
    args = wan.parse_args(["--rtt-ms", "0,50,150", "--regions", "a,b", "--duration-s", "60", "--drop-s", "30"])
    assert args.rtts == [0.0, 50.0, 150.0]
    assert (args.drop_region, args.drop_at_s) == ("a", 15.0)
    with pytest.raises(SystemExit):  # a drop that would still be on when the trainer stops
        wan.parse_args(["--duration-s", "30", "--drop-s", "25"])
    assert wan.parse_args([]).modes == ["direct"]
    assert wan.parse_args(["--mode", "direct,relay"]).modes == ["direct", "relay"]
    with pytest.raises(SystemExit):
        wan.parse_args(["--mode", "relays"])


@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
def test_one_point_at_100ms(tmp_path: Path) -> None:
    out = tmp_path / "wan.json"
    argv = [sys.executable, str(ROOT / "bench" / "wan.py"), "--rtt-ms", f"{RTT_MS:g}", "--generators", "4"]
    argv += ["--duration-s", "18", "--step-s", "1.5", "--groups-per-step", "2", "--adapter-mb", "1", "--json", str(out)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        stdout, stderr = proc.communicate(timeout=170)
    finally:
        proc.kill()  # no-op once it exited; on a timeout its SIGKILLed lab is swept by the next lab's start
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    # The lab went with the benchmark (its namespaces carry the owner's pid).
    assert not [n for n in cleanup.lab_namespaces() if n.pid == proc.pid]
    p = json.loads(out.read_text())["by_rtt_ms"][f"{RTT_MS:g}"]
    assert p["errors"] == [], p
    assert p["accounting_ok"], p["groups"]
    assert p["groups"]["lost"] == 0 and p["groups"]["trained"] > 0
    assert p["sync_versions"] >= 1
    # Publish -> loaded needs the long-poll's answer, a lease and a download across the link: > 1 RTT.
    assert p["sync_p50_s"] >= RTT_MS / 1000, p
    assert p["wakeup_p50_ms"] >= RTT_MS / 2, p
    # Every load crossed a link (the tar holds the adapter plus a little; TCP/IP headers add more).
    assert p["wan_bytes_per_version"] >= p["adapter_bytes_x_loads_per_version"] > 0, p
