"""``lowbit verify``: argument parsing and printing only."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "cmd_verify"]


def cmd_verify(args: argparse.Namespace) -> int:
    import json
    import time

    from ..engines.verify import verify
    from ..models.assets import cache_dir
    from ..report import verify as render
    from ..report.tables import print_tables
    from ..util.io import atomic_write_text

    from ..util.device import resolve_device

    device = resolve_device(args.device)
    if args.json and Path(args.json).exists() and not args.force:
        raise FileExistsError(f"{args.json} exists; pass --force to overwrite it")
    if args.engine == "llama.cpp":
        from ..engines.llama_cpp import verify_gguf

        res = verify_gguf([Path(d) for d in args.dirs], reference=args.reference, corpus=args.corpus,
                          ctx=args.seq_len, chunks=args.windows, cache=args.cache,
                          engine_logits=not args.no_engine_logits,
                          on_result=lambda c: print(render.gguf_check_line(c), flush=True))
        n = res.noise
        print(f"noise floor (F32 GGUF): llama.cpp {n['engine_ppl']:.4f}, lowbit {n['lowbit_ppl']:.4f} "
              f"(Δ {n['delta_ppl']:.2e}); KL(llama.cpp F32 ‖ lowbit fp32) {n['kl_engine_f32_vs_lowbit']:.2e}, "
              f"same top-1 {100 * n['same_top_engine_f32_vs_lowbit']:.2f}%; tokens as transformers' "
              f"{100 * n['tokens_as_transformers']:.2f}%")
        print_tables(render.gguf_table(res))
    else:
        res = verify([Path(d) for d in args.dirs], reference=args.reference, recipe=args.recipe, windows=args.windows,
                     seq_len=args.seq_len, corpus=args.corpus, k=args.topk, python=args.python, engine=args.engine,
                     kv_chunk=args.kv_chunk, cache=args.cache, device=device,
                     on_result=lambda c: print(render.check_line(c), flush=True),
                     on_noise=lambda n: print(render.noise_line(n), flush=True))
        for line in render.refused_lines(res):
            print(line)
        for line in res.caveats:
            print(f"caveat: {line}")
        if res.checks:
            print_tables(render.verify_table(res))
    path = Path(args.json) if args.json else \
        cache_dir(args.cache) / "results" / f"verify-{res.model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(res.to_dict(), indent=2) + "\n")
    print(f"results written to {path}")
    return 0 if res.checks or not getattr(res, "refused", None) else 2


def register(subparsers) -> None:
    """Add ``verify`` to the CLI's subparsers."""
    p = subparsers.add_parser("verify", help="run exported folders in real vLLM and compare with lowbit's prediction")
    p.add_argument("dirs", nargs="+", metavar="DIR", help="folders written by `lowbit quantize` (with --engine llama.cpp: "
                                                          ".gguf files written by `lowbit quantize --format gguf`)")
    p.add_argument("--reference", metavar="MODEL", help="the unquantized model (default: the one the card names)")
    p.add_argument("--recipe", help="the recipe the folders were written with (default: the model card's preset)")
    p.add_argument("--windows", type=int, default=8, help="evaluation windows (llama.cpp: chunks; default 8)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per window (llama.cpp: -c; default 512)")
    p.add_argument("--corpus", default="wiki", help="evaluation corpus (default wiki)")
    p.add_argument("--topk", type=int, default=64, help="prompt log-probs per position vLLM returns (default 64)")
    p.add_argument("--engine", default="vllm", choices=["vllm", "llama.cpp"],
                   help="the serving engine (default vllm; llama.cpp: llama-perplexity from `make llama-cpp`)")
    p.add_argument("--python", metavar="PATH", help="python of an existing vLLM environment (default .venv-vllm, "
                                                    "created by `make vllm`)")
    p.add_argument("--kv-chunk", type=int, default=64,
                   help="prefill chunk (tokens) for folders with an FP8 KV cache, so that later chunks read the "
                        "cache (default 64)")
    p.add_argument("--no-engine-logits", action="store_true",
                   help="llama.cpp: skip the second run per file that dumps llama.cpp's own log-probabilities "
                        "(then no KL of the prediction from them)")
    p.add_argument("--cache", type=Path, default=None, help="cache folder (default $LOWBIT_CACHE or ~/.cache/lowbit)")
    p.add_argument("--json", metavar="FILE", help="write results here (default: a new file under the cache)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    from .device import add_device_options

    add_device_options(p, dtype=False, batch=False)  # the dtype is the engine's (docs/devices.md)
    p.set_defaults(func=cmd_verify)
