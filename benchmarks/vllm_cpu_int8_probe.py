"""Run with .venv-vllm/bin/python: vLLM's CPU W8A8 INT8 GEMM (oneDNN) against exact integer arithmetic.

On an AVX2-only CPU (no VNNI) the full-range int8 weights lowbit (and llm-compressor) write give
errors of tens of percent of the output RMS (u8*s8 pair sums saturating int16), 7-bit weights do not.
See benchmarks/RESULTS.md, issue 14."""
# vLLM's CPU W8A8 INT8 GEMM (oneDNN) against exact integer arithmetic, on this AVX2 CPU
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()          # loads the _C build for this CPU (AVX2 here)
import vllm._custom_ops as ops
torch.manual_seed(0)
M, K, N = 64, 576, 256
x = torch.randn(M, K, dtype=torch.bfloat16) * 2
w = torch.randint(-127, 128, (N, K), dtype=torch.int8)       # full-range int8 codes, as lowbit writes
ws = torch.full((N, 1), 0.01, dtype=torch.float32)
h = ops.create_onednn_scaled_mm(w.t(), ws, torch.bfloat16, True, False, 32)
xq, xs, xzp = ops.onednn_scaled_int8_quant(x, None, None, True)
out = torch.empty(M, N, dtype=torch.bfloat16)
ops.onednn_scaled_mm(h, xq, out, xs, xzp, None, None)
exact = (xq.double() @ w.double().t()) * xs.double() * ws.double().t()
rel = ((out.double() - exact).abs() / exact.abs().clamp(min=1e-6))
print("codes range x", int(xq.min()), int(xq.max()), "; median rel err", float(rel.median()), "max abs err / rms",
      float((out.double() - exact).abs().max() / exact.pow(2).mean().sqrt()))
w7 = (w.to(torch.int16) // 2).to(torch.int8)                  # 7-bit weights: no int16 pair overflow possible
h7 = ops.create_onednn_scaled_mm(w7.t(), ws, torch.bfloat16, True, False, 32)
out7 = torch.empty(M, N, dtype=torch.bfloat16)
ops.onednn_scaled_mm(h7, xq, out7, xs, xzp, None, None)
exact7 = (xq.double() @ w7.double().t()) * xs.double() * ws.double().t()
print("7-bit weights: max abs err / rms", float((out7.double() - exact7).abs().max() / exact7.pow(2).mean().sqrt()))
print("isa", torch.backends.cpu.get_cpu_capability())
