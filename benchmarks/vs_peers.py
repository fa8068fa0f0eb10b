"""lowbit's calibration recipes side by side with AutoRound and GPTQModel (issue 18).

The protocol of ``vs_llmcompressor.py``: SmolLM2-135M in float32, the same 128 calibration
windows × 512 tokens (seed 0, wiki train) handed to every tool through one safetensors file,
the first 64 wiki test windows, lowbit's evaluator against one cached reference.  Every side
runs in its own process and reports its quantization wall time and peak RSS (VmHWM):

* ``lowbit:RECIPE`` — ``vs_llmcompressor.py``'s lowbit worker (layer-by-layer recipes load one
  decoder layer at a time; the time covers everything up to the quantized model in memory);
* ``autoround:light|default|best`` — ``_autoround_worker.py`` in a venv with auto-round (the
  llm-compressor venv has 0.15.1), AutoRound's own recipe on the protocol's windows, exported as
  compressed-tensors (``llm_compressor``), read back with ``lowbit.models.loading.load_model``;
* ``gptqmodel:default|desc|plain`` — ``_gptqmodel_worker.py`` in GPTQModel's venv; its GPTQ with its
  default options (7.6.0: activation-group-aware ordering, GAR), with classic activation order, or
  with neither; dequantized by GPTQModel's own kernel to a float checkpoint, read back the same way.

Rows are weight formats (``--rows``); every side that supports a row runs on it (``--sides``).
No peer code is imported into lowbit or copied here; the peers' venvs come from ``make peers-venv``
(``--autoround-python`` / ``--gptqmodel-python`` point elsewhere); a missing venv skips that peer with
the command that creates it.

    .venv/bin/python benchmarks/vs_peers.py --rows w4a16-g64-sym --sides lowbit,autoround:light --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from vs_llmcompressor import DEFAULT_LLMC_PYTHON, LLMC_VENV_HELP, _row_dict, _run, eval_checkpoint, prepare  # noqa: E402

AUTOROUND_PYTHON = DEFAULT_LLMC_PYTHON
AUTOROUND_HELP = LLMC_VENV_HELP + "   # llm-compressor brings auto-round 0.15.1"
GPTQMODEL_PYTHON = str(HERE.parent / ".venv-gptqmodel" / "bin" / "python")
GPTQMODEL_HELP = "make peers-venv   # .venv-gptqmodel: torch 2.13.0, then gptqmodel 7.6.0 held at that torch"


@dataclasses.dataclass(frozen=True)
class Row:
    key: str
    label: str
    lowbit: tuple[str, ...]  # lowbit presets of this format, plain and calibrated
    peers: tuple[str, ...] = ("autoround", "gptqmodel")  # the peers that quantize to this format
    #: a lowbit preset whose input quantization a peer's checkpoint runs with (its stored input scales
    #: where it has them); None: weight-only, the checkpoint's weights alone
    runtime: str | None = None


ROWS = {r.key: r for r in [
    Row("w4a16-g64-sym", "W4A16 INT4 g64 symmetric",
        ("w4a16-int4-g64", "w4a16-gptq-g64", "w4a16-int4-g64-ro", "w4a16-gptq-ro-g64")),
    Row("w4a16-g64-asym", "W4A16 INT4 g64 asymmetric",
        ("w4a16-int4-g64-asym", "w4a16-awq-g64-asym", "w4a16-awq-gptq-g64-asym", "w4a16-awq-gptq-ro-g64-asym")),
    Row("w4a16-g128-sym", "W4A16 INT4 g128 symmetric", ("w4a16-int4-g128", "w4a16-gptq-g128", "w4a16-int4-g128-ro")),
    Row("w4a16-g128-asym", "W4A16 INT4 g128 asymmetric",
        ("w4a16-int4-g128-asym", "w4a16-awq-g128-asym", "w4a16-awq-gptq-g128-asym")),
    Row("w2a16-g64-sym", "W2A16 INT2 g64 symmetric", ("w2a16-int2-g64", "w2a16-gptq-g64", "w2a16-gptq-ro-g64")),
    # weights only: AutoRound trains these with 16-bit activations; its export labels the checkpoint with
    # compressed-tensors' W4A4 scheme all the same, and load_model applies the weights only
    Row("w4a16-mxfp4", "W4A16 MXFP4", ("w4a16-mxfp4", "w4a16-mxfp4-gptq", "w4a16-mxfp4-gptq-ro"), ("autoround",)),
    Row("w4a16-nvfp4", "W4A16 NVFP4", ("w4a16-nvfp4", "w4a16-nvfp4-gptq", "w4a16-nvfp4-gptq-ro"), ("autoround",)),
    # weights and activations: both tools tune through their activation quantizer; AutoRound's checkpoint
    # is judged with lowbit's NVFP4 input quantization and its stored input_global_scale
    Row("w4a4-nvfp4", "W4A4 NVFP4", ("nvfp4", "nvfp4-gptq", "nvfp4-gptq-ro"), ("autoround",), runtime="nvfp4"),
]}
PEER_SIDES = ("autoround:light", "autoround:default", "autoround:best", "gptqmodel:default", "gptqmodel:desc",
              "gptqmodel:plain")
DEFAULT_SIDES = "lowbit,autoround:light,autoround:default,gptqmodel:default,gptqmodel:desc"


def expand_sides(text: str, row: Row) -> list[str]:
    """``lowbit`` stands for every lowbit preset of the row; ``lowbit:NAME`` for one (a preset, or a recipe YAML's path)."""
    out = []
    for s in (t.strip() for t in text.split(",") if t.strip()):
        if s == "lowbit":
            out += [f"lowbit:{r}" for r in row.lowbit]
        elif s.startswith("lowbit:"):
            out.append(s)
        elif s in PEER_SIDES:
            if s.partition(":")[0] in row.peers:
                out.append(s)
            else:
                print(f"{row.key}: {s} does not quantize to this format; skipped", file=sys.stderr)
        else:
            raise SystemExit(f"unknown side {s!r}; choose from lowbit, lowbit:PRESET|YAML, {', '.join(PEER_SIDES)}")
    return list(dict.fromkeys(out))


def eval_folder(wb, folder: Path, name: str, tool: str, runtime: str | None = None) -> tuple:
    """A peer's checkpoint (compressed-tensors or dense), decompressed by ``load_model``, evaluated —
    with ``runtime``'s input quantization and the checkpoint's stored input scales when given
    (:func:`vs_llmcompressor.eval_checkpoint`).  Returns ``(evaluation, notes)``."""
    from types import SimpleNamespace

    return eval_checkpoint(wb, SimpleNamespace(key=name, lowbit=runtime), folder, tool)


def run_side(side: str, row: Row, a, wb, calib_path: Path, work: Path) -> dict:
    tool, _, variant = side.partition(":")
    name = Path(variant).stem if variant.endswith((".yaml", ".yml")) else variant  # a recipe YAML: its file's stem
    tag = f"{row.key}.{tool}-{name}"
    if tool == "lowbit":
        w = _run([sys.executable, str(HERE / "vs_llmcompressor.py"), "--_worker", variant, a.model, str(calib_path),
                  str(a.windows)], "lowbit", work, tag)
        return w["eval"]
    python = a.autoround_python if tool == "autoround" else a.gptqmodel_python
    worker = HERE / f"_{tool}_worker.py"
    folder = work / f"{tag}.ckpt"
    cmd = [python, str(worker), f"{row.key}:{variant}", str(wb.info.path), str(calib_path), str(folder)]
    if a.peer_iters is not None and tool == "autoround":
        cmd.append(str(a.peer_iters))
    env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2") if tool == "gptqmodel" else None
    w = _run(cmd, tool, work, tag, marker="PEER_RESULT ", env=env)
    ev, notes = eval_folder(wb, folder, tag, tool, row.runtime)
    d = _row_dict(ev, w["quantize_seconds"], w["peak_mib"], "; ".join(n for n in (w.get("note", ""), notes) if n))
    d["worker"] = {k: v for k, v in w.items() if k not in ("quantize_seconds", "peak_mib")}
    return d


def table(results: list[dict]) -> str:
    head = ["format", "tool : recipe", "PPL (Δ%)", "PPL 95% CI", "KL [95% CI]", "top-1", "quantize s", "peak MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        s = r["result"]
        if s.get("error"):
            lines.append(f"| {r['label']} | {r['side']} | failed | | | | | |")
            continue
        kl_ci = f" [{s['kl_ci'][0]:.3f}, {s['kl_ci'][1]:.3f}]" if s.get("kl_ci") else ""
        lines.append(f"| {r['label']} | {r['side']} | {s['ppl']:.2f} ({s['delta_pct']:+.1f}%) | "
                     f"{s['ppl_ci'][0]:.2f}–{s['ppl_ci'][1]:.2f} | {s['kl_mean']:.3f}{kl_ci} | {s['top1']:.3f} | "
                     f"{s['quantize_seconds']:.1f} | {s['peak_mib']:.0f} |")
    return "\n".join(lines)


def paired(results: list[dict]) -> list[dict]:
    """Every lowbit side against every peer side of the same row, paired over the evaluation windows
    (:func:`lowbit.evaluation.metrics.paired_difference`): the peer's evaluation is ``a``, lowbit's
    ``b``, so a KL ratio interval below 1 means lowbit's KL is lower on these windows beyond chance."""
    ok = evaluated(results)
    out = []
    for lb in (r for r in ok if r["side"].startswith("lowbit")):
        for peer in (r for r in ok if r["row"] == lb["row"] and not r["side"].startswith("lowbit")):
            out.append({"row": lb["row"], "lowbit": lb["side"], "peer": peer["side"], **paired_rows(peer, lb)})
    return out


def evaluated(results: list[dict]) -> list[dict]:
    """The result rows that were evaluated and keep their per-window figures."""
    return [r for r in results if not r["result"].get("error") and r["result"].get("window_kl")]


def paired_rows(a: dict, b: dict) -> dict:
    """:func:`lowbit.evaluation.metrics.paired_difference` of two result rows (``a`` the reference)."""
    from types import SimpleNamespace

    from lowbit.evaluation.metrics import paired_difference

    ev = [SimpleNamespace(name=r["side"], **{k: tuple(r["result"][k]) for k in
                                            ("window_nll", "window_tokens", "window_kl")}) for r in (a, b)]
    return paired_difference(*ev)


def paired_lines(pairs: list[dict]) -> str:
    return "\n".join(f"{p['row']}: {p['lowbit']} / {p['peer']}: KL ratio {p['kl_ratio']:.3f} "
                     f"[{p['kl_ratio_ci'][0]:.3f}, {p['kl_ratio_ci'][1]:.3f}], PPL ratio {p['ppl_ratio']:.4f} "
                     f"[{p['ppl_ratio_ci'][0]:.4f}, {p['ppl_ratio_ci'][1]:.4f}] (paired over windows)" for p in pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="w4a16-g64-sym", help="comma list of: " + ", ".join(ROWS))
    ap.add_argument("--sides", default=DEFAULT_SIDES,
                    help=f"comma list of lowbit, lowbit:PRESET|YAML, {', '.join(PEER_SIDES)} (default {DEFAULT_SIDES})")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--autoround-python", default=AUTOROUND_PYTHON)
    ap.add_argument("--gptqmodel-python", default=GPTQMODEL_PYTHON)
    ap.add_argument("--peer-iters", type=int, help="override AutoRound's iteration count (smoke tests only)")
    ap.add_argument("--json", type=Path, help="write results here (rewritten after every side)")
    ap.add_argument("--resume", type=Path, help="a --json file of an earlier run: its finished sides are kept")
    ap.add_argument("--workdir", type=Path, help="folder for checkpoints and worker logs (kept)")
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    bad = [r for r in rows if r not in ROWS]
    if bad:
        ap.error(f"unknown row(s) {bad}; choose from {list(ROWS)}")
    plan = [(ROWS[r], s) for r in rows for s in expand_sides(a.sides, ROWS[r])]
    for tool, python, help_ in (("autoround", a.autoround_python, AUTOROUND_HELP),
                                ("gptqmodel", a.gptqmodel_python, GPTQMODEL_HELP)):
        if any(s.startswith(tool) for _, s in plan) and not Path(python).exists():
            print(f"{tool}: no interpreter at {python}; skipping it. Create it with:\n  {help_}", file=sys.stderr)
            plan = [(r, s) for r, s in plan if not s.startswith(tool)]

    t_start = time.perf_counter()
    wb, ref, work, calib_path, meta = prepare(a.model, a.windows, a.calib, a.workdir, "vs_peers_")
    meta["peer_iters_override"] = a.peer_iters
    results: list[dict] = []
    if a.resume and a.resume.exists():
        old = json.loads(a.resume.read_text())
        results = [dict(r, resumed_from=old["meta"]["date"]) for r in old["results"] if not r["result"].get("error")]
    done = {(r["row"], r["side"]) for r in results}

    def dump():
        if a.json:
            a.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")

    for row, side in plan:
        if (row.key, side) in done:
            continue
        t0 = time.perf_counter()
        load = os.getloadavg()[0]
        try:
            res = run_side(side, row, a, wb, calib_path, work)
        except Exception as e:  # noqa: BLE001 — one failed side must not end the run
            res = {"error": str(e)[-2000:]}
            print(f"[{row.key} {side}] failed: {e}", file=sys.stderr, flush=True)
        results.append({"row": row.key, "label": row.label, "side": side, "result": res,
                        "wall_seconds": time.perf_counter() - t0, "load_at_start": load,
                        "load_at_end": os.getloadavg()[0]})
        dump()
        if not res.get("error"):
            print(f"[{row.key} {side}] PPL {res['ppl']:.3f} ({res['delta_pct']:+.2f}%) KL {res['kl_mean']:.4f} "
                  f"top-1 {res['top1']:.3f} | quantize {res['quantize_seconds']:.1f} s, peak {res['peak_mib']:.0f} MiB",
                  flush=True)
    meta["total_seconds"] = time.perf_counter() - t_start
    meta["paired"] = paired(results)
    dump()
    print(f"\n{wb.info.name}: reference PPL {ref.ppl:.3f}, {len(wb.windows)} eval windows, "
          f"{len(wb.calib_windows)} calibration windows, total {meta['total_seconds'] / 60:.1f} min")
    print(table(results))
    if meta["paired"]:
        print(paired_lines(meta["paired"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
