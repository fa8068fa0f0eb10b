"""``lowbit verify``: a checkpoint served by a real engine beside lowbit's prediction of it.

For each exported folder: the engine (vLLM, in its own environment, as a subprocess) scores
lowbit's evaluation windows with prompt log-probabilities (top-k); lowbit runs its own
quantized execution of the recipe the folder records, around the folder's weights, in the
dtype the engine ran; both are compared position by position (:mod:`.scoring`).  The noise
floor is the same comparison for the unquantized model (engine against lowbit, same dtype);
the reference is lowbit's unquantized fp32 model, as in ``lowbit eval``.

Targets (issue 14): ``|PPL(engine) − PPL(lowbit)| ≤ 2 × |noise-floor ΔPPL|`` and
``KL_S(lowbit ‖ engine) ≤ KL_S(reference ‖ lowbit) / 5``.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..evaluation.workbench import Workbench, _digest, model_fingerprint
from ..evaluation.metrics import window_metrics
from ..models.assets import cache_dir
from ..models.loading import load_model
from ..quantization.runtime import plain_forward, quantized_execution
from .bf16 import bf16_linear_via_fp32
from .folder import folder_recipe, prediction_state, read_card, source_model
from .scoring import EngineScores, Pair, PairAccumulator
from .support import EngineUnsupported, check_supported, cpu_caveats, engine_dtype, folder_schemes
from .venv import VllmPython, find_vllm_python

__all__ = ["EngineRequest", "CheckpointCheck", "Verification", "run_engine", "verify", "TARGET_PPL_FACTOR",
           "TARGET_KL_FRACTION"]

TARGET_PPL_FACTOR = 2.0
TARGET_KL_FRACTION = 0.2
WORKER = Path(__file__).with_name("vllm_worker.py")
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class EngineRequest:
    """How the engine runs one folder.  ``chunk``: tokens per prefill step (chunked prefill,
    so that later chunks read the earlier tokens' K/V back from the paged cache); ``None``:
    each window in one step."""

    model: str
    dtype: str
    k: int
    max_model_len: int
    kv_cache_dtype: str | None = None
    chunk: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CheckpointCheck:
    """One folder: the engine against lowbit's prediction (``pair``), the targets, timings."""

    folder: str
    recipe: str
    schemes: tuple[str, ...]
    request: EngineRequest
    engine: dict  # what the engine reports it ran with (dtype, KV cache dtype, quantization, ...)
    pair: Pair
    reference_ppl: float
    kl_reference_full: float  # lowbit's own KL(reference ‖ lowbit), top-1024 + rest, as `lowbit eval`
    ppl_target: float
    engine_seconds: float
    lowbit_seconds: float

    @property
    def ppl_ok(self) -> bool:
        return abs(self.pair.delta_ppl) <= self.ppl_target

    @property
    def kl_ratio(self) -> float | None:
        ref = self.pair.kl_reference
        return self.pair.kl / ref if ref else None

    @property
    def kl_ok(self) -> bool:
        return self.kl_ratio is not None and self.kl_ratio <= TARGET_KL_FRACTION

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(pair=self.pair.to_dict(), request=self.request.to_dict(), ppl_ok=self.ppl_ok,
                 kl_ratio=self.kl_ratio, kl_ok=self.kl_ok)
        return d


@dataclass(frozen=True)
class Verification:
    model: str
    corpus: str
    windows: int
    seq_len: int
    k: int
    engine: dict  # the vLLM python: path, distribution, version, platform
    noise: Pair | None
    noise_request: EngineRequest | None
    checks: tuple[CheckpointCheck, ...] = ()
    refused: tuple[tuple[str, str], ...] = ()  # (folder, one-line reason)
    caveats: tuple[str, ...] = ()  # schemes the engine runs, but inexactly on this CPU
    stage_seconds: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"model": self.model, "corpus": self.corpus, "windows": self.windows, "seq_len": self.seq_len,
                "k": self.k, "engine": self.engine, "noise": self.noise.to_dict() if self.noise else None,
                "noise_request": self.noise_request.to_dict() if self.noise_request else None,
                "checks": [c.to_dict() for c in self.checks], "refused": [list(r) for r in self.refused],
                "caveats": list(self.caveats),
                "stage_seconds": dict(self.stage_seconds)}


