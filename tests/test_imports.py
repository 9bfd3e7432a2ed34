"""The core package (wire models, settings, client) must import without torch: the proxy image has none."""

import subprocess
import sys


def test_core_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "import bucketrl.wire, bucketrl.settings, bucketrl.client, bucketrl.errors, bucketrl.cli\n"
        "import bucketrl.proxy.settings\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'peft') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_help_is_fast_and_lists_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bucketrl.cli", "--help"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    for cmd in ("proxy", "trainer", "generator", "up", "status"):
        assert cmd in out
