"""The package's floors, read from its source (no import of it): no import cycles, counting deferred imports and
``TYPE_CHECKING`` ones; the rollout never reaches up into the trainer; the engines never reach up into the rollout
strategies; the RL loop fits on a screen; no module grows past what one reader holds."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridrl"
MAX_FIT_LINES = 60
MAX_MODULE_LINES = 500


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its text (top level, in functions, under
    ``TYPE_CHECKING``); ``from pkg import name`` counts as ``pkg.name`` when that is a module, else ``pkg``."""
    mods = modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = resolve(name) if name.startswith("hybridrl") else None
                if target is not None and target != mod:
                    graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_the_rollout_never_imports_the_trainer_and_the_engines_never_import_the_rollout_strategies() -> None:
    graph = import_graph()
    rollout = {m: deps for m, deps in graph.items() if m.startswith("hybridrl.rollout")}
    assert rollout, "no rollout modules found"
    assert {m for m, deps in rollout.items() if "hybridrl.hybrid" in deps} == set()
    engines = {m: deps for m, deps in rollout.items() if m.startswith("hybridrl.rollout.engines")}
    assert {"hybridrl.rollout.engines.hf", "hybridrl.rollout.engines.sglang", "hybridrl.rollout.engines.vllm"} <= set(
        engines)
    upward = {m: sorted(d for d in deps if d.startswith("hybridrl.rollout.") and not d.startswith(
        "hybridrl.rollout.engines")) for m, deps in engines.items()}
    assert {m: d for m, d in upward.items() if d} == {}


def test_the_rl_loop_fits_on_a_screen() -> None:
    tree = ast.parse((PACKAGE / "trainers" / "rl.py").read_text())
    fit = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "fit")
    assert fit.end_lineno is not None
    assert fit.end_lineno - fit.lineno + 1 <= MAX_FIT_LINES


def test_no_module_is_longer_than_one_reader_holds() -> None:
    long = {str(p.relative_to(PACKAGE.parent)): n for p in modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}
