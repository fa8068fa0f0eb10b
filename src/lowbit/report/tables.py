"""Rendering of result data as rich tables.  Results are data first (``to_dict()``);
this module only draws them."""

from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from ..numerics import formats as F
from ..numerics.lessons import FormatFacts, SchemeError

__all__ = ["formats_table", "grids_table", "bit_layouts_table", "errors_table", "num", "print_tables"]


def num(v: float, digits: int = 4) -> str:
    """Compact number: ``—`` for NaN; the exact value when it is short (57344, 0.015625);
    otherwise ``digits`` significant digits, scientific for very small or large magnitudes."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    exact = repr(float(v)).removesuffix(".0")
    if "e" not in exact and len(exact.lstrip("-").replace(".", "").lstrip("0")) <= max(digits, 6):
        return exact
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


def _pm(v: float | None, ci: tuple[float, float] | None, fmt: str) -> str:
    if v is None:
        return "—"
    if ci is None:
        return format(v, fmt)
    half = (ci[1] - ci[0]) / 2
    return f"{format(v, fmt)} ± {format(half, fmt)}"


def _data_note(c) -> str:
    """What differs from the default data: another calibration corpus, assistant-only loss."""
    note = ""
    calib = getattr(c, "calib_corpus", "") or c.corpus
    if calib != c.corpus:
        note += f"; calibrated on {calib} (train split)"
    if getattr(c, "loss_on", "all") == "assistant":
        note += "; metrics over the assistant's tokens only"
    return note


def comparison_table(c) -> Table:
    """The rows of a :class:`lowbit.evaluation.compare.Comparison`."""
    t = Table(
        title=f"{c.model} on {c.corpus} ({c.split} split): {c.windows} windows × {c.seq_len} tokens, "
        f"{c.tokens:,} predicted tokens, seed {c.seed}; ± is a 95% bootstrap half-width"
        + _data_note(c),
        title_justify="left",
    )
    for col in ("configuration", "PPL", "Δ%", "KL mean", "KL p99", "top-1 agree", "W bits", "KV bits"):
        t.add_column(col, justify="left" if col == "configuration" else "right", no_wrap=col != "configuration")
    for r in c.rows:
        e = r.eval
        delta = "—" if e.delta_pct is None else f"{e.delta_pct:+.2f}" + (
            f" [{e.delta_ci[0]:+.1f}, {e.delta_ci[1]:+.1f}]" if e.delta_ci else "")
        t.add_row(
            f"{r.recipe}\n[dim]{r.description}[/dim]",
            _pm(e.ppl, e.ppl_ci, ".3f"),
            delta,
            _pm(e.kl_mean, e.kl_ci, ".4f"),
            "—" if e.kl_p99 is None else f"{e.kl_p99:.3f}",
            "—" if e.top1 is None else f"{e.top1:.3f}",
            f"{r.weight_bits:.3f}",
            f"{r.kv_bits:g}",
        )
    return t


def stages_table(stage_seconds: dict[str, float]) -> Table:
    t = Table(title="Time per stage", title_justify="left")
    t.add_column("stage")
    t.add_column("seconds", justify="right")
    for k, v in stage_seconds.items():
        t.add_row(k, f"{v:.1f}")
    t.add_row("[bold]total[/bold]", f"{sum(stage_seconds.values()):.1f}")
    return t


def sensitivity_table(rows, recipe: str) -> Table:
    t = Table(title=f"Sensitivity to {recipe}: one module type, decoder layer or MoE expert quantized at a time, "
              "most damaging first", title_justify="left")
    for col in ("rank", "quantized", "KL mean", "Δ% PPL", "top-1 agree"):
        t.add_column(col, justify="left" if col == "quantized" else "right")
    for i, r in enumerate(rows, 1):
        e = r.row.eval
        t.add_row(str(i), f"{r.kind}: {r.target}", f"{e.kl_mean:.5f}", f"{e.delta_pct:+.2f}", f"{e.top1:.4f}")
    return t


def kv_stats_table(rows, model: str) -> Table:
    t = Table(title=f"{model}: what each layer writes to the KV cache, and the FP8 error "
              "(relative ‖x − Q(x)‖/‖x‖)", title_justify="left")
    for col in ("layer", "|K| max", "|K| median", "K channel spread", "K head spread", "|V| max", "|V| median",
                "K err / tensor", "K err / head", "V err / tensor"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.layer), num(r.k_absmax), num(r.k_median), f"{r.k_channel_spread:.1f}",
                  f"{r.k_head_spread:.2f}", num(r.v_absmax), num(r.v_median), f"{r.k_err_tensor:.4f}",
                  f"{r.k_err_head:.4f}", f"{r.v_err_tensor:.4f}")
    return t


def kv_signal_table(rows, model: str) -> Table:
    """The error against what the signal varies by: relative to ‖x − mean over tokens‖."""
    t = Table(title=f"{model}: the KV error against the signal (‖x − Q(x)‖ / ‖x − mean‖, the mean per channel "
              "across tokens)", title_justify="left")
    for col in ("layer", "K max |mean|/std", "K FP8", "K FP8 worst channel", "K FP8 centered", "K INT8 asym/channel",
                "V FP8"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r.layer), f"{r.k_bias_ratio:.1f}", f"{r.k_err_signal:.4f}", f"{r.k_err_signal_worst:.4f}",
                  f"{r.k_err_signal_centered:.4f}", f"{r.k_err_signal_int8_asym:.4f}", f"{r.v_err_signal:.4f}")
    return t


def long_context_table(res) -> Table:
    """One row per (recipe, position bucket): perplexity, Δ% against the reference on the same
    tokens, and KL, with 95% intervals over windows."""
    t = Table(title=f"{res.model}: by position, {res.windows} windows of {res.length:,} tokens of {res.corpus} (test)",
              title_justify="left")
    for col in ("recipe", "positions", "tokens", "PPL", "Δ% PPL [95% CI]", "KL mean [95% CI]"):
        t.add_column(col, justify="left" if col == "recipe" else "right")
    for r in res.rows:
        for i, b in enumerate(r.buckets):
            delta = "—" if b.delta_pct is None else f"{b.delta_pct:+.2f} [{b.delta_ci[0]:+.2f}, {b.delta_ci[1]:+.2f}]"
            kl = "—" if b.kl_mean is None else f"{b.kl_mean:.5f} [{b.kl_ci[0]:.5f}, {b.kl_ci[1]:.5f}]"
            t.add_row(r.recipe if i == 0 else "", f"{b.lo:,}–{b.hi:,}", f"{b.tokens:,}", f"{b.ppl:.3f}", delta, kl)
    return t