# -- the engine subprocess ---------------------------------------------------------------

_ERROR_LINE = re.compile(r"(?:^|\s|\.)([A-Z]\w*(?:Error|Exception)): (.+)$")
#: vLLM's wrappers around a worker's exception: the root cause is logged before them
_WRAPPERS = ("Engine core initialization failed", "Worker failed with error", "EngineCore encountered an issue",
             "EngineDeadError")


def _engine_error(log: str) -> str:
    """The root-cause exception line of an engine log ("NotImplementedError: ..."): the last
    exception that is not one of vLLM's wrappers, else the last line."""
    lines = [l for l in log.splitlines() if l.strip()]
    found = [f"{m[1]}: {m[2].strip()}" for m in map(_ERROR_LINE.search, lines) if m]
    causes = [f for f in found if not any(w in f for w in _WRAPPERS)]
    if causes or found:
        return (causes or found)[-1][:400]
    return (lines[-1] if lines else "no output")[:400]


def run_engine(vpy: VllmPython, req: EngineRequest, windows: torch.Tensor, log_path: Path,
               timeout: float = 1800) -> tuple[EngineScores, dict, float]:
    """Score ``windows`` with vLLM in ``vpy``: ``(scores, engine facts, seconds)``.

    Raises:
        EngineUnsupported: the engine failed (its last error line, and the log's path).
    """
    import os

    # VLLM_CPU_INT4_W4A8=0: on CPUs with AMX, vLLM would otherwise serve W4A16 INT4 folders as W4A8
    # (dynamic INT8 activations, vllm/model_executor/kernels/linear/mixed_precision/cpu.py), which is
    # not the recipe lowbit predicts
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0",
           "VLLM_CPU_INT4_W4A8": "0", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("PYTHONPATH", None)  # the engine's environment must not see lowbit's packages
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lowbit-verify-") as tmp:
        rq, out = Path(tmp) / "request.json", Path(tmp) / "scores.npz"
        body = {**req.to_dict(), "windows": windows.tolist(), "max_num_batched_tokens": req.chunk}
        rq.write_text(json.dumps(body))
        t0 = time.perf_counter()
        with open(log_path, "w") as log:
            try:
                r = subprocess.run([vpy.python, str(WORKER), str(rq), str(out)], stdout=log, stderr=subprocess.STDOUT,
                                   env=env, timeout=timeout, cwd=tmp)
            except subprocess.TimeoutExpired:
                raise EngineUnsupported(f"{Path(req.model).name}: vLLM did not finish in {timeout:.0f} s "
                                        f"(log: {log_path})") from None
        seconds = time.perf_counter() - t0
        if r.returncode != 0 or not out.exists():
            raise EngineUnsupported(f"{Path(req.model).name}: vLLM could not run it: "
                                    f"{_engine_error(log_path.read_text(errors='replace'))} (log: {log_path})")
        with np.load(out) as z:
            scores = EngineScores(z["target"], z["topk_ids"], z["topk_logprobs"])
        facts = json.loads(out.with_suffix(".json").read_text())
    facts["kernels"] = sorted(set(re.findall(r"\b(\w+(?:LinearKernel|ScaledMM\w*|FP8\w*))\b",
                                             log_path.read_text(errors="replace"))))[:8]
    return scores, facts, seconds


