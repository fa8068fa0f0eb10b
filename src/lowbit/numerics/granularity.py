"""Which elements share a scale, as a block shape over a tensor's last two dims.

A tensor of any rank is viewed as a matrix ``(rows, cols)``: the last dim is ``cols``
(the input dim of a Linear weight, the hidden dim of an activation) and every other
dim is folded into ``rows`` (output channels, or tokens).  A granularity is then the
shape of the block that shares one scale:

============  ===================  ===========================================
granularity   block                 scale shape for ``(rows, cols)``
============  ===================  ===========================================
TENSOR        (rows, cols)          (1, 1)
CHANNEL       (1, cols)             (rows, 1) — one per weight output row
TOKEN         (1, cols)             (rows, 1) — one per activation row (token)
group(n)      (1, n)                (rows, ceil(cols / n))
block(r, c)   (r, c)                (ceil(rows / r), ceil(cols / c))
HEAD          per index of dim -3   (heads, 1) — KV cache ``(..., heads, seq, dim)``
============  ===================  ===========================================

A group or block that does not divide its dim leaves a ragged last block, as
compressed-tensors does; the scale shape uses ``ceil``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Granularity", "TENSOR", "CHANNEL", "TOKEN", "HEAD", "group", "block", "parse_granularity"]

_KINDS = ("tensor", "channel", "token", "group", "block", "head")


@dataclass(frozen=True)
class Granularity:
    """A scale-sharing block.  Build with the constants or ``group(n)`` / ``block(r, c)``."""

    kind: str
    rows: int = 0  # block rows, for "block"
    cols: int = 0  # block cols, for "group" and "block"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown granularity {self.kind!r}; expected one of {_KINDS}")
        if self.kind == "group" and self.cols < 1:
            raise ValueError(f"group size must be a positive integer, got {self.cols}")
        if self.kind == "block" and (self.rows < 1 or self.cols < 1):
            raise ValueError(f"block shape must be positive, got ({self.rows}, {self.cols})")
        if self.kind in ("tensor", "channel", "token", "head") and (self.rows or self.cols):
            raise ValueError(f"granularity {self.kind!r} takes no size")

    def __str__(self) -> str:
        if self.kind == "group":
            return f"group({self.cols})"
        if self.kind == "block":
            return f"block({self.rows}x{self.cols})"
        return self.kind

    def block_shape(self, rows: int, cols: int) -> tuple[int, int]:
        """The block, in elements, for a ``(rows, cols)`` matrix view."""
        if self.kind == "tensor":
            return rows, cols
        if self.kind in ("channel", "token", "head"):
            return 1, cols  # for HEAD the matrix view has one row per head
        if self.kind == "group":
            return 1, self.cols
        return self.rows, self.cols

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """Shape of the scale tensor for a tensor of ``shape``."""
        rows, cols = matrix_shape(shape, self)
        br, bc = self.block_shape(rows, cols)
        return math.ceil(rows / br), math.ceil(cols / bc)

    def block_elements(self, shape: tuple[int, ...]) -> int:
        """Elements per (full) block for a tensor of ``shape``."""
        rows, cols = matrix_shape(shape, self)
        br, bc = self.block_shape(rows, cols)
        return min(br, rows) * min(bc, cols)


TENSOR = Granularity("tensor")
CHANNEL = Granularity("channel")
TOKEN = Granularity("token")
HEAD = Granularity("head")


def group(n: int) -> Granularity:
    return Granularity("group", cols=n)


def block(r: int, c: int) -> Granularity:
    return Granularity("block", rows=r, cols=c)


def parse_granularity(text: str) -> Granularity:
    """Parse ``tensor``, ``channel``, ``token``, ``head``, ``group:128`` / ``group(128)``,
    ``block:128x128`` / ``block(128x128)``."""
    t = text.strip().lower().replace("(", ":").replace(")", "")
    name, _, arg = t.partition(":")
    try:
        if name == "group":
            return group(int(arg))
        if name == "block":
            r, _, c = arg.partition("x")
            return block(int(r), int(c))
    except ValueError:
        raise ValueError(f"cannot parse granularity {text!r}: expected e.g. group:128 or block:128x128") from None
    if name in ("tensor", "channel", "token", "head") and not arg:
        return Granularity(name)
    raise ValueError(f"unknown granularity {text!r}; expected tensor, channel, token, head, group:N or block:RxC")


# -- the matrix view every quantizer works on ------------------------------------------


def matrix_shape(shape: tuple[int, ...], gran: Granularity) -> tuple[int, int]:
    if gran.kind == "head":
        if len(shape) < 3:
            raise ValueError(f"HEAD granularity needs a (..., heads, seq, dim) tensor, got shape {tuple(shape)}")
        return shape[-3], math.prod(shape) // shape[-3]
    if len(shape) == 0:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def matrix_view(x: torch.Tensor, gran: Granularity) -> torch.Tensor:
    """``x`` as the ``(rows, cols)`` matrix the granularity is defined on.

    For HEAD the head dim (-3) becomes the rows, so per-head is per-row.
    """
    if gran.kind == "head":
        rows, cols = matrix_shape(tuple(x.shape), gran)
        return x.movedim(-3, 0).reshape(rows, cols)
    return x.reshape(matrix_shape(tuple(x.shape), gran))


def from_matrix_view(m: torch.Tensor, shape: tuple[int, ...], gran: Granularity) -> torch.Tensor:
    """Inverse of :func:`matrix_view`."""
    if gran.kind == "head":
        moved = (shape[-3],) + tuple(shape[:-3]) + tuple(shape[-2:])
        return m.reshape(moved).movedim(0, -3)
    return m.reshape(shape)


def blocked(m: torch.Tensor, gran: Granularity, pad_value: float = 0.0) -> torch.Tensor:
    """A ``(R, br, C, bc)`` view of matrix ``m`` split into blocks (padding a ragged edge).

    Reductions over dims (1, 3) give one value per block; a scale of shape
    ``(R, 1, C, 1)`` broadcasts back over the blocks.
    """
    rows, cols = m.shape
    br, bc = gran.block_shape(rows, cols)
    br, bc = min(br, rows), min(bc, cols)
    nr, nc = math.ceil(rows / br), math.ceil(cols / bc)
    pr, pc = nr * br - rows, nc * bc - cols
    if pr or pc:
        m = torch.nn.functional.pad(m, (0, pc, 0, pr), value=pad_value)
    return m.reshape(nr, br, nc, bc)


def unblocked(b: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of :func:`blocked`: drop the padding and return the ``(rows, cols)`` matrix."""
    nr, br, nc, bc = b.shape
    m = b.reshape(nr * br, nc * bc)
    if nr * br != rows or nc * bc != cols:
        m = m[:rows, :cols]
    return m
