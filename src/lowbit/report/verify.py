"""Rendering of ``lowbit verify`` results (:class:`lowbit.engines.verify.Verification`)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from .tables import num

__all__ = ["verify_table", "check_line", "noise_line", "refused_lines", "gguf_table", "gguf_check_line"]


def _pct(a: float, b: float) -> str:
    return f"{100 * (a / b - 1):+.2f}%" if b else "—"


def verify_table(v) -> Table:
    """One row per checkpoint: the engine's PPL, lowbit's prediction, the reference, KL and
    top-1 between lowbit and the engine, the noise floor and whether the targets hold."""
    eng = v.engine
    t = Table(title=f"{v.model}: vLLM {eng.get('version')} ({eng.get('platform')}) against lowbit's prediction — "
                    f"{v.corpus}, {v.windows} windows × {v.seq_len} tokens, top-{v.k} prompt log-probs",
              title_justify="left")
    cols = ("checkpoint", "dtype / KV", "vLLM PPL", "lowbit PPL", "Δ (vLLM−lowbit)", "≤ 2×noise", "reference PPL",
            "KL(lowbit‖vLLM)", "KL(ref‖lowbit)", "ratio ≤ 0.2", "top-1", "vLLM s", "lowbit s")
    for c in cols:
        t.add_column(c, justify="left" if c in ("checkpoint", "dtype / KV") else "right", no_wrap=c == "checkpoint")
    if v.noise is not None:
        n = v.noise
        t.add_row("unquantized (noise floor)", f"{v.noise_request.dtype} / auto", num(n.engine_ppl, 6),
                  num(n.lowbit_ppl, 6), num(n.delta_ppl, 3), "—", "—", num(n.kl, 3), "—", "—", f"{n.top1:.4f}",
                  "", "")
    for c in v.checks:
        p = c.pair
        kv = c.engine.get("kv_cache_dtype", "?")
        if c.request.chunk:
            kv += f" (chunks of {c.request.chunk})"
        t.add_row(c.recipe, f"{c.engine.get('dtype', c.request.dtype)} / {kv}", num(p.engine_ppl, 6),
                  num(p.lowbit_ppl, 6), f"{num(p.delta_ppl, 3)} ({_pct(p.engine_ppl, p.lowbit_ppl)})",
                  "yes" if c.ppl_ok else f"no (> {num(c.ppl_target, 2)})", num(c.reference_ppl, 6), num(p.kl, 3),
                  num(p.kl_reference, 3), ("yes" if c.kl_ok else "no") + f" ({num(c.kl_ratio, 2)})",
                  f"{p.top1:.4f}", f"{c.engine_seconds:.0f}", f"{c.lowbit_seconds:.0f}")
    return t


def check_line(c) -> str:
    """A one-line summary of one checkpoint, printed as soon as it is done."""
    p = c.pair
    return (f"{c.recipe}: vLLM {p.engine_ppl:.4f}, lowbit {p.lowbit_ppl:.4f} (Δ {p.delta_ppl:+.4f}, target "
            f"≤ {c.ppl_target:.2g}: {'ok' if c.ppl_ok else 'MISS'}); KL(lowbit‖vLLM) {p.kl:.2e} = "
            f"{num(c.kl_ratio, 2)} × KL(ref‖lowbit) {num(p.kl_reference, 3)} ({'ok' if c.kl_ok else 'MISS'}); "
            f"top-1 {p.top1:.4f}; {c.engine_seconds:.0f} s vLLM + {c.lowbit_seconds:.0f} s lowbit")


def noise_line(n) -> str:
    """The noise floor (unquantized model: vLLM against lowbit, same dtype), printed when known."""
    return (f"noise floor (unquantized): vLLM {n.engine_ppl:.4f}, lowbit {n.lowbit_ppl:.4f} (Δ {n.delta_ppl:+.4f}); "
            f"KL(lowbit‖vLLM) {n.kl:.2e}; top-1 {n.top1:.4f}")


def refused_lines(v) -> list[str]:
    return [f"not verified: {why}" for _, why in v.refused]


def _share(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}%"


def _weights_only(p: dict) -> str:
    w = p.get("weights_only")
    return f"{num(w['ppl'], 6)} / {num(w['kl'], 4)}" if w else "—"


def _vs_engine(p: dict) -> str:
    """KL(llama.cpp's log-probabilities of the file ‖ lowbit's prediction), modelled / weights only."""
    v, w = p.get("vs_engine"), (p.get("weights_only") or {}).get("vs_engine")
    return " / ".join(f"{x['kl']:.2e}" for x in (v, w) if x) or "—"


def gguf_check_line(c) -> str:
    """One GGUF file verified in llama.cpp (:class:`lowbit.engines.llama_cpp.GGUFCheck`), one line."""
    e, p = c.engine, c.lowbit
    w = p.get("weights_only")
    wo = f"; weights only: PPL {w['ppl']:.4f}, KLD {num(w['kl'], 4)}" if w else ""
    if p.get("vs_engine"):
        wo += f"; KL(llama.cpp ‖ lowbit) {p['vs_engine']['kl']:.2e}"
        if w and w.get("vs_engine"):
            wo += f" (weights only {w['vs_engine']['kl']:.2e})"
    return (f"{Path(c.file).name}: llama.cpp PPL {e['ppl']:.4f}, lowbit {p['ppl']:.4f} (Δ {c.delta_ppl:+.4f}, target "
            f"≤ {c.ppl_target:.2g}: {'ok' if c.ppl_ok else 'MISS'}); KLD llama.cpp {num(e.get('kld'), 4)} / lowbit "
            f"{num(p['kl'], 4)}; same top-1 {num(e.get('same_top_p'), 2)}% / {_share(p['same_top'])}{wo}")


def gguf_table(v) -> Table:
    """llama.cpp's perplexity, KLD and same-top-p of each GGUF file beside lowbit's prediction of it."""
    t = Table(title=f"{v.model}: llama.cpp llama-perplexity against lowbit's prediction — {v.corpus}, {v.chunks} "
                    f"chunks × {v.ctx} tokens (second halves scored: {v.tokens_scored} tokens); KLD against the "
                    f"F32 GGUF (llama.cpp) / the fp32 model (lowbit); the F32 row's KLD and top-1: llama.cpp's F32 "
                    f"run against lowbit's fp32 model; lowbit models llama.cpp's 8-bit activation blocks "
                    f"('weights only': without them); 'KL to llama.cpp': KL(llama.cpp's log-probabilities of the "
                    f"file ‖ lowbit's prediction), modelled / weights only", title_justify="left")
    cols = ("file", "MiB", "llama.cpp PPL", "lowbit PPL", "Δ", "≤ 2×noise", "KLD llama.cpp", "KLD lowbit",
            "same top-1 llama.cpp", "same top-1 lowbit", "weights only PPL / KLD", "KL to llama.cpp",
            "llama.cpp s")
    for c in cols:
        t.add_column(c, justify="left" if c == "file" else "right", no_wrap=c == "file")
    n = v.noise
    kl, top = n.get("kl_engine_f32_vs_lowbit"), n.get("same_top_engine_f32_vs_lowbit")
    t.add_row("F32 (noise floor)", "", num(n["engine_ppl"], 6),
              num(n["lowbit_ppl"], 6), num(n["delta_ppl"], 3), "—", num(kl, 6) if kl is not None else "", "",
              _share(top) if top is not None else "", "", "", "", f"{n['engine_seconds']:.0f}")
    for c in v.checks:
        e, p = c.engine, c.lowbit
        t.add_row(Path(c.file).name, f"{c.file_bytes / 2**20:.2f}", num(e["ppl"], 6), num(p["ppl"], 6),
                  num(c.delta_ppl, 3), "yes" if c.ppl_ok else f"no (> {num(c.ppl_target, 2)})",
                  num(e.get("kld"), 4), num(p["kl"], 4),
                  f"{num(e.get('same_top_p'), 4)}%", _share(p['same_top']), _weights_only(p), _vs_engine(p),
                  f"{c.engine_seconds:.0f}")
    return t
