import platform
import subprocess
import sys
import textwrap

import pytest

from lowbit.util import heap

GLIBC = platform.libc_ver()[0] == "glibc"


def test_trim_is_available_on_glibc():
    assert heap.trim() is GLIBC


# In a fresh interpreter, so the heap left behind by earlier tests cannot decide the outcome.
# glibc's mallinfo2() counts the bytes held in separately mapped blocks (hblkhd): exact, where
# the resident-set size is noisy.
_CHILD = textwrap.dedent(
    """
    import ctypes, ctypes.util, torch
    from lowbit.util import heap

    class Info(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = Info
    mapped = lambda: libc.mallinfo2().hblkhd >> 20  # MiB

    # let glibc's dynamic threshold climb past 12 MiB blocks first (its default behaviour)
    for _ in range(3):
        t = torch.ones(12 << 18)
        del t
    start = mapped()
    kept = torch.ones(12 << 18)  # stays alive, so no free heap block can serve the next one
    default = mapped() - start
    with heap.map_large_allocations(8 << 20) as ok:
        assert ok
        t = torch.ones(12 << 18)
        during = mapped() - start
        del t
        after = mapped() - start
    print(default, during, after)
    """
)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_large_allocations_are_mapped_and_returned_when_freed():
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True
    ).stdout
    default, during, after = map(int, out.split())
    assert default == 0  # by default a 12 MiB block comes from the heap
    assert during >= 12  # with the threshold at 8 MiB it gets a mapping of its own
    assert after == 0  # unmapped as soon as it is freed
