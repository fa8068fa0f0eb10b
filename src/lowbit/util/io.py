"""Writing files so that nothing is lost: a temporary path, renamed when complete."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_write_text", "atomic_dir", "write_json", "refuse_existing"]


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def refuse_existing(path: Path | str | None, force: bool) -> None:
    """Raise ``FileExistsError`` if ``path`` exists and ``force`` is not set (checked before
    any work, so that a long run never ends in a refusal)."""
    if path is not None and Path(path).exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it")


def write_json(path: Path, data, *, force: bool = False) -> Path:
    """``data`` as indented JSON at ``path``, atomically; an existing file only with ``force``."""
    import json

    refuse_existing(path, force)
    atomic_write_text(Path(path), json.dumps(data, indent=2, default=_plain) + "\n")
    return Path(path)


def _plain(v):
    """JSON for values the standard encoder refuses: numpy scalars and arrays as numbers, the rest (paths, dtypes) as text."""
    if hasattr(v, "tolist"):
        return v.tolist()
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


@contextmanager
def atomic_dir(path: Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``path``; on success it replaces ``path``.

    An existing ``path`` is refused unless ``force``; on error the temporary folder is
    removed and ``path`` is untouched.
    """
    path = Path(path)
    if path.exists() and not force:
        raise FileExistsError(f"{path} exists; pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
