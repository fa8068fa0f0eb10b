"""Is torch's FP8 ``_scaled_mm`` on this CPU exact?  (issue 14: vLLM's CPU FP8 W8A8 kernel,
``ChannelWiseTorchFP8ScaledMMLinearKernel``, multiplies the FP8 codes with unit scales, fp32 out, then
applies the per-token and per-channel scales.)

Per-token FP8 E4M3 activations (one outlier channel) against per-channel FP8 weights; each path's
relative Frobenius error and max error (over the output's std) against a float64 product of the
same codes and scales.

    .venv/bin/python benchmarks/fp8_scaled_mm_exact.py
"""

import torch


def main() -> None:
    torch.manual_seed(0)
    m, k, n = 512, 576, 1536
    x = torch.randn(m, k) * 2
    x[:, 5] *= 30
    w = torch.randn(n, k) * 0.05
    xs = x.abs().amax(1, keepdim=True) / 448
    ws = w.abs().amax(1, keepdim=True) / 448
    xq = (x / xs).clamp(-448, 448).to(torch.float8_e4m3fn)
    wq = (w / ws).clamp(-448, 448).to(torch.float8_e4m3fn)
    exact = (xq.double() @ wq.double().T) * xs.double() * ws.double().T
    one = torch.ones(1)
    paths = {
        "_scaled_mm, unit scales, fp32 out (vLLM CPU)":
            lambda: torch._scaled_mm(xq, wq.T, scale_a=one, scale_b=one, out_dtype=torch.float32) * xs * ws.T,
        "_scaled_mm, row-wise scales, bf16 out":
            lambda: torch._scaled_mm(xq, wq.T, scale_a=xs, scale_b=ws.T.contiguous(), out_dtype=torch.bfloat16),
        "dequantized fp32 matmul": lambda: (xq.float() * xs) @ (wq.float() * ws).T,
        "dequantized bf16 matmul": lambda: (xq.float() * xs).bfloat16() @ (wq.float() * ws).T.bfloat16(),
    }
    for name, fn in paths.items():
        try:
            y = fn().double()
        except (RuntimeError, NotImplementedError) as e:
            print(f"{name:46s} not available: {str(e).splitlines()[0][:100]}")
            continue
        rel = float((y - exact).norm() / exact.norm())
        mx = float((y - exact).abs().max() / exact.std())
        print(f"{name:46s} relative error {rel:.2e}   max error / std {mx:.2e}")


if __name__ == "__main__":
    main()
