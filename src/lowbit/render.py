"""Rendering of result data as rich tables.  Results are data first (``to_dict()``);
this module only draws them."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from . import formats as F
from .lessons import FormatFacts, SchemeError

__all__ = ["formats_table", "grids_table", "bit_layouts_table", "errors_table", "num", "print_tables"]


def num(v: float, digits: int = 4) -> str:
    """Compact number: ``—`` for NaN, scientific for very small or large magnitudes."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    a = abs(v)
    if a != 0 and (a < 1e-3 or a >= 1e6):
        return f"{v:.{max(digits - 2, 1)}e}"
    return f"{v:.{digits}g}"


def formats_table(rows: list[FormatFacts]) -> Table:
    t = Table(title="Element formats (every number derived from the format's value table)", title_justify="left")
    for col in ("format", "bits", "layout", "max", "min normal", "min subnorm.", "step at 1", "specials"):
        t.add_column(col, justify="left" if col in ("format", "layout", "specials") else "right", no_wrap=True)
    for r in rows:
        t.add_row(r.name, str(r.bits), r.layout, num(r.max), num(r.min_normal), num(r.min_subnormal),
                  num(r.step_near_one), r.specials)
    return t


def grids_table(rows: list[FormatFacts]) -> Table:
    """The full non-negative value grid of each format of at most 4 bits."""
    t = Table(title="Non-negative values of the ≤ 4-bit formats (floats mirror them; intN adds −1 … −2^(N−1))", title_justify="left")
    t.add_column("format", no_wrap=True)
    t.add_column("values")
    for r in rows:
        if r.grid:
            t.add_row(r.name, " ".join(num(v, 3) for v in r.grid))
    return t


def bit_layouts_table() -> Table:
    """Bit layout of each float format, with one worked code."""
    t = Table(title="Bit layouts (most significant bit first)", title_justify="left")
    t.add_column("format")
    t.add_column("layout")
    t.add_column("bias", justify="right")
    t.add_column("example")
    for f in F.FORMATS.values():
        if f.kind == "int":
            continue
        if f.kind == "e8m0":
            t.add_row(f.name, "EEEEEEEE", str(f.bias), "0x7F = 2^0 = 1.0; 0xFF = NaN")
            continue
        layout = "S" + "E" * f.exponent_bits + "M" * f.mantissa_bits
        code = int(f.encode(__import__("torch").tensor([-1.5]))[0])
        t.add_row(f.name, layout, str(f.bias), f"-1.5 = {code:0{f.bits}b} (0x{code:02X})")
    return t


def errors_table(rows: list[SchemeError], shape: tuple[int, int]) -> Table:
    t = Table(
        title=f"Quantization error on a synthetic {shape[0]}×{shape[1]} weight (Student-t values, rows of "
        "different scale, 0.05% outliers)",
        title_justify="left",
    )
    for col in ("scheme", "format", "granularity", "bits/elem", "rel. error", "SQNR dB"):
        t.add_column(col, justify="right" if col in ("bits/elem", "rel. error", "SQNR dB") else "left")
    for r in rows:
        t.add_row(r.scheme, r.format, r.granularity, f"{r.bits_per_element:.3f}", f"{r.rel_error:.4f}", f"{r.sqnr_db:.1f}")
    return t


def print_tables(*tables: Table) -> None:
    console = Console()
    if not console.is_terminal:  # piped or captured: do not squeeze tables into 80 columns
        console = Console(width=140)
    for tb in tables:
        console.print(tb)
