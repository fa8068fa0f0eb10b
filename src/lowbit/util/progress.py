"""Progress bars for long work (rich), silent when disabled or not on a terminal."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["progress_bar", "staged_progress"]


def progress_bar(items: Iterable[T], description: str, *, enabled: bool = True, total: int | None = None) -> Iterator[T]:
    """Iterate ``items`` with a progress bar on stderr when ``enabled`` and stderr is a
    terminal."""
    for it, _ in staged_progress(items, description, enabled=enabled, total=total):
        yield it


def staged_progress(items: Iterable[T], description: str, *, enabled: bool = True,
                    total: int | None = None) -> Iterator[tuple[T, Callable[[str], None]]]:
    """Like :func:`progress_bar`, yielding ``(item, stage)``: ``stage("GPTQ q_proj")`` shows
    what the current item is doing after the bar's description (a no-op when silent)."""
    if not enabled or not sys.stderr.isatty():
        for it in items:
            yield it, _silent
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[stage]}"))
    with Progress(*cols, console=Console(stderr=True), transient=True) as p:
        n = total if total is not None else (len(items) if hasattr(items, "__len__") else None)
        task = p.add_task(description, total=n, stage="")

        def stage(text: str) -> None:
            p.update(task, stage=text)

        for it in items:
            yield it, stage
            p.advance(task)


def _silent(text: str) -> None:
    pass
