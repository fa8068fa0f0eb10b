"""``lowbit quantize`` and ``lowbit serve-command``: argument parsing and printing only."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["register", "cmd_quantize", "cmd_serve_command"]


def _print_eval(ev: dict | None) -> None:
    if ev:
        ref, q = ev["reference"], ev["checkpoint"]
        print(f"evaluation ({q['windows']} windows): ppl {ref['ppl']:.4f} -> {q['ppl']:.4f} "
              f"({q['delta_pct']:+.2f}%), KL {q['kl_mean']:.5f}, top-1 {q['top1']:.4f}")


def _cmd_quantize_gguf(args: argparse.Namespace) -> int:
    from ..workflows.gguf import quantize_to_gguf

    if args.low_memory:
        raise ValueError("--low-memory is not implemented for --format gguf (the file is written whole)")
    res = quantize_to_gguf(args.model, args.recipe, Path(args.out), force=args.force, calib_windows=args.calib_windows,
                           corpus=args.corpus, seed=args.seed, evaluate=args.eval, windows=args.windows,
                           cache=args.cache)
    counts: dict[str, int] = {}
    for t in res.types.values():
        counts[t] = counts.get(t, 0) + 1
    print(f"wrote {res.path} ({', '.join(f'{n}× {t}' for t, n in sorted(counts.items()))}; "
          f"{res.file_bytes / 2**20:.2f} MiB); read back: every weight decodes to lowbit's values")
    _print_eval(res.eval)
    print(f"check it in llama.cpp: lowbit verify {res.path} --engine llama.cpp")
    return 0


def cmd_quantize(args: argparse.Namespace) -> int:
    from ..workflows import ShipOptions, quantize_streaming, quantize_to_folder
    from .device import device_settings

    if args.format == "gguf":
        return _cmd_quantize_gguf(args)
    device, run_dtype = device_settings(args)
    options = ShipOptions(force=args.force, calib_windows=args.calib_windows, corpus=args.corpus,
                          calib_corpus=args.calib_corpus, seed=args.seed, cache=args.cache,
                          device=device, run_dtype=run_dtype)
    if args.low_memory:
        if args.eval:
            raise ValueError("--low-memory does not evaluate (that needs the whole model in memory); pass --no-eval "
                             f"and run `lowbit eval {args.out} --reference {args.model}` afterwards")
        res = quantize_streaming(args.model, args.recipe, Path(args.out), options)
    else:
        res = quantize_to_folder(args.model, args.recipe, Path(args.out), options, evaluate=args.eval,
                                 windows=args.windows, loss_on=args.loss_on, batch=args.batch)
    s = res.sizes
    print(f"wrote {res.path} ({', '.join(sorted(set(res.formats))) or 'no quantized Linears'})")
    print(f"size on disk: {s.file_bytes / 2**20:.2f} MiB; quantized Linears {s.quantized_bytes / 2**20:.2f} MiB, "
          f"bits_per_element predicted {s.predicted_bytes / 2**20:.2f} MiB (ratio {s.ratio:.3f})")
    _print_eval(res.eval)
    print(f"serve it: lowbit serve-command {res.path}")
    return 0


def cmd_serve_command(args: argparse.Namespace) -> int:
    from ..checkpoint.serve import serve_plan

    print(serve_plan(Path(args.dir), max_model_len=args.max_model_len).text())
    return 0


def register(subparsers) -> None:
    """Add ``quantize`` and ``serve-command`` to the CLI's subparsers."""
    p = subparsers.add_parser("quantize", help="quantize a model and write a compressed-tensors checkpoint (vLLM, SGLang)")
    p.add_argument("model", metavar="MODEL", help="packaged model name, Hugging Face folder, .gguf file or hub id")
    p.add_argument("--recipe", required=True, help="recipe preset (see `lowbit compare --help`) or YAML file")
    p.add_argument("--out", required=True, metavar="DIR", help="folder (or .gguf file) to write (refused if it exists)")
    p.add_argument("--format", choices=("compressed-tensors", "gguf"), default="compressed-tensors",
                   help="compressed-tensors folder (vLLM, SGLang; default) or one GGUF file (llama.cpp; "
                        "recipes of gguf-* schemes, e.g. gguf-q4_k_m)")
    p.add_argument("--force", action="store_true", help="replace an existing DIR")
    p.add_argument("--calib-windows", type=int, default=128, help="calibration windows for static scales (default 128)")
    p.add_argument("--corpus", default="wiki", help="evaluation corpus, and the calibration one unless --calib-corpus "
                                                    "(default wiki; the sources of `lowbit compare --corpus`)")
    p.add_argument("--calib-corpus", default=None, metavar="CORPUS",
                   help="calibration corpus (train split), or a mixture such as wiki+brown+code (default --corpus)")
    p.add_argument("--loss-on", choices=["all", "assistant"], default="all",
                   help="tokens the evaluation counts: all, or (a --corpus of conversations) the assistant's only")
    p.add_argument("--seed", type=int, default=0, help="seed of calibration sampling and the bootstrap")
    p.add_argument("--eval", action=argparse.BooleanOptionalAction, default=True,
                   help="evaluate the written checkpoint against the unquantized model (default on)")
    p.add_argument("--windows", type=int, default=64, help="evaluation windows (default 64)")
    p.add_argument("--low-memory", action="store_true",
                   help="hold one decoder layer in memory at a time, reading the model from its safetensors and "
                        "writing the checkpoint layer by layer, and one calibration chunk's activations at a time "
                        "(algorithms.recompute; for models larger than memory; needs --no-eval)")
    p.add_argument("--cache", type=Path, default=None, help="cache folder (default $LOWBIT_CACHE or ~/.cache/lowbit)")
    from .device import add_device_options

    add_device_options(p)  # with --low-memory: one decoder layer at a time on --device
    p.set_defaults(func=cmd_quantize)

    s = subparsers.add_parser("serve-command", help="print the vLLM / SGLang commands for an exported folder")
    s.add_argument("dir", metavar="DIR", help="a folder written by `lowbit quantize`")
    s.add_argument("--max-model-len", type=int, default=4096, help="context length for the vLLM command")
    s.set_defaults(func=cmd_serve_command)
