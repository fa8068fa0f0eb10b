"""Rendering of ``lowbit search``: the chosen format of each unit, predicted against measured
loss, and the curve of measured KL against average bits (data in, text or PNG out)."""

from __future__ import annotations

import os
from pathlib import Path

from rich.table import Table

from ..planning.search import SearchResult
from ..util.io import refuse_existing

__all__ = ["choices_table", "search_table", "plot_curve"]


def choices_table(result: SearchResult) -> Table:
    """One row per decoder layer and one column per unit kind (``module`` granularity), or one
    row per unit (``layer`` and ``type``)."""
    t = Table(title=f"{result.model}: formats chosen at {result.average_bits:.3f} average bits "
                    f"(budget {result.budget_bits:g}, {result.granularity} units)", title_justify="left")
    if result.granularity != "module":
        for col in ("unit", "format", "bits", "predicted KL"):
            t.add_column(col, justify="right" if col in ("bits", "predicted KL") else "left")
        for c in result.choices:
            t.add_row(c.unit, c.candidate, f"{c.bits:.3f}", f"{c.predicted_kl:.5f}")
        return t
    rows: dict[str, dict[str, str]] = {}
    kinds: list[str] = []
    for c in result.choices:
        layer, _, kind = c.unit.partition(".layers.")[2].partition(".")
        if kind not in kinds:
            kinds.append(kind)
        rows.setdefault(layer, {})[kind] = c.candidate
    t.add_column("layer", justify="right")
    for k in kinds:
        t.add_column(k.split(".", 1)[-1])
    for layer, cells in rows.items():
        t.add_row(layer, *(cells.get(k, "") for k in kinds))
    return t


def search_table(results: list[SearchResult]) -> Table:
    """Budget, average bits, format counts, predicted and (when measured) measured loss."""
    t = Table(title="Predicted against measured (the additivity check)", title_justify="left")
    for col in ("mix", "budget", "avg bits", "formats", "predicted KL", "measured KL", "measured/predicted", "PPL Δ%"):
        t.add_column(col, justify="left" if col in ("mix", "formats") else "right")
    for r in results:
        m = r.measured.eval if r.measured else None
        counts = ", ".join(f"{k} {v}" for k, v in r.counts().items() if v)
        t.add_row(r.recipe.name, f"{r.budget_bits:g}", f"{r.average_bits:.3f}", counts, f"{r.predicted_kl:.4f}",
                  f"{m.kl_mean:.4f}" if m else "—", f"{m.kl_mean / r.predicted_kl:.2f}" if m and r.predicted_kl else "—",
                  f"{m.delta_pct:+.2f}" if m else "—")
    return t


def plot_curve(points: list[dict], path: str | Path, title: str = "", force: bool = False) -> Path:
    """Measured KL (log scale) and PPL Δ% against average weight bits: ``points`` are
    ``{"label", "kind" (search | uniform | heuristic), "bits", "kl", "ppl_delta"}``; searched
    mixes are joined by a line.  Written atomically; an existing file only with ``force``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    refuse_existing(path, force)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    style = {"search": ("C0", "o"), "uniform": ("C1", "s"), "heuristic": ("C2", "^")}
    for ax, key, label in ((axes[0], "kl", "KL to the reference (nats/token)"), (axes[1], "ppl_delta", "PPL Δ %")):
        for kind, (col, mark) in style.items():
            pts = sorted((p for p in points if p["kind"] == kind), key=lambda p: p["bits"])
            if not pts:
                continue
            ax.plot([p["bits"] for p in pts], [p[key] for p in pts], color=col, marker=mark,
                    ls="-" if kind == "search" else "none", label=kind)
            for p in pts:
                if kind != "search":
                    ax.annotate(p["label"], (p["bits"], p[key]), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set(xlabel="average weight bits (scales included)", ylabel=label, yscale="log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        tmp.unlink(missing_ok=True)
    return path
