"""Rendering of a :class:`lowbit.planning.PlanResult`: the rich table, the recommendation as
text, the Pareto and latency PNGs, and the report folder (Markdown page + JSON + plots).
Data in, text or files out."""

from __future__ import annotations

import json
from pathlib import Path

from rich.table import Table

from ..util.io import atomic_dir

__all__ = ["plan_table", "recommendation_lines", "plot_pareto", "plot_latency", "markdown", "write_report", "REPORT_FILES"]

#: what a report folder holds (``latency.png`` only when the curves were computed)
REPORT_FILES = ("index.md", "plan.json", "pareto.png", "latency.png")


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f} GB"


def _title(r) -> str:
    t, s = r.target, r.load.slo
    slo = ", ".join(p for p in (f"TTFT ≤ {s.ttft * 1e3:g} ms" if s.ttft else "",
                                f"TPOT ≤ {s.tpot * 1e3:g} ms" if s.tpot else "") if p)
    form = f"p{s.percentile:g}" if r.load.form == "percentile" else f"{s.attainment:.0%} of requests"
    a = r.accuracy_setup
    return (f"Plan: accuracy of {r.model} ({a['corpus']}, {a['windows']} windows × {a['seq_len']}), capacity of "
            f"{t.shape.name} on {t.gpu.name} × {t.tp}; prompt {r.load.prompt.mean:g} / output {r.load.output.mean:g} "
            f"tokens; SLO {form} {slo}; budget: {r.budget.describe()}")


def _task_cell(o) -> str:
    """Mean headline-accuracy drop in points and the flips summed over the tasks."""
    t = o.tasks
    if t is None or not t.paired:
        return "0 (reference)" if t is not None else "—"
    pairs = [p for p in (t.headline(k) for k in t.paired) if p is not None]
    lost, won = sum(p.flips.right_to_wrong for p in pairs), sum(p.flips.wrong_to_right for p in pairs)
    return f"{-t.headline_drop():+.2f} ({lost}↓ {won}↑)"


def _rows(r) -> list[tuple[str, ...]]:
    """One tuple of display strings per option (shared by the rich table and the Markdown page)."""
    rec, out = r.recommendation, []
    for o in r.options:
        c, m = o.capacity, o.capacity.memory
        if o.accuracy is None:
            e, delta = None, "not measured"
        else:
            e = o.accuracy.eval
            delta = "0 (reference)" if e.delta_pct is None else f"{e.delta_pct:+.2f}" + (
                f" [{e.delta_ci[0]:+.1f}, {e.delta_ci[1]:+.1f}]" if e.delta_ci else "")
        mark = []
        if o.candidate.name == rec.pick:
            mark.append("PICK")
        if o.candidate.name == rec.latency_pick:
            mark.append("lowest TPOT")
        if o.candidate.name in rec.front_rate:
            mark.append("front: rate")
        if o.candidate.name in rec.front_memory:
            mark.append("front: memory")
        lane = c.plan.lane + (" W-only" if c.plan.weight_only else "") + (" (fallback)" if c.fell_back else "")
        rate = "—" if c.max_rate is None else f"{c.max_rate.median:.2f} [{c.max_rate.low:.2f}–{c.max_rate.high:.2f}]"
        out.append((
            o.candidate.name, lane, delta, "—" if e is None or e.kl_mean is None else f"{e.kl_mean:.4f}",
            "—" if e is None or e.top1 is None else f"{e.top1:.3f}",
            *((_task_cell(o),) if r.tasks else ()),
            "—" if o.accuracy is None else f"{o.accuracy.weight_bits:.2f}",
            _gb(m.weights_per_gpu), f"{m.kv_per_token / 1024:,.0f} KiB",
            f"{m.kv_capacity_tokens:,} tok" if c.fits else "DOES NOT FIT",
            "—" if c.low_load_tpot is None else f"{c.low_load_tpot * 1e3:.2f} ms", rate, c.binding or "—",
            "yes" if o.within_budget else ("?" if o.accuracy is None else "no"), ", ".join(mark),
        ))
    return out


COLUMNS = ("candidate", "lane", "PPL Δ% [95% CI]", "KL mean", "top-1", "W bits", "weights/GPU", "KV/token/GPU",
           "KV capacity", "TPOT 1 user", "max rate req/s", "binds", "in budget", "")

#: the tasks column, after top-1, when the plan scored benchmarks
TASK_COLUMN = "tasks Δ pts (flips ↓↑)"


