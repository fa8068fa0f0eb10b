"""Score token windows with vLLM: prompt log-probabilities, top-k per position.

Run by the vLLM environment's python, never imported by lowbit (that environment has no
lowbit): it imports only vLLM, the standard library and numpy.

    python vllm_worker.py REQUEST.json OUT.npz

The request (JSON) holds ``model`` (a folder), ``dtype``, ``windows`` (lists of token ids),
``k``, ``max_model_len`` (at least a window's length + 1), ``eager`` (default true: no
torch.compile warm-up, which costs minutes on a small CPU) and optionally ``kv_cache_dtype`` and ``max_num_batched_tokens``
(chunked prefill: with chunks shorter than a window, every later chunk reads the earlier
tokens' K/V back from the paged cache, as serving does).  ``OUT.npz`` gets, per window and
predicted position ``t`` (token ``t + 1`` given tokens ``0..t``): ``target`` — the
log-probability of the true token; ``topk_ids`` / ``topk_logprobs`` — the ``k`` most
likely tokens by vLLM's rank; ``OUT.json`` what the engine actually ran with (dtype, KV
cache dtype, quantization method, chunking) and the seconds spent loading and scoring.
"""

import json
import os
import sys
import time


def _engine_facts(llm) -> dict:
    facts = {}
    try:
        cfg = llm.llm_engine.vllm_config
        facts["kv_cache_dtype"] = str(cfg.cache_config.cache_dtype)
        facts["dtype"] = str(cfg.model_config.dtype).replace("torch.", "")
        facts["quantization"] = str(cfg.model_config.quantization)
        sc = cfg.scheduler_config
        facts["max_num_batched_tokens"] = int(sc.max_num_batched_tokens)
        facts["chunked_prefill"] = bool(getattr(sc, "enable_chunked_prefill", False))
        facts["block_size"] = int(cfg.cache_config.block_size)
    except Exception as e:  # the facts are a report; a renamed attribute must not stop scoring
        facts["error"] = f"{type(e).__name__}: {e}"
    try:
        import vllm
        facts["vllm"] = vllm.__version__
        from vllm.platforms import current_platform
        facts["platform"] = str(current_platform.device_type)
    except Exception as e:
        facts.setdefault("error", f"{type(e).__name__}: {e}")
    return facts


def score(req: dict) -> tuple[dict, dict]:
    import numpy as np
    from vllm import LLM, SamplingParams

    k = int(req["k"])
    kw = dict(model=req["model"], dtype=req["dtype"], max_model_len=int(req["max_model_len"]), max_logprobs=k,
              enable_prefix_caching=False, seed=0, enforce_eager=bool(req.get("eager", True)))
    if req.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = req["kv_cache_dtype"]
    if req.get("max_num_batched_tokens"):
        kw["enable_chunked_prefill"] = True
        kw["max_num_batched_tokens"] = int(req["max_num_batched_tokens"])
        kw["max_num_seqs"] = 1
    t0 = time.perf_counter()
    llm = LLM(**kw)
    t1 = time.perf_counter()
    windows = req["windows"]
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": list(map(int, w))} for w in windows], sp, use_tqdm=False)
    t2 = time.perf_counter()
    n, seq = len(windows), len(windows[0])
    target = np.zeros((n, seq - 1), np.float32)
    ids = np.zeros((n, seq - 1, k), np.int32)
    lps = np.full((n, seq - 1, k), -np.inf, np.float32)
    for i, (w, out) in enumerate(zip(windows, outs)):
        pl = out.prompt_logprobs
        for t in range(1, seq):
            d = pl[t]
            target[i, t - 1] = d[int(w[t])].logprob
            top = sorted(d.items(), key=lambda kv: kv[1].rank)[:k]
            for j, (tok, lp) in enumerate(top):
                ids[i, t - 1, j] = tok
                lps[i, t - 1, j] = lp.logprob
    facts = _engine_facts(llm)
    facts.update(load_seconds=t1 - t0, score_seconds=t2 - t1, windows=n, seq_len=seq, k=k)
    return {"target": target, "topk_ids": ids, "topk_logprobs": lps}, facts


def main(argv) -> int:
    import numpy as np

    req_path, out_path = argv[1], argv[2]
    for var, value in (("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "0")):
        os.environ.setdefault(var, value)
    with open(req_path) as f:
        req = json.load(f)
    arrays, facts = score(req)
    np.savez(out_path, **arrays)
    with open(os.path.splitext(out_path)[0] + ".json", "w") as f:
        json.dump(facts, f, indent=2)
    return 0


if __name__ == "__main__":  # vLLM starts its engine in another process: the guard is required
    sys.exit(main(sys.argv))
