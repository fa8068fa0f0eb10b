"""Calibration methods side by side with llm-compressor (issue 6).

Same model (SmolLM2-135M in float32), same calibration windows (the protocol's 128 × 512
tokens, seed 0), same evaluation (lowbit's evaluator, the same cached reference, the first
64 wiki test windows of 512 tokens).  For each configuration:

* lowbit: a worker process (this file, ``--_worker``) loads the model — for calibration
  recipes lazily, one decoder layer in memory at a time (``lowbit.models.offload``), fully
  loaded again at the end — quantizes it with the recipe (``pipeline.quantize``; for
  plain-rounding recipes with calibrated scales the calibration pass counts as part of
  quantization), reads the wall time of that step and its peak RSS (VmHWM), then
  evaluates the model against the reference this process cached and prints the result.
* llm-compressor: ``benchmarks/_llmc_worker.py`` runs in llm-compressor's own venv
  (``/tmp/llmc-venv`` by default, ``--llmc-python``), times ``oneshot`` and saves a
  compressed-tensors checkpoint; this process loads it with ``lowbit.models.loading.load_model``
  (weights decompressed by compressed-tensors) and then applies the *same* run-time
  activation / KV quantization lowbit uses for that configuration, because ``load_model``
  applies weights only.  NVFP4 W4A4 takes llm-compressor's stored ``input_global_scale``
  and FP8 KV takes its stored ``k_scale`` / ``v_scale``; the table's notes say so.

llm-compressor is never a lowbit dependency: it runs in a separate interpreter, and no code
of it is copied here.  If its venv is missing, that side is skipped with the command that
creates it.

    .venv/bin/python benchmarks/vs_llmcompressor.py --json vs_llmc.json
    .venv/bin/python benchmarks/vs_llmcompressor.py --configs w4a16-rtn-g64,w8a8-int8 --windows 2 --calib 4
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_LLMC_PYTHON = str(HERE.parent / ".venv-llmc" / "bin" / "python")
LLMC_VENV_HELP = "make peers-venv   # .venv-llmc: torch 2.13.0, then llmcompressor 0.14.0.1"


@dataclasses.dataclass(frozen=True)
class Config:
    key: str
    label: str
    lowbit: str  # lowbit preset
    llmc: str | None  # configuration name in _llmc_worker.py (None: lowbit-only row)
    group: str = "issue"  # "issue": the list; "lowbit-only": extra rows


CONFIGS = [
    Config("w4a16-rtn-g64", "W4A16 RTN int4 g64 sym", "w4a16-int4-g64", "w4a16-rtn-g64"),
    Config("w4a16-gptq-g64", "W4A16 GPTQ int4 g64 sym (lowbit: weighted-MSE group scales)", "w4a16-gptq-g64",
           "w4a16-gptq-g64"),
    Config("w4a16-awq-g64-asym", "W4A16 AWQ int4 g64 asym", "w4a16-awq-g64-asym", "w4a16-awq-g64-asym"),
    Config("w8a8-int8", "W8A8 INT8 RTN (channel / token dyn)", "w8a8-int8", "w8a8-int8"),
    Config("w8a8-int8-sq-gptq", "SmoothQuant 0.8 + GPTQ W8A8 INT8", "w8a8-int8-sq-gptq", "w8a8-int8-sq-gptq"),
    Config("fp8-dynamic", "FP8 dynamic", "fp8-dynamic", "fp8-dynamic"),
    Config("nvfp4", "NVFP4 W4A4 (RTN)", "nvfp4", "nvfp4"),
    Config("w4a16-nvfp4", "NVFP4A16 (RTN)", "w4a16-nvfp4", "w4a16-nvfp4"),
    Config("mxfp4", "MXFP4 W4A4 (RTN)", "mxfp4", "mxfp4"),
    Config("w4a16-mxfp4", "MXFP4A16 (RTN)", "w4a16-mxfp4", "w4a16-mxfp4"),
    Config("kv-fp8", "FP8 KV cache only", "kv-fp8", "kv-fp8"),
    Config("w4a16-awq-gptq-g64-asym", "W4A16 AWQ+GPTQ g64 asym", "w4a16-awq-gptq-g64-asym", None, "lowbit-only"),
    Config("w4a16-int4-g64-mse", "W4A16 int4 g64 weighted-MSE RTN", "w4a16-int4-g64-mse", None, "lowbit-only"),
    Config("nvfp4-rot-gptq", "NVFP4 W4A4 rotation + GPTQ", "nvfp4-rot-gptq", None, "lowbit-only"),
]
BY_KEY = {c.key: c for c in CONFIGS}


def configs_for(group: int) -> list[Config]:
    """The table's configurations with INT4 groups of ``group`` (64: the issue's table; 128:
    its repeat on Gemma-3-270m).  Rows without a ``group``-sized preset are dropped."""
    from lowbit.quantization.recipe import RECIPES

    if group == 64:
        return CONFIGS
    g = f"g{group}"
    out = []
    for c in CONFIGS:
        if "g64" not in c.key:
            out.append(c)
            continue
        lowbit = c.lowbit.replace("g64", g)
        if lowbit not in RECIPES:
            continue
        out.append(dataclasses.replace(c, key=c.key.replace("g64", g), label=c.label.replace("g64", g), lowbit=lowbit,
                                       llmc=c.llmc.replace("g64", g) if c.llmc else None))
    return out

#: llm-compressor's AWQ takes 42-46 minutes on this machine, so by default it is not re-run and
#: the table shows the figure recorded in issue 6 (llm-compressor 0.14.0.1, CPU, 2 threads,
#: same protocol) — RECORDED, NOT RE-RUN; no peak memory was recorded.
RECORDED_LLMC_AWQ = {"ppl": 25.61, "delta_pct": 17.2, "kl_mean": 0.168, "top1": 0.788, "quantize_seconds": 2552.0,
                     "peak_mib": None, "recorded": True}


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# -- lowbit worker (separate process) -------------------------------------------------


def lowbit_worker(recipe_name: str, model_name: str, calib_path: str, windows: str) -> None:
    """Quantize (timed, peak RSS read right after), then evaluate in this process against
    the reference the parent process cached; print one JSON line with both."""
    import torch
    from safetensors.torch import load_file

    from lowbit.quantization.calibrate import collect_stats
    from lowbit.evaluation.compare import Workbench
    from lowbit.evaluation.metrics import evaluate
    from lowbit.models.loading import load_model
    from lowbit.models.offload import LayerStore
    from lowbit.quantization.pipeline import quantize
    from lowbit.quantization.recipe import load_recipe
    from lowbit.quantization.runtime import quantized_execution

    # the calibration pipeline's per-stage seconds (balancing, pass, weights, learned rounding) go to
    # stderr, which the parent keeps as this worker's log: where a side's time goes, from the timed run
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s")
    for name in ("lowbit.quantization.layerwise", "lowbit.quantization.roundpass", "lowbit.quantization.scalepass",
                 "lowbit.quantization.algorithms.scaletune"):
        logging.getLogger(name).setLevel(logging.INFO)
    recipe = load_recipe(recipe_name)  # a preset, or a recipe YAML
    calib = load_file(calib_path)["input_ids"]
    layerwise = recipe.algorithms.layerwise
    if recipe.algorithms.tune_scales is not None:  # end-to-end scale tuning trains the whole model: loaded whole
        model, tok, info = load_model(model_name)
        t0 = time.perf_counter()
        state = quantize(model, recipe, progress=False, calibration=calib)
    elif layerwise:  # the calibration pipeline loads decoder layers one at a time from the checkpoint
        model, tok, info = load_model(model_name, lazy=True)
        t0 = time.perf_counter()
        with LayerStore(model, info.path) as store:
            state = quantize(model, recipe, progress=False, calibration=calib, store=store)
            store.materialize()  # the whole quantized model, for the evaluation that follows
    else:
        model, tok, info = load_model(model_name)
        t0 = time.perf_counter()
        stats = collect_stats(model, calib, progress=False) if recipe.needs_calibration else None
        state = quantize(model, recipe, stats=stats, progress=False)
    seconds = time.perf_counter() - t0
    peak = peak_rss_mib()
    wb = Workbench.load(model_name, corpus="wiki", windows=int(windows), calib_windows=0, seed=0, progress=False,
                        loader=lambda name, cache: (model, tok, info))
    with torch.inference_mode(), quantized_execution(model, state) as fwd:
        ev = evaluate(fwd, wb.windows, wb.reference, name=f"lowbit {recipe_name}", seed=wb.seed, progress=False)
    print("LOWBIT_RESULT " + json.dumps({"recipe": recipe_name, "quantize_seconds": seconds, "peak_mib": peak,
                                         "eval": _row_dict(ev, seconds, peak)}), flush=True)


# -- running the workers --------------------------------------------------------------


def _run(cmd: list[str], tag: str, log_dir: Path, key: str, marker: str | None = None, env: dict | None = None) -> dict:
    """Run a worker; return the JSON of its ``marker`` line (stdout and stderr kept in ``log_dir``)."""
    log = log_dir / f"{key}.{tag}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env)
    f_out = p.stdout
    (log_dir / f"{key}.{tag}.out").write_text(f_out)
    marker = marker or ("LOWBIT_RESULT " if tag == "lowbit" else "LLMC_RESULT ")
    for line in f_out.splitlines():
        if line.startswith(marker):
            d = json.loads(line[len(marker):])
            d["process_seconds"] = time.perf_counter() - t0
            return d
    tail = log.read_text()[-3000:]
    raise RuntimeError(f"{tag} worker for {key} failed (exit {p.returncode}); stderr tail:\n{tail}")


def _row_dict(ev, quantize_seconds: float | None, peak_mib: float | None, note: str = "") -> dict:
    return {"ppl": ev.ppl, "ppl_ci": list(ev.ppl_ci), "delta_pct": ev.delta_pct, "kl_mean": ev.kl_mean,
            "kl_ci": list(ev.kl_ci) if ev.kl_ci else None, "kl_p99": ev.kl_p99, "top1": ev.top1,
            "top1_ci": list(ev.top1_ci) if ev.top1_ci else None, "eval_seconds": ev.seconds,
            "quantize_seconds": quantize_seconds, "peak_mib": peak_mib, "note": note,
            # per-window sums, for paired comparisons between sides (vs_peers.py's paired())
            "window_nll": ev.window_nll, "window_tokens": ev.window_tokens, "window_kl": ev.window_kl}


def runtime_only(recipe):
    """``recipe`` with weights and calibration algorithms removed: only its input and KV
    quantization remain (None if it has neither)."""
    from lowbit.quantization.recipe import Algorithms, Rule

    rules = tuple(Rule(r.targets, None, r.inputs) for r in recipe.rules if r.inputs is not None)
    if not rules and recipe.kv_cache is None:
        return None
    return dataclasses.replace(recipe, name=recipe.name + "-runtime", rules=rules, algorithms=Algorithms())


def eval_checkpoint(wb, cfg: Config, folder: Path, tool: str = "llm-compressor") -> tuple:
    """Evaluate a peer's checkpoint: decompressed weights + lowbit's run-time activation / KV
    quantization of the preset ``cfg.lowbit`` (None: weights only), with the checkpoint's stored
    NVFP4 input global scales and KV scales where it has them."""
    import torch
    from safetensors.torch import load_file

    from lowbit.models.loading import load_model
    from lowbit.evaluation.metrics import evaluate
    from lowbit.quantization.kv import KVPlan
    from lowbit.quantization.pipeline import quantize
    from lowbit.quantization.recipe import RECIPES
    from lowbit.quantization.runtime import quantized_execution

    model = load_model(str(folder))[0]
    rt = None if cfg.lowbit is None else runtime_only(RECIPES[cfg.lowbit])
    notes = []
    state = None
    if rt is not None:
        tensors = {}
        for f in sorted(folder.glob("*.safetensors")):
            tensors.update(load_file(f))
        stats = wb.stats if rt.needs_calibration else None
        state = quantize(model, rt, stats=stats, progress=False)
        # NVFP4 inputs: compressed-tensors stores input_global_scale = fp4.max·fp8.max / amax;
        # lowbit's global scale is its reciprocal (amax / (fp4.max·fp8.max)).
        used = 0
        for name, aq in list(state.activations.items()):
            g = tensors.get(f"{name}.input_global_scale")
            if aq.global_scale is not None and g is not None:
                state.activations[name] = dataclasses.replace(aq, global_scale=(1.0 / g.float()).reshape(()))
                used += 1
        gs = sum(1 for a in state.activations.values() if a.global_scale is not None)
        if gs:
            notes.append(f"input global scales: {tool}'s stored input_global_scale for {used}/{gs} Linears"
                         + ("" if used == gs else ", lowbit's calibration for the rest"))
        if state.activations and not gs:
            notes.append(f"dynamic input quantization by lowbit's runtime (same scheme as {tool}'s)")
        if state.kv is not None:
            fmax = rt.kv_cache.scheme.format.max
            ks = {int(m.group(1)): (v.float().reshape(-1).max() * fmax).reshape(1)
                  for k, v in tensors.items() if (m := re.match(r".*layers\.(\d+)\.self_attn\.k_scale$", k))}
            vs = {int(m.group(1)): (v.float().reshape(-1).max() * fmax).reshape(1)
                  for k, v in tensors.items() if (m := re.match(r".*layers\.(\d+)\.self_attn\.v_scale$", k))}
            n_layers = len(state.kv.k_amax) or len(state.kv.v_amax)
            if len(ks) == n_layers and len(vs) == n_layers:
                state.kv = KVPlan(state.kv.config, ks, vs)
                notes.append(f"KV: {tool}'s stored k_scale/v_scale ({n_layers} layers)")
            else:
                notes.append(f"KV: {tool}'s checkpoint has {len(ks)}/{len(vs)} k/v scales for {n_layers} "
                             "layers; lowbit's calibrated KV scales used")
    with torch.inference_mode(), quantized_execution(model, state) as fwd:
        ev = evaluate(fwd, wb.windows, wb.reference, name=f"llmc {cfg.key}", seed=wb.seed, progress=False)
    return ev, "; ".join(notes)


# -- table ----------------------------------------------------------------------------


def _fmt_side(s: dict | None) -> list[str]:
    if s is None:
        return ["—"] * 5
    if s.get("error"):
        return ["failed"] + ["—"] * 4
    mark = " (recorded, not re-run)" if s.get("recorded") else ""
    ppl = f"{s['ppl']:.2f} ({s['delta_pct']:+.1f}%){mark}"
    kl = f"{s['kl_mean']:.3f}" if s.get("kl_mean") is not None else "—"
    t1 = f"{s['top1']:.3f}" if s.get("top1") is not None else "—"
    qs = f"{s['quantize_seconds']:.1f}" if s.get("quantize_seconds") is not None else "—"
    pk = f"{s['peak_mib']:.0f}" if s.get("peak_mib") else "—"
    return [ppl, kl, t1, qs, pk]


def verdict(cfg: Config, lb: dict | None, lc: dict | None) -> str:
    if not lb or lb.get("error") or not lc or lc.get("error"):
        return ""
    out = []
    if lc.get("ppl_ci"):
        lo, hi = lc["ppl_ci"]
        out.append("PPL below" if lb["ppl"] < lo else ("PPL within CI" if lb["ppl"] <= hi else "PPL WORSE (above CI)"))
    else:  # recorded figure: no interval
        out.append("PPL lower" if lb["ppl"] <= lc["ppl"] else "PPL higher")
    if "gptq" in cfg.key or "awq" in cfg.key:
        out.append("KL lower" if lb["kl_mean"] < lc["kl_mean"] else "KL NOT lower")
    return ", ".join(out)


def table(results: list[dict]) -> str:
    head = ["config", "lowbit PPL (Δ%)", "KL", "top-1", "quantize s", "peak MiB",
            "llm-compressor PPL (Δ%)", "KL", "top-1", "quantize s", "peak MiB", "time ratio", "memory ratio", "verdict"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        lb, lc = r.get("lowbit"), r.get("llmc")
        tr = mr = "—"
        if lb and lc and not lb.get("error") and not lc.get("error"):
            if lb.get("quantize_seconds") and lc.get("quantize_seconds"):
                tr = f"{lc['quantize_seconds'] / max(lb['quantize_seconds'], 1e-3):.1f}×"
            if lb.get("peak_mib") and lc.get("peak_mib"):
                mr = f"{lb['peak_mib'] / lc['peak_mib']:.2f}"
        cells = [r["label"]] + _fmt_side(lb) + _fmt_side(lc) + [tr, mr, r.get("verdict", "")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("time ratio = llm-compressor quantize s / lowbit quantize s (>1: lowbit faster); "
                 "memory ratio = lowbit peak RSS / llm-compressor peak RSS (<1: lowbit smaller).")
    return "\n".join(lines)


# -- main -----------------------------------------------------------------------------


def prepare(model: str, windows: int, calib: int, workdir: Path | None, prefix: str) -> tuple:
    """The shared setup of the side-by-side benchmarks: the bench (reference cached), the work
    folder, the calibration windows every tool reads (``calib.safetensors``) and the run's
    metadata.  Returns ``(wb, reference eval, work, calib_path, meta)``."""
    import torch
    from safetensors.torch import save_file

    from lowbit.evaluation.workbench import Workbench

    wb = Workbench.load(model, corpus="wiki", windows=windows, calib_windows=calib, seed=0, progress=False)
    ref = wb.reference_row().eval
    work = workdir or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)
    calib_path = work / "calib.safetensors"
    save_file({"input_ids": wb.calib_windows.contiguous()}, str(calib_path))
    print(f"model {wb.info.name} ({wb.info.path}); eval {tuple(wb.windows.shape)}; calib {tuple(wb.calib_windows.shape)}; "
          f"reference PPL {ref.ppl:.3f}; workdir {work}", flush=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv), "machine": platform.platform(),
            "cpu_model": cpu_model(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "model": wb.info.name,
            "windows": list(wb.windows.shape), "calib": list(wb.calib_windows.shape), "reference_ppl": ref.ppl}
    return wb, ref, work, calib_path, meta


def cpu_model() -> str | None:
    """The CPU's model name (Linux), for the record: tools' times compare only on one kind of CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=None,
                    help="comma list of: " + ", ".join(BY_KEY) + " (with --group 128: g128 in place of g64); "
                         "default all")
    ap.add_argument("--group", type=int, default=64, choices=(64, 128), help="INT4 group size of the W4A16 rows")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--calib", type=int, default=128)
    ap.add_argument("--skip-llmc", action="store_true", help="lowbit side only")
    ap.add_argument("--llmc-awq", action="store_true",
                    help="re-run llm-compressor's AWQ (42-46 min here; session 4: 2,776 s); default: show the issue's recorded figure")
    ap.add_argument("--llmc-python", default=DEFAULT_LLMC_PYTHON)
    ap.add_argument("--json", type=Path, help="write results here (rewritten after every configuration)")
    ap.add_argument("--resume", type=Path,
                    help="a --json file of an earlier (interrupted) run: its finished configurations are kept and "
                         "not re-run (rows from different runs ran under different machine load)")
    ap.add_argument("--workdir", type=Path, help="temp folder for checkpoints and worker logs (kept)")
    ap.add_argument("--_worker", nargs=4, metavar=("RECIPE", "MODEL", "CALIB", "WINDOWS"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        lowbit_worker(*a._worker)
        return 0

    by_key = {c.key: c for c in configs_for(a.group)}
    keys = [k.strip() for k in a.configs.split(",") if k.strip()] if a.configs else list(by_key)
    bad = [k for k in keys if k not in by_key]
    if bad:
        ap.error(f"unknown config(s) {bad}; choose from {list(by_key)}")
    llmc_ok = not a.skip_llmc and Path(a.llmc_python).exists()
    if not a.skip_llmc and not llmc_ok:
        print(f"llm-compressor venv not found at {a.llmc_python}: skipping that side. Create it with:\n  "
              f"{LLMC_VENV_HELP}", file=sys.stderr)

    t_start = time.perf_counter()
    wb, ref, work, calib_path, meta = prepare(a.model, a.windows, a.calib, a.workdir, "vs_llmc_")
    model_dir = str(wb.info.path)
    meta.update(group=a.group, llmc_python=a.llmc_python if llmc_ok else None)
    results = []
    if a.resume and a.resume.exists():
        old = json.loads(a.resume.read_text())
        for r in old["results"]:
            failed = (r.get("lowbit") or {}).get("error") or (r.get("llmc") or {}).get("error")
            if r["key"] in keys and not r.get("partial") and not failed:
                r["resumed_from"] = f"{a.resume} ({old['meta']['date']})"
                results.append(r)
        meta["resumed"] = [r["key"] for r in results]
        if results:
            print(f"resumed from {a.resume}: {', '.join(meta['resumed'])}", flush=True)

    def dump():
        if a.json:
            a.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")

    for key in keys:
        if key in meta.get("resumed", []):
            continue
        cfg = by_key[key]
        r = {"key": key, "label": cfg.label, "lowbit_recipe": cfg.lowbit, "group": cfg.group, "partial": True}
        results.append(r)  # dumped after each side, so that an interrupted run keeps what it measured
        t0 = time.perf_counter()
        # lowbit
        try:
            w = _run([sys.executable, str(Path(__file__).resolve()), "--_worker", cfg.lowbit, a.model,
                      str(calib_path), str(a.windows)], "lowbit", work, key)
            r["lowbit"] = w["eval"]
        except Exception as e:  # noqa: BLE001 — one failed configuration must not end the run
            r["lowbit"] = {"error": str(e)[-2000:]}
            print(f"[{key}] lowbit failed: {e}", file=sys.stderr, flush=True)
        dump()
        # llm-compressor
        awq = cfg.llmc is not None and "awq" in cfg.llmc
        if cfg.llmc and llmc_ok and (not awq or a.llmc_awq):
            folder = work / f"{key}.llmc"
            try:
                w = _run([a.llmc_python, str(HERE / "_llmc_worker.py"), cfg.llmc, model_dir, str(calib_path),
                          str(folder)], "llmc", work, key)
                ev, note = eval_checkpoint(wb, cfg, folder)
                r["llmc"] = _row_dict(ev, w["quantize_seconds"], w["peak_mib"], note)
            except Exception as e:  # noqa: BLE001
                r["llmc"] = {"error": str(e)[-2000:]}
                print(f"[{key}] llm-compressor failed: {e}", file=sys.stderr, flush=True)
        elif cfg.llmc == "w4a16-awq-g64-asym" and not a.skip_llmc and a.model == "smollm2-135m":
            r["llmc"] = dict(RECORDED_LLMC_AWQ, note="recorded in issue 6, not re-run (pass --llmc-awq to re-run)")
        r["verdict"] = verdict(cfg, r.get("lowbit"), r.get("llmc"))
        r["wall_seconds"] = time.perf_counter() - t0
        del r["partial"]
        dump()
        lb, lc = r.get("lowbit") or {}, r.get("llmc") or {}
        print(f"[{key}] {r['wall_seconds']:.0f} s | lowbit " + " ".join(_fmt_side(lb if lb else None))
              + " || llmc " + " ".join(_fmt_side(lc if lc else None)) + f" | {r['verdict']}", flush=True)
        if lc.get("note"):
            print(f"    llmc note: {lc['note']}", flush=True)

    meta["total_seconds"] = time.perf_counter() - t_start
    results.sort(key=lambda r: keys.index(r["key"]))
    dump()
    print()
    print(f"{wb.info.name}: reference PPL {ref.ppl:.3f} (CI {ref.ppl_ci[0]:.2f}–{ref.ppl_ci[1]:.2f}), "
          f"{len(wb.windows)} eval windows, {len(wb.calib_windows)} calibration windows, "
          f"total {meta['total_seconds'] / 60:.1f} min")
    print(table(results))
    notes = [f"- {r['label']} (llm-compressor): {r['llmc']['note']}" for r in results
             if r.get("llmc") and r["llmc"].get("note")]
    if notes:
        print("\nnotes:\n" + "\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