def _check_kv(req: EngineRequest, facts: dict) -> None:
    """Fail loudly when the engine's KV cache is not the one the folder's recipe asks for."""
    got = str(facts.get("kv_cache_dtype", "?"))
    want_fp8 = req.kv_cache_dtype is not None and req.kv_cache_dtype.startswith("fp8")
    if want_fp8 != got.startswith("fp8"):
        raise EngineUnsupported(f"{Path(req.model).name}: the engine ran kv_cache_dtype={got}, the recipe asks for "
                                f"{req.kv_cache_dtype or 'an unquantized cache'}; the comparison would be void")


# -- lowbit's side -----------------------------------------------------------------------


def _noise_cache(cache: Path, bench: Workbench, req: EngineRequest, vpy: VllmPython) -> Path:
    key = _digest(model_fingerprint(bench.info), bench.windows, json.dumps(req.to_dict(), sort_keys=True),
                  vpy.python, vpy.version)
    return cache / "verify" / f"engine-{bench.info.name}-{key}.npz"


def _engine_cached(vpy, req, windows, path: Path, log_path: Path):
    if path.exists():
        with np.load(path) as z:
            scores = EngineScores(z["target"], z["topk_ids"], z["topk_logprobs"])
        return scores, json.loads(path.with_suffix(".json").read_text()), 0.0
    scores, facts, seconds = run_engine(vpy, req, windows, log_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, target=scores.target, topk_ids=scores.topk_ids, topk_logprobs=scores.topk_logprobs)
    path.with_suffix(".json").write_text(json.dumps(facts, indent=2))
    return scores, facts, seconds


@torch.inference_mode()
def _compare(bench: Workbench, forward, scores: EngineScores, with_reference: bool) -> tuple[Pair, float]:
    """lowbit's ``forward`` against the engine on every window; with the reference's
    KL_S and lowbit's own top-1024 KL(reference ‖ lowbit)."""
    scores.check(bench.windows)
    acc = PairAccumulator()
    ref_forward = plain_forward(bench.model) if with_reference else None
    reference = bench.reference if with_reference else None
    kl_full = 0.0
    with bf16_linear_via_fp32():
        for w in range(len(bench.windows)):
            kl_full += _window(bench, forward, ref_forward, reference, scores, acc, w)
    pair = acc.result()
    return pair, kl_full / pair.tokens


def _window(bench, forward, ref_forward, reference, scores, acc, w: int) -> float:
    """One window into ``acc``; returns its summed top-1024 KL(reference ‖ lowbit) (0 without)."""
    ids = bench.windows[w:w + 1]
    logits = forward(ids)[0, :-1].float().cpu()  # the engine's scores are numpy arrays
    ref_logits = ref_forward(ids)[0, :-1].float().cpu() if ref_forward else None
    acc.add(logits, ids[0, 1:], scores, w, ref_logits)
    if reference is None:
        return 0.0
    return float(window_metrics(logits, ids[0, 1:], reference, w)["kl"].double().sum())


