"""Keeping the process's resident memory near what it actually uses (glibc's malloc).

In the lockstep pass (:mod:`lowbit.quantization.layerwise`) every calibration chunk is suspended at
each meeting point holding its activations, so chunk-lifetime tensors and each chunk's
short-lived temporaries interleave on the heap, and the freed holes between them stay
resident: on SmolLM2 the peak RSS ran ~800 MiB above the live tensors.  Two glibc
controls bring it down:

* :func:`trim` (``malloc_trim(0)``) returns every free heap page; the pipeline calls it at
  each meeting point (measured: peak −364 MiB, time +5%);
* :func:`map_large_allocations` serves allocations of at least 8 MiB — a chunk's
  MLP-wide activations — with their own memory mapping, returned to the system when
  freed instead of left as holes (measured with trimming: peak 1,672–1,695 → 1,413–1,497
  MiB, time within the run-to-run noise of ±7%).

Elsewhere (other C libraries) both do nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["trim", "map_large_allocations"]

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
#: glibc's largest dynamic mmap threshold on 64-bit systems; what the threshold is set back to
_DYNAMIC_MAX = 32 << 20


@functools.cache
def _libc(symbol: str):
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), symbol) if name else None
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Return free heap pages to the operating system; ``True`` if the C library could."""
    fn = _libc("malloc_trim")
    if fn is None:
        return False
    fn(0)
    return True


@contextmanager
def map_large_allocations(threshold: int = 8 << 20) -> Iterator[bool]:
    """While the block runs, allocations of at least ``threshold`` bytes get a memory
    mapping of their own (glibc ``M_MMAP_THRESHOLD``); yields whether that took effect.

    A request that a free block already on the heap can hold is still served from it; the
    threshold decides only what happens when the heap would otherwise have to grow.

    glibc normally raises this threshold by itself, up to 32 MiB, as mapped blocks are
    freed; setting it ends that, and there is no call to restore it, so on leaving the
    threshold is set to 32 MiB, where the dynamic one settles.
    """
    fn = _libc("mallopt")
    ok = fn is not None and fn(_M_MMAP_THRESHOLD, int(threshold)) == 1
    try:
        yield ok
    finally:
        if ok:
            fn(_M_MMAP_THRESHOLD, _DYNAMIC_MAX)
