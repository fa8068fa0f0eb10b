"""The package version, in a module of its own so that any stage can read it without importing the package."""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

__version__ = "0.1.0"

_ROOT = Path(__file__).resolve().parent


def source_digest(*modules: str) -> str:
    """A digest of lowbit's source: cache keys include it, so that results computed by other
    code (a changed quantizer, evaluator or simulator) are never read back.

    With no argument it covers every file of the package.  Given module names (``lowbit.evaluation.rowcache``)
    it covers those modules and every lowbit module they import, transitively, imports inside
    functions included, plus the data files (``gpus.yaml``) of the packages they live in: what can
    change the cached result.  A change to the CLI or a report then leaves computed rows valid,
    and so does an edit of comments or docstrings anywhere (the code is hashed as its AST).
    """
    return _digest(tuple(sorted(modules)))


@functools.lru_cache(maxsize=None)
def _digest(modules: tuple[str, ...]) -> str:
    files = sorted(_ROOT.rglob("*.py")) if not modules else _closure(modules)
    h = hashlib.sha256()
    for path in files:
        h.update(str(path.relative_to(_ROOT)).encode())
        h.update(_code(path.read_text()).encode() if path.suffix == ".py" else path.read_bytes())
    return h.hexdigest()[:16]


def _code(source: str) -> str:
    """The code of a module without its comments, docstrings and layout (its AST, docstrings
    dropped): editing prose leaves cached results valid."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def _module_path(name: str) -> Path | None:
    rel = Path(*name.split(".")[1:])
    for path in (_ROOT / rel.with_suffix(".py") if rel.parts else None, _ROOT / rel / "__init__.py"):
        if path is not None and path.is_file():
            return path
    return None


def _closure(modules: tuple[str, ...]) -> list[Path]:
    seen: set[str] = set()
    todo = list(modules)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        path = _module_path(name)
        if path is None:
            raise ValueError(f"source_digest: no lowbit module {name!r}")
        seen.add(name)
        todo.extend(_imports(name, path))
    paths = {_module_path(n) for n in seen}
    for p in list(paths):  # data files the modules read (the GPU table, ...)
        paths.update(f for f in p.parent.iterdir() if f.is_file() and f.suffix in (".yaml", ".yml", ".json"))
    return sorted(paths)


def _imports(name: str, path: Path) -> set[str]:
    """The lowbit modules ``path`` (module ``name``) imports anywhere in its body; ``from pkg
    import x`` counts as the submodule ``pkg.x`` where there is one, else as ``pkg``."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.split(".")[0] == "lowbit")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "lowbit":
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.add(sub if _module_path(sub) is not None else target)
    return out
