"""The proxy's Redis scripts live in ``bucketrl/proxy/state/scripts/*.lua`` (``state/lua.py``): none inline in Python,
none orphaned, each script the files it names joined in order (shared functions first)."""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from bucketrl.proxy.state import claim
from bucketrl.proxy.state.lua import SCRIPTS, Lua

ROOT = Path(__file__).resolve().parents[2]
STATE = ROOT / "bucketrl/proxy/state"


def _loads() -> dict[str, list[str]]:
    """Every ``Lua.load(...)`` call in bucketrl/, by 'file:line' -> the names it loads."""
    out: dict[str, list[str]] = {}
    for path in (ROOT / "bucketrl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "Lua.load":
                out[f"{path.relative_to(ROOT)}:{node.lineno}"] = [ast.literal_eval(a) for a in node.args]
            elif isinstance(node, ast.Call) and ast.unparse(node.func) == "Lua" and path.parts[-1] != "lua.py":
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno}: an inline script; put it in scripts/")
    return out


def test_every_script_file_is_loaded_and_every_load_names_a_file() -> None:
    files = {p.name for p in (STATE / "scripts").glob("*.lua")}
    named = {name for names in _loads().values() for name in names}
    assert named <= files, named - files
    assert files <= named, f"orphaned: {sorted(files - named)}"


def test_a_script_is_its_files_joined_in_order_and_called_by_that_sha() -> None:
    parts = ["queued_groups.lua", "queue_common.lua", "claim.lua"]
    source = "".join(SCRIPTS.joinpath(name).read_text() for name in parts)
    assert Lua.load(*parts).source == source == claim._CLAIM.source
    assert claim._CLAIM.sha == hashlib.sha1(source.encode()).hexdigest()
    assert "local function queued_groups" in source and "local function settle" in source
