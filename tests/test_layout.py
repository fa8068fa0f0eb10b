"""The package layout stays what docs/architecture.md draws: no import cycles, and no stage
imports a stage above it.

Every import counts, also those inside functions (a lazy import that climbs a layer is
still a dependency on it); only imports under ``if TYPE_CHECKING:`` are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "lowbit"

#: stage → the stages it may import (besides itself and ``_version``, which every stage may read).
#: The order of docs/architecture.md.
ALLOWED: dict[str, set[str]] = {
    "_version": set(),
    "util": set(),
    "numerics": {"util"},
    "models": {"util"},
    "data": {"util", "models"},
    "quantization": {"util", "numerics", "models", "data"},
    "evaluation": {"util", "numerics", "models", "data", "quantization"},
    "checkpoint": {"util", "numerics", "models", "quantization"},
    "sim": {"util", "numerics"},
    "workflows": {"util", "numerics", "models", "data", "quantization", "evaluation", "checkpoint"},
    "planning": {"util", "numerics", "models", "data", "quantization", "evaluation", "checkpoint", "sim", "workflows"},
    "engines": {"util", "numerics", "models", "data", "quantization", "evaluation", "checkpoint", "workflows"},
    "report": {"util", "numerics", "models", "data", "quantization", "evaluation", "checkpoint", "sim", "workflows",
               "planning", "engines"},
    "cli": {"util", "numerics", "models", "data", "quantization", "evaluation", "checkpoint", "sim",
            "workflows", "planning", "engines", "report"},
    "__main__": {"cli"},  # ``python -m lowbit``: the CLI and nothing else
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The lowbit modules ``path`` imports (a ``from pkg import name`` of a submodule counts
    as that submodule)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names if a.name.split(".")[0] == "lowbit")
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target.split(".")[0] != "lowbit":
                    continue
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    out.add(sub if sub in modules else target)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def _graph() -> dict[str, set[str]]:
    files = sorted(SRC.rglob("*.py"))
    modules = {_module_name(f) for f in files}
    return {_module_name(f): {m for m in _imports(f, modules) if m in modules} - {_module_name(f)} for f in files}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: the package root, which may import anything


def test_every_stage_is_declared():
    stages = {_stage(m) for m in _graph()} - {None}
    assert stages <= set(ALLOWED), f"undeclared stages: {sorted(stages - set(ALLOWED))}; add them to ALLOWED " \
                                   "and to docs/architecture.md"


def test_no_stage_imports_a_stage_above_it():
    bad = []
    for mod, deps in _graph().items():
        src = _stage(mod)
        if src is None:
            continue
        for d in deps:
            dst = _stage(d)
            if dst is None:
                bad.append(f"{mod} imports the package root ({d})")
            elif dst != src and dst != "_version" and dst not in ALLOWED[src]:
                bad.append(f"{mod} ({src}) imports {d} ({dst})")
    assert not bad, "imports against the declared order:\n" + "\n".join(sorted(bad))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    # a package's __init__ re-exporting its own modules is not a cycle of the flow
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in _graph().items()}
    assert _cycles(graph) == []


def test_the_checker_sees_cycles_and_climbs():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    assert _stage("lowbit.numerics.scheme") == "numerics" and "evaluation" not in ALLOWED["checkpoint"]


@pytest.mark.parametrize("path", sorted(SRC.rglob("*.py")), ids=lambda p: str(p.relative_to(SRC)))
def test_modules_stay_small(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 420, f"{path.relative_to(SRC)} has {lines} lines; split it (docs/architecture.md)"