def _columns(r) -> tuple[str, ...]:
    if not r.tasks:
        return COLUMNS
    i = COLUMNS.index("top-1") + 1
    return COLUMNS[:i] + (TASK_COLUMN,) + COLUMNS[i:]


#: columns the terminal table leaves to the page and the JSON
_PAGE_ONLY = ("KV/token/GPU",)


def plan_table(r) -> Table:
    cols = _columns(r)
    keep = [i for i, c in enumerate(cols) if c not in _PAGE_ONLY]
    t = Table(title=_title(r), title_justify="left")
    for i in keep:
        t.add_column(cols[i], justify="left" if cols[i] in ("candidate", "lane", "binds", "") else "right")
    for row in _rows(r):
        t.add_row(*(row[i] for i in keep))
    return t


def recommendation_lines(r) -> list[str]:
    """The decision in plain sentences, then the commands."""
    rec, lines = r.recommendation, []
    if r.served_note:
        lines.append(f"NOTE: {r.served_note}")
    if rec.pick:
        lines.append(f"Recommendation: {rec.pick} — {rec.reason}")
    else:
        lines.append(f"No recommendation ({rec.verdict}): {rec.reason}")
    if rec.latency_pick:
        lines.append(f"For the lowest single-user latency: {rec.latency_pick} — {rec.latency_reason}")
    lines.append(f"Pareto front, loss vs max rate: {', '.join(rec.front_rate) or '—'}")
    lines.append(f"Pareto front, loss vs memory per GPU: {', '.join(rec.front_memory) or '—'}")
    for c in r.commands:
        lines.append(f"Ship {c.candidate}:")
        if c.recipe_file:
            lines.append(f"  (recipe {c.recipe_file}, written with the report; or save the YAML below there)")
        if c.quantize:
            lines.append(f"  {c.quantize}")
        lines.append(f"  {c.vllm}")
        if c.note:
            lines.append(f"  note: {c.note}")
    for n in r.notes:
        lines.append(f"note: {n}")
    return lines


