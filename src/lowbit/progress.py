"""Progress bars for long work (rich), silent when disabled or not on a terminal."""

from __future__ import annotations

import sys
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["progress_bar"]


def progress_bar(items: Iterable[T], description: str, *, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """Iterate ``items`` with a progress bar on stderr when ``enabled`` and stderr is a
    terminal."""
    if not enabled or not sys.stderr.isatty():
        yield from items
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*cols, console=Console(stderr=True), transient=True) as p:
        n = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
        task = p.add_task(description, total=n)
        for it in items:
            yield it
            p.advance(task)
