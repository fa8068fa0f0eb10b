"""Helper of scripts/gpu_check.sh: run one ``lowbit`` command in this process on a GPU and
append its wall time and peak GPU memory (torch's allocator, all devices) to a JSON-lines
file.

    python scripts/gpu_stage.py RESULTS.jsonl STAGE -- lowbit arguments...
"""

from __future__ import annotations

import json
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        print("usage: gpu_stage.py RESULTS.jsonl STAGE -- lowbit arguments...", file=sys.stderr)
        return 2
    out, stage, args = argv[0], argv[1], argv[3:]
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_stage.py: torch {torch.__version__} sees no CUDA GPU; this check needs one", file=sys.stderr)
        return 2
    from lowbit.cli import main as lowbit

    for d in range(torch.cuda.device_count()):
        torch.cuda.reset_peak_memory_stats(d)
    t0 = time.perf_counter()
    rc = lowbit(args)
    seconds = time.perf_counter() - t0
    peak = [torch.cuda.max_memory_allocated(d) / 2**30 for d in range(torch.cuda.device_count())]
    row = {"stage": stage, "rc": rc, "seconds": round(seconds, 2), "peak_gib": [round(p, 3) for p in peak],
           "device": torch.cuda.get_device_name(0), "args": args}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"[gpu_check] {stage}: rc {rc}, {seconds:.1f} s, peak GPU memory {max(peak):.2f} GiB", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