def plot_pareto(r, path: str | Path) -> Path:
    """Two panels: loss against max rate (candidates that fit) and loss against memory per GPU,
    the Pareto front joined by a line, the budget as a dashed vertical line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rec = r.recommendation
    unit = {"ppl": "perplexity Δ%", "kl": "mean KL", "task": "mean task-accuracy drop, points"}[r.budget.metric]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for ax, key, front, label in (
        (a, lambda o: o.capacity.rate, rec.front_rate, "max rate under the SLO (req/s)"),
        (b, lambda o: (o.capacity.memory.weights_per_gpu + o.capacity.memory.kv_per_token * r.load.context) / 1e9,
         rec.front_memory, "weights + one conversation's KV per GPU (GB)"),
    ):
        opts = [o for o in r.options if o.measured and (o.capacity.fits or ax is b)]
        for o in opts:
            on = o.candidate.name in front
            ax.scatter(o.loss, key(o), s=60 if on else 30, color="C3" if o.candidate.name == rec.pick else
                       ("C0" if on else "0.6"), zorder=3, marker="*" if o.candidate.name == rec.pick else "o")
            ax.annotate(o.candidate.name, (o.loss, key(o)), fontsize=7, xytext=(4, 3), textcoords="offset points")
        pts = sorted((o.loss, key(o)) for o in opts if o.candidate.name in front)
        if pts:
            ax.plot(*zip(*pts), color="C0", lw=1, zorder=2, label="Pareto front")
        ax.axvline(r.budget.limit, color="C2", ls="--", lw=1, label=f"budget ({r.budget.describe()})")
        ax.set(xlabel=f"accuracy loss ({unit}, measured on {r.model})", ylabel=label)
        ax.legend(fontsize=7)
    title = f"{r.target.shape.name} on {r.target.gpu.name} × {r.target.tp}"
    if r.served_note:
        title += f" (accuracy measured on {r.model})"
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_latency(r, path: str | Path) -> Path:
    """TTFT and TPOT p99 against request rate, one line per candidate, the SLO targets dashed;
    the legend beside the panels (candidates that serve alike draw on top of each other)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.6))
    styles = ["-", "--", ":", "-."]
    for i, c in enumerate(r.curves):
        kw = {"color": f"C{i % 10}", "ls": styles[(i // 10) % 4], "lw": 1.3, "label": c.plan}
        a.plot(c.rates, [x * 1e3 for x in c.ttft_p99], **kw)
        b.plot(c.rates, [x * 1e3 for x in c.tpot_p99], **kw)
    slo = r.load.slo
    for ax, target in ((a, slo.ttft), (b, slo.tpot)):
        if target:
            ax.axhline(target * 1e3, color="k", ls="--", lw=0.8)
    q = f"p{slo.percentile:g}"
    a.set(xlabel="request rate (req/s)", ylabel=f"TTFT {q} (ms)", yscale="log", title="time to first token")
    b.set(xlabel="request rate (req/s)", ylabel=f"TPOT {q} (ms)", title="time per output token (dashed: SLO)")
    handles, labels = a.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7)
    fig.suptitle(f"{r.target.shape.name} on {r.target.gpu.name} × {r.target.tp} (simulated, seed {r.load.seeds[0]})")
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def markdown(r, files: dict[str, str]) -> str:
    """The report page; ``files`` maps plot names (``pareto``, ``latency``) to file names in the folder."""
    out = [f"# lowbit plan: {r.model} → {r.target.shape.name} on {r.target.gpu.name} × {r.target.tp}", ""]
    if r.served_note:
        out += [f"> **{r.served_note}**", ""]
    out += [_title(r) + ".", ""]
    cols = _columns(r)
    out += ["| " + " | ".join(c or "marks" for c in cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in _rows(r)]
    out += ["", "PPL Δ%, KL and top-1 agreement are measured against the unquantized model; weights, KV and rates "
            "are simulated for the served model. *binds*: the SLO target that fails first just above the max rate "
            "(`bound`: the simulator's throughput bound was reached first)."]
    if r.tasks:
        ex = ", ".join(f"{t} {n}" for t, n in r.tasks["examples"].items())
        out += ["", f"*{TASK_COLUMN}*: the mean over {', '.join(r.tasks['tasks'])} ({ex} questions) of the headline "
                "accuracy (acc_norm where the task has it, else acc) against the unquantized model's, in points; "
                "↓ questions the reference answered right and the candidate wrong, ↑ the reverse."]
    out += ["", "## Recommendation", ""]
    rec = r.recommendation
    out.append(f"- **{rec.pick}** — {rec.reason}" if rec.pick else f"- **No recommendation ({rec.verdict})**: {rec.reason}")
    if rec.latency_pick:
        out.append(f"- For the lowest single-user latency: **{rec.latency_pick}** — {rec.latency_reason}")
    out.append(f"- Pareto front, loss vs max rate: {', '.join(rec.front_rate) or '—'}")
    out.append(f"- Pareto front, loss vs memory per GPU: {', '.join(rec.front_memory) or '—'}")
    out += [f"- Note: {n}" for n in r.notes]
    for c in r.commands:
        out += ["", f"### Ship {c.candidate}", "", "```bash"]
        out += [x for x in (c.quantize, c.vllm, c.sglang) if x] + ["```"]
        if c.recipe_yaml:
            out += ["", f"Recipe (`{c.recipe_file}`):", "", "```yaml", c.recipe_yaml.rstrip(), "```"]
        if c.note:
            out += ["", c.note]
    if files.get("pareto"):
        out += ["", "## Pareto fronts", "", f"![Pareto fronts]({files['pareto']})"]
    if files.get("latency"):
        out += ["", "## Latency against request rate (simulated)", "", f"![TTFT and TPOT]({files['latency']})"]
    out += ["", "## Time", "", "| stage | seconds |", "|---|---|"]
    out += [f"| {k} | {v:.1f} |" for k, v in r.stage_seconds.items()]
    out += ["", "All numbers are in `plan.json`.", ""]
    return "\n".join(out)


def write_report(r, folder: str | Path, force: bool = False) -> Path:
    """Write the report folder through a temporary one, renamed when complete (refused if it
    exists, unless ``force``): ``index.md``, ``plan.json``, ``pareto.png``, ``latency.png``
    (when curves were computed) and ``recipes/*.yaml`` for non-preset recipes."""
    folder = Path(folder)
    with atomic_dir(folder, force=force) as tmp:
        files = {"pareto": plot_pareto(r, tmp / "pareto.png").name}
        if r.curves:
            files["latency"] = plot_latency(r, tmp / "latency.png").name
        for c in r.commands:
            if c.recipe_yaml:
                p = tmp / "recipes" / Path(c.recipe_file).name
                p.parent.mkdir(exist_ok=True)
                p.write_text(c.recipe_yaml)
        (tmp / "plan.json").write_text(json.dumps(r.to_dict(), indent=2, default=float) + "\n")
        (tmp / "index.md").write_text(markdown(r, files))
        tmp.chmod(0o755)  # mkdtemp made it private; a report is for reading
    return folder
