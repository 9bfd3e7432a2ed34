"""The suite's own plugins, run on a small suite of their own: ``alone`` tests never overlap another test across xdist
workers, and every run writes each test's time and outcome to its times file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

RECORD = """
import os, time

def record(name):
    start = time.monotonic()
    time.sleep(0.3)
    with open(os.environ["SPANS"], "a") as f:
        f.write(f"{name} {start} {time.monotonic()} {os.environ['PYTEST_XDIST_WORKER']}\\n")
"""
# Three modules, so that under --dist loadfile both workers have shared tests to run beside each other.
MODULES = {
    "test_a.py": """
import pytest
from spans import record

@pytest.mark.parametrize("i", range(3))
def test_shared(i):
    record(f"shared-a{i}")

@pytest.mark.alone
@pytest.mark.parametrize("i", range(3))
def test_alone(i):
    record(f"alone{i}")

def test_fails():
    assert False
""",
    "test_b.py": """
import pytest
from spans import record

@pytest.mark.parametrize("i", range(3))
def test_shared(i):
    record(f"shared-b{i}")
""",
    "test_c.py": """
import pytest
from spans import record

@pytest.mark.parametrize("i", range(3))
def test_shared(i):
    record(f"shared-c{i}")
""",
}
CONFTEST = """
from tests.support import alone
pytest_plugins = ["tests.support.timings", "tests.support.alone"]

def pytest_collection_modifyitems(items):
    alone.order(items)
"""


Run = tuple[subprocess.CompletedProcess[str], list[tuple[str, float, float, str]], Path]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One run of the small suite on two workers, read by both tests."""
    tmp_path = tmp_path_factory.mktemp("mini")
    (tmp_path / "spans.py").write_text(RECORD)
    for name, text in MODULES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: whole machine\n")
    spans = tmp_path / "spans.txt"
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}:{tmp_path}",
        "SPANS": str(spans),
        "BUCKETRL_TEST_TIMES": str(tmp_path / "t.json"),
    }
    args = ["-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = [line.split() for line in spans.read_text().splitlines()]
    return proc, [(name, float(a), float(b), worker) for name, a, b, worker in lines], tmp_path / "t.json"


def test_alone_tests_overlap_no_other_test_across_workers(run: Run) -> None:
    proc, spans, _ = run
    assert proc.returncode == 1, proc.stdout[-2000:]  # test_fails failed, the rest ran
    assert len(spans) == 12
    # The shared tests do overlap each other (two workers), so the check below is not empty-handed.
    shared = [s for s in spans if s[0].startswith("shared")]
    assert any(a[1] < b[2] and b[1] < a[2] for a in shared for b in shared if a is not b)
    for name, start, end, _ in spans:
        if name.startswith("alone"):
            beside = [o for o in spans if o[0] != name and o[1] < end and start < o[2]]
            assert not beside, (name, beside)
    # One worker ran them back to back: the machine was handed over once, not once per alone test.
    alone = sorted(s for s in spans if s[0].startswith("alone"))
    assert len({s[3] for s in alone}) == 1
    first, last = min(s[1] for s in alone), max(s[2] for s in alone)
    assert not [s for s in shared if s[1] < last and first < s[2]], "a shared test ran between the alone ones"


def test_every_test_has_its_time_and_outcome(run: Run) -> None:
    times = json.loads(run[2].read_text())
    by_name = {t["name"]: t for t in times["tests"]}
    assert len(by_name) == 13 and times["workers"] == 2
    assert by_name["test_a.py::test_fails"]["outcome"] == "failed"
    assert all(0.3 <= t["seconds"] < 30 for n, t in by_name.items() if not n.endswith("test_fails"))
    assert {t["worker"] for t in times["tests"]} == {"gw0", "gw1"}
