"""The code's shape keeps itself (issue 21): no module under ``bucketrl/`` over 600 lines, no function over 80.

A function's length is its body's: from the first statement (its docstring, if any) to its last line. The
signature and decorators do not count, so a typer command's option declarations (one ``Annotated[...]``
parameter per option, e.g. ``bucketrl up``'s) are not held against it. Nested functions count on their own,
and the lines they take count in the function around them too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "bucketrl"
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# No exceptions: a module or function that grows past a limit is split where it grows.
ALLOWED_LONG_FILES: set[str] = set()
ALLOWED_LONG_FUNCTIONS: set[str] = set()


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def body_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement of the body to the function's last line."""
    assert node.end_lineno is not None
    return node.end_lineno - node.body[0].lineno + 1


def _functions(tree: ast.AST) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function with its qualified name (``Class.method``, ``outer.inner``)."""
    out: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                out.append((prefix + child.name, child))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def long_files() -> dict[str, int]:
    lines = {_rel(p): len(p.read_text().splitlines()) for p in _modules()}
    return {path: n for path, n in lines.items() if n > MAX_FILE_LINES}


def long_functions() -> dict[str, int]:
    found: dict[str, int] = {}
    for path in _modules():
        for name, node in _functions(ast.parse(path.read_text(), str(path))):
            n = body_lines(node)
            if n > MAX_FUNCTION_LINES:
                found[f"{_rel(path)}::{name}"] = n
    return found


def test_the_allowlists_name_nothing_that_fits() -> None:
    fitting = ALLOWED_LONG_FILES - set(long_files()) | ALLOWED_LONG_FUNCTIONS - set(long_functions())
    assert not fitting, f"allowlisted but within the limits now: delete from the allowlist: {sorted(fitting)}"


def test_no_module_is_over_600_lines() -> None:
    over = {path: n for path, n in long_files().items() if path not in ALLOWED_LONG_FILES}
    assert not over, f"modules over {MAX_FILE_LINES} lines (split them by what they do): {over}"


def test_no_function_body_is_over_80_lines() -> None:
    over = {name: n for name, n in long_functions().items() if name not in ALLOWED_LONG_FUNCTIONS}
    assert not over, f"function bodies over {MAX_FUNCTION_LINES} lines (extract named steps): {over}"


def test_the_measure_counts_the_body_not_the_signature(tmp_path: Path) -> None:
    """A long signature (typer options) does not count; a long body does, nested or not."""
    options = "".join(f"    o{i}: int = 0,\n" for i in range(200))
    body = "".join(f"        x{i} = {i}\n" for i in range(81))
    src = f"def command(\n{options}) -> None:\n    '''Doc.'''\n    pass\n\n\nclass C:\n    def m(self):\n{body}"
    found = {name: body_lines(node) for name, node in _functions(ast.parse(src))}
    assert found == {"command": 2, "C.m": 81}
