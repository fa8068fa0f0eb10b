"""Rendering of capacity results: rich tables and PNG plots.  Data in, text or files out."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from ..sim.capacity import CapacityTable, Curve
from ..sim.memory import MemoryReport

__all__ = ["memory_table", "capacity_rich_table", "plot_curves"]


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def memory_table(reports: list[MemoryReport]) -> Table:
    t = Table(title="memory and decode-speed bound")
    for col in ("plan", "GPU × tp", "weights", "per GPU", "KV/token", "KV capacity", "conversation",
                "fit at once", "decode bound"):
        t.add_column(col, justify="right" if col not in ("plan", "GPU × tp") else "left")
    for r in reports:
        t.add_row(r.plan, f"{r.gpu} × {r.tp}", _gb(r.weights_total), _gb(r.weights_per_gpu),
                  f"{r.kv_per_token_total / 1024:,.0f} KiB", f"{r.kv_capacity_tokens:,} tok",
                  f"{_gb(r.conversation_bytes)} ({r.context:,} tok)",
                  f"{r.conversations:,}" if r.fits else "does not fit",
                  f"{r.decode_ms_bound:.2f} ms/tok")
    return t


def capacity_rich_table(table: CapacityTable) -> Table:
    slo = table.slo
    parts = [f"TTFT ≤ {slo.ttft * 1e3:.0f} ms" if slo.ttft else "", f"TPOT ≤ {slo.tpot * 1e3:.0f} ms" if slo.tpot else "",
             f"E2E ≤ {slo.e2e:.1f} s" if slo.e2e else ""]
    form = f"p{slo.percentile:g}" if table.form == "percentile" else f"{slo.attainment:.0%} of requests"
    t = Table(title=f"{table.model} on {table.gpu} × {table.tp}, prompt {table.prompt_mean:g} / output "
                    f"{table.output_mean:g}, SLO {form}: {', '.join(p for p in parts if p)}")
    for col in ("plan", "lane", "TTFT (1 req)", "TPOT (1 req)", "max rate (req/s)", "seeds", "KV capacity"):
        t.add_column(col, justify="left" if col in ("plan", "lane") else "right")
    for r in table.rows:
        m = r.max_rate
        lane = r.lane + (" (weight-only)" if r.weight_only else "")
        t.add_row(r.plan, lane, f"{r.low_load_ttft * 1e3:.1f} ms", f"{r.low_load_tpot * 1e3:.2f} ms",
                  f"{m.median:.1f} [{m.low:.1f}–{m.high:.1f}]", str(len(m.seeds)),
                  f"{r.memory.kv_capacity_tokens:,} tok")
    return t


def plot_curves(curves: list[Curve], path: str | Path, title: str = "") -> Path:
    """TTFT and TPOT (p50 dashed, p99 solid) against request rate, one colour per plan."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, c in enumerate(curves):
        col = f"C{i}"
        a.plot(c.rates, [x * 1e3 for x in c.ttft_p99], color=col, label=f"{c.plan} p99")
        a.plot(c.rates, [x * 1e3 for x in c.ttft_p50], color=col, ls="--", label=f"{c.plan} p50")
        b.plot(c.rates, [x * 1e3 for x in c.tpot_p99], color=col, label=f"{c.plan} p99")
        b.plot(c.rates, [x * 1e3 for x in c.tpot_p50], color=col, ls="--", label=f"{c.plan} p50")
    a.set(xlabel="request rate (req/s)", ylabel="TTFT (ms)", yscale="log", title="time to first token")
    b.set(xlabel="request rate (req/s)", ylabel="TPOT (ms)", title="time per output token")
    a.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
