"""The core package (wire models, settings, client, the rollout domain, every command's light ``cli`` module) must
import without any optional dependency: the proxy image has no torch, the trainer's no FastAPI. The static rules
(layers, circles, imports inside functions) are in tests/test_layers.py; this checks the result at run time."""

import subprocess
import sys

from tests.test_layers import HEAVY_IMPORTS, heavy_modules

CORE = (
    "bucketrl.wire",
    "bucketrl.settings",
    "bucketrl.client",
    "bucketrl.errors",
    "bucketrl.rollout.engine",
    "bucketrl.rollout.episodes",
    "bucketrl.proxy.settings",
    "bucketrl.cli",
)


def test_core_imports_without_optional_dependencies() -> None:
    assert not set(CORE) & heavy_modules()  # what the static check says; now the interpreter's word
    code = (
        "import importlib, sys\n"
        f"for name in {CORE!r}:\n"
        "    importlib.import_module(name)\n"
        f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {sorted(HEAVY_IMPORTS)!r})\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_is_fast_and_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "--help"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    for cmd in ("proxy", "trainer", "generator", "up", "status"):
        assert cmd in out
