"""lowbit's GGUF files against llama.cpp's own quantizer, on the same F32 source, at equal size.

    python benchmarks/gguf_vs_llama_quantize.py --lowbit out/gguf/lowbit-*.gguf --json benchmarks/results/X.json

1. the F32 GGUF of the model (the one ``lowbit verify --engine llama.cpp`` writes and caches);
2. the calibration text: lowbit's calibration windows (the same seeded windows its MSE / GPTQ
   runs saw), decoded, one after another;
3. ``llama-imatrix`` on that text (``-c`` = the window length, one chunk per window);
4. ``llama-quantize`` of the F32 file to each ``--types`` entry, without and with the imatrix;
5. ``lowbit verify --engine llama.cpp`` on every file, lowbit's and llama-quantize's, in one run:
   llama-perplexity's KLD against the F32 file, same text, same chunks.

``--types`` names llama-quantize's types. ``Q4_K`` / ``Q3_K`` are llama-quantize with ``--pure``
(every tensor Q4_K / Q3_K, or the type it falls back to for rows that are not whole 256-blocks) and
``--token-embedding-type q8_0``, the types of lowbit's ``gguf-q4_k`` / ``gguf-q3_k`` (uniform) files;
``Q4_0``, ``Q4_K_M`` and ``Q3_K_M`` are llama-quantize's own mixes (Q4_0 with the tied output /
embedding at Q6_K or its Q8_0 fallback; Q4_K_M with its ``use_more_bits`` layers at Q6_K, which
``benchmarks/recipes/smollm2-q4_k_m*.yaml`` spell out as lowbit rules; Q3_K_M as the preset
``gguf-q3_k_m``); ``IQ4_NL`` is llama-quantize's IQ4_NL mix (not lowbit's uniform ``gguf-iq4_nl``).

Each lowbit file is paired with the llama-quantize files whose per-tensor types are the same
(so the sizes agree to the metadata); the pairs and sizes are in the JSON.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lowbit.checkpoint.gguf import tensor_types  # noqa: E402
from lowbit.engines.llama_cpp import find_llama_cpp, reference_f32, verify_gguf  # noqa: E402
from lowbit.evaluation.workbench import Workbench  # noqa: E402


#: --types entry → (llama-quantize type, extra flags)
SPECS = {"Q4_K": ("Q4_K_S", ["--pure", "--token-embedding-type", "q8_0"]),
         "Q3_K": ("Q3_K_S", ["--pure", "--token-embedding-type", "q8_0"])}


def _run(cmd: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    log.write_text(" ".join(cmd) + "\n" + p.stdout + p.stderr)
    if p.returncode:
        raise RuntimeError(f"{cmd[0]} failed (exit {p.returncode}); log {log}")
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lowbit", nargs="*", default=[], help="lowbit GGUF files to compare")
    ap.add_argument("--types", default="Q4_0,Q4_K,Q4_K_M",
                    help="llama-quantize types, e.g. Q4_0,Q4_K,Q4_K_M,Q3_K,Q3_K_M,IQ4_NL (Q4_K, Q3_K: --pure, see above)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--calib-windows", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--work", type=Path, default=ROOT / "out" / "gguf")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()

    args.work.mkdir(parents=True, exist_ok=True)
    bench = Workbench.load(args.model, windows=1, calib_windows=args.calib_windows, progress=False)
    f32 = reference_f32(bench.model, bench.info)  # the file `lowbit verify --engine llama.cpp` uses
    calib = args.work / f"calib-{args.calib_windows}.txt"
    calib.write_text("".join(bench.tokenizer.decode(w.tolist()) for w in bench.calibration))
    imatrix = args.work / f"imatrix-{args.calib_windows}.gguf"
    timings = {}
    if not imatrix.exists():
        timings["imatrix"] = _run([str(find_llama_cpp("llama-imatrix")), "-m", str(f32), "-f", str(calib),
                                   "-c", str(args.ctx), "--chunks", str(args.calib_windows), "-o", str(imatrix),
                                   "-t", str(args.threads)], args.work / "imatrix.log")
    files = [Path(f) for f in args.lowbit]
    for t in args.types.split(","):
        qtype, flags = SPECS.get(t, (t, []))
        for tag, extra in (("", []), ("-imatrix", ["--imatrix", str(imatrix)])):
            out = args.work / f"llama-{t}{tag}.gguf"
            if not out.exists():
                timings[out.name] = _run([str(find_llama_cpp("llama-quantize")), *flags, *extra, str(f32), str(out),
                                          qtype, str(args.threads)], args.work / f"{out.stem}.log")
            files.append(out)
    types = {str(f): tensor_types(f, bench.model.config) for f in files}
    res = verify_gguf(files, reference=args.model, ctx=args.ctx, chunks=args.chunks, predict=False,
                      threads=args.threads,
                      on_result=lambda c: print(f"{Path(c.file).name}: KLD {c.engine.get('kld')} "
                                                f"PPL {c.engine['ppl']:.4f} {c.file_bytes / 2**20:.2f} MiB", flush=True))
    llama = [f for f in files if Path(f).name.startswith("llama-")]
    pairs = {str(f): [str(g) for g in llama if types[str(g)] == types[str(f)]] for f in files if f not in llama}
    out = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "calib_windows": args.calib_windows,
           "ctx": args.ctx, "chunks": args.chunks, "verify": res.to_dict(), "same_types": pairs,
           "timings_s": timings, "command": " ".join(sys.argv)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