def verify(
    folders: list[Path],
    *,
    reference: str | None = None,
    recipe: str | None = None,
    windows: int = 8,
    seq_len: int = 512,
    corpus: str = "wiki",
    k: int = 64,
    python: str | None = None,
    engine: str = "vllm",
    kv_chunk: int = 64,
    cache: Path | None = None,
    progress: bool = False,
    on_result=None,
    on_noise=None,
    device: torch.device | str = "cpu",
) -> Verification:
    """Verify each exported folder against vLLM (see the module docstring).

    ``device``: where lowbit's own prediction runs (the engine picks its own); the dtype
    is the engine's for each folder.

    A folder whose scheme the engine cannot run, or that the engine fails on, is refused
    with a one-line reason; with a single folder that reason is raised.

    Raises:
        ValueError, FileNotFoundError: bad input (unknown engine, folder, recipe, reference);
            :class:`EngineUnsupported` for a single folder the engine cannot run;
            :class:`VllmMissing` without a vLLM environment (the message says what to run).
    """
    if engine != "vllm":
        raise ValueError(f"unknown engine {engine!r}; lowbit verify runs vllm")
    folders = [Path(f) for f in folders]
    if not folders:
        raise ValueError("name at least one folder")
    schemes = {f: folder_schemes(f) for f in folders}  # FileNotFoundError / ValueError before any work
    recipes = {f: folder_recipe(f, recipe) if s.groups or s.kv_cache else None for f, s in schemes.items()}
    sources = {source_model(f, reference) for f in folders}
    if len(sources) > 1:
        raise ValueError(f"the folders come from different models ({', '.join(sorted(sources))}); verify them "
                         "one model at a time or pass --reference")
    vpy = find_vllm_python(python)
    cache = cache_dir(cache)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = cache / "verify" / "logs"
    refused: list[tuple[str, str]] = []
    caveats: list[str] = []
    todo = []
    for f in folders:
        try:
            check_supported(schemes[f], vpy.platform, vpy.isa, vpy.amx)
            todo.append(f)
            if vpy.platform == "cpu":
                caveats.extend(cpu_caveats(schemes[f], vpy.isa, vpy.amx))
        except EngineUnsupported as e:
            if len(folders) == 1:
                raise
            refused.append((str(f), str(e)))
    t0 = time.perf_counter()
    device = torch.device(device)
    placed = {} if device.type == "cpu" else {"device": device}
    bench = Workbench.load(sources.pop(), corpus=corpus, windows=windows, seq_len=seq_len, calib_windows=0,
                           cache=cache, progress=progress, workers=1, **placed)
    stages = {"load": time.perf_counter() - t0}
    checks: list[CheckpointCheck] = []
    noise = noise_req = None
    lowbit_models: dict[str, torch.nn.Module] = {}
    for f in todo:
        s = schemes[f]
        dtype = engine_dtype(s)
        if dtype not in lowbit_models:
            lowbit_models[dtype] = load_model(str(bench.info.path), cache=cache, dtype=_DTYPES[dtype],
                                              device=device)[0]
        base = lowbit_models[dtype]
        if noise is None:
            noise_req = EngineRequest(str(bench.info.path), dtype, k, seq_len + 1)
            t1 = time.perf_counter()
            nscores, _, _ = _engine_cached(vpy, noise_req, bench.windows, _noise_cache(cache, bench, noise_req, vpy),
                                           logs / f"{bench.info.name}-unquantized-{stamp}.log")
            noise, _ = _compare(bench, plain_forward(base), nscores, with_reference=False)
            stages["noise floor"] = time.perf_counter() - t1
            if on_noise is not None:
                on_noise(noise)
        kv = "fp8" if s.kv_cache else None
        req = EngineRequest(str(f.resolve()), dtype, k, seq_len + 1, kv, kv_chunk if kv else None)
        try:
            scores, facts, eng_s = run_engine(vpy, req, bench.windows, logs / f"{f.name}-{stamp}.log")
            _check_kv(req, facts)
        except EngineUnsupported as e:
            if len(folders) == 1:
                raise
            refused.append((str(f), str(e)))
            continue
        t2 = time.perf_counter()
        r = recipes[f]
        from ..models.loading import read_into

        model = read_into(copy.deepcopy(base), f)
        state = prediction_state(model, f, r) if r is not None else None
        with quantized_execution(model, state) as fwd:
            pair, kl_full = _compare(bench, fwd, scores, with_reference=True)
        del model
        check = CheckpointCheck(str(f), r.name if r else "unquantized", s.labels, req, facts, pair,
                                float(np.exp(bench.reference.nll.double().mean())), kl_full,
                                TARGET_PPL_FACTOR * abs(noise.delta_ppl), eng_s, time.perf_counter() - t2)
        checks.append(check)
        if on_result is not None:
            on_result(check)
    card = read_card(todo[0]) if todo else None
    return Verification(card.model if card else bench.info.name, corpus, len(bench.windows), seq_len, k,
                        vpy.to_dict(), noise, noise_req, tuple(checks), tuple(refused), tuple(caveats), stages)
