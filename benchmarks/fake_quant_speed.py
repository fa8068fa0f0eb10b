"""Fake quantization of a 4096×4096 fp32 weight: lowbit against textbook references.

The references are written the way the schemes are usually described:

* NVFP4 / MXFP4: scale per block, then FP4 rounding by ``argmin`` of the distance to
  every value of the table (the table ordered so that a tie picks the even code, the
  rounding rule of the spec);
* FP8 per-channel: scale per row, then a cast to ``torch.float8_e4m3fn`` and back;
* INT4 g128: scale per group (bf16), ``round`` and ``clamp``.

Each (scheme, implementation) runs in its own process, so that peak memory is measured
in isolation: the kernel's peak-RSS mark is reset after a warm-up run, and the rise of
the peak over the resident size at that moment is what one call needs beyond its input.
Time is the best of ``--repeat`` runs.  Outputs are compared element for element in one
process.  Run: ``.venv/bin/python benchmarks/fake_quant_speed.py``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

import lowbit as lb
from lowbit.numerics import formats as F

SCHEMES = ["fp8-channel", "int4-g128", "mxfp4", "nvfp4"]
N = 4096


def weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, N, generator=g) * torch.exp(torch.randn(N, 1, generator=g))


def _fp4_grid_even_first() -> torch.Tensor:
    f = F.FP4_E2M1
    codes = [c for c in range(16) if c % 2 == 0] + [c for c in range(16) if c % 2 == 1]
    return torch.tensor([f.values[c] for c in codes if not (c == 8)])  # drop -0 (same value as +0)


def ref_fp4_round(v: torch.Tensor) -> torch.Tensor:
    grid = _fp4_grid_even_first()
    idx = (v.unsqueeze(-1) - grid).abs().argmin(dim=-1)
    return grid[idx]


def ref_mxfp4(w: torch.Tensor) -> torch.Tensor:
    b = w.reshape(N, N // 32, 32)
    amax = b.abs().amax(-1, keepdim=True)
    # the preset's rule (compressed-tensors'): amax rounded to the nearest power of two at one
    # mantissa bit (1.75·2^e and up count as 2^(e+1)), then OCP's floor(log2 amax) − emax(E2M1)
    e = torch.floor(torch.log2(amax))
    e = e + (amax / torch.exp2(e) >= 1.75).float()
    scale = torch.exp2(e - 2)
    return (ref_fp4_round((b / scale).clamp(-6, 6)) * scale).reshape(N, N)


def ref_nvfp4(w: torch.Tensor) -> torch.Tensor:
    g = w.abs().max() / (6 * 448)
    d = 1.0 / g
    b = w.reshape(N, N // 16, 16)
    bs = (b.abs().amax(-1, keepdim=True) / 6 * d).to(torch.float8_e4m3fn).to(torch.float32)
    eff = bs / d
    return (ref_fp4_round(b / eff) * eff).reshape(N, N)


def ref_fp8_channel(w: torch.Tensor) -> torch.Tensor:
    s = (w.abs().amax(-1, keepdim=True) / 448).to(torch.bfloat16).float()
    return (w / s).to(torch.float8_e4m3fn).to(torch.float32) * s


def ref_int4_g128(w: torch.Tensor) -> torch.Tensor:
    b = w.reshape(N, N // 128, 128)
    s = (b.abs().amax(-1, keepdim=True) / 7.5).to(torch.bfloat16).float()  # full range: all 16 levels
    return (torch.round(b / s).clamp(-8, 7) * s).reshape(N, N)


REFERENCE = {"fp8-channel": ref_fp8_channel, "int4-g128": ref_int4_g128, "mxfp4": ref_mxfp4, "nvfp4": ref_nvfp4}


def run_one(scheme: str, impl: str) -> torch.Tensor:
    w = weight()
    if impl == "lowbit":
        return lb.fake_quantize(w, lb.PRESETS[scheme])
    return REFERENCE[scheme](w)


def _worker(scheme: str, impl: str, repeat: int) -> dict:
    torch.set_num_threads(2)
    w = weight()
    fn = (lambda: lb.fake_quantize(w, lb.PRESETS[scheme])) if impl == "lowbit" else (lambda: REFERENCE[scheme](w))
    fn()  # warm-up: first-touch allocations and lazy initialisation
    _reset_peak()
    base = _rss_kib("VmRSS")
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    return {"seconds": min(times), "peak_mib": (_rss_kib("VmHWM") - base) / 1024}


def _reset_peak() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process (Linux)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--worker", nargs=2, metavar=("SCHEME", "IMPL"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker, args.repeat)))
        return

    print(f"fake quantization of a {N}x{N} fp32 matrix, {torch.get_num_threads()} threads, best of {args.repeat}")
    print(f"{'scheme':<12} {'lowbit s':>9} {'ref s':>9} {'speed-up':>9} {'lowbit MiB':>11} {'ref MiB':>9} {'mem ratio':>10} {'identical':>10}")
    for scheme in SCHEMES:
        res = {}
        for impl in ("lowbit", "reference"):
            out = subprocess.run(
                [sys.executable, __file__, "--worker", scheme, impl, "--repeat", str(args.repeat)],
                check=True, capture_output=True, text=True,
            )
            res[impl] = json.loads(out.stdout.strip().splitlines()[-1])
        a, b = run_one(scheme, "lowbit"), run_one(scheme, "reference")
        same = torch.equal(a, b)
        diff = "yes" if same else f"no ({int((a != b).sum())} differ)"
        lo, re_ = res["lowbit"], res["reference"]
        print(
            f"{scheme:<12} {lo['seconds']:>9.3f} {re_['seconds']:>9.3f} {re_['seconds'] / lo['seconds']:>8.1f}x "
            f"{lo['peak_mib']:>11.0f} {re_['peak_mib']:>9.0f} {lo['peak_mib'] / max(re_['peak_mib'], 1e-9):>10.2f} {diff:>10}"
        )


if __name__ == "__main__":
    main()
