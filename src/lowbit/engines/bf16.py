"""bf16 Linears computed as fp32 products of bf16 operands, rounded back to bf16.

A bf16 GEMM (oneDNN, vLLM's kernels) multiplies bf16 inputs with fp32 accumulation and
rounds the output to bf16; ``F.linear`` on bf16 tensors computes the same numbers (up to
summation order).  On CPUs without native bf16 instructions (AVX2) torch's bf16 GEMM is
~40× slower than fp32 (measured: 3.9 s against 0.11 s for 512×576 @ 576×1536), so lowbit's
bf16 prediction runs its Linears through this fp32 route instead.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F

__all__ = ["bf16_linear_via_fp32"]


@contextmanager
def bf16_linear_via_fp32() -> Iterator[None]:
    """While the block runs, ``F.linear`` with bf16 input and weight computes in fp32 and
    returns bf16 (other dtypes are untouched)."""
    orig = F.linear

    def linear(x, w, b=None):
        if x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16:
            return orig(x.float(), w.float(), None if b is None else b.float()).to(torch.bfloat16)
        return orig(x, w, b)

    F.linear = linear
    try:
        yield
    finally:
        F.linear = orig
