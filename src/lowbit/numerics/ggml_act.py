"""What llama.cpp's CPU backend does to the *activations* of a matrix product.

ggml multiplies a quantized weight by a float activation only after converting the activation
row to the weight type's ``vec_dot_type`` (``type_traits_cpu`` in ggml-cpu.c); the dot products
then run on integers, block by block.  So a GGUF file served by llama.cpp on a CPU computes with
8-bit activations, which a prediction from the dequantized weights alone leaves out:

============================  ===============  =============================================
weight type                   activation type  what one block of the activation row becomes
============================  ===============  =============================================
q4_0, q5_0, q8_0, iq4_nl      q8_0             32 elements; ``d = amax/127`` stored as fp16;
q4_1, q5_1                    q8_1             ``q = rint(x · 127/amax)``; value ``q · fp16(d)``
                                               (q8_1 adds ``d·Σq`` for the weight's min: the
                                               same values)
q4_k, q5_k, q6_k (and the     q8_k             256 elements; ``iscale = 127/amax`` (sign of the
other k-quants)                                largest element aside, which cancels);
                                               ``q = rint(x · iscale)``; value ``q · (1/iscale)``,
                                               the scale kept in fp32
f16 / bf16                    f16 / bf16       each element rounded to that type
f32                           f32              unchanged
============================  ===============  =============================================

``rint`` rounds half to even, as the AVX2 code (``_mm256_round_ps(…, _MM_ROUND_NEAREST)``) and
the reference's ``nearest_int`` do; an all-zero block stays zero.  Read from llama.cpp's
``quantize_row_q8_0`` / ``quantize_row_q8_1`` (x86) and ``quantize_row_q8_K_ref``, and the
repacked kernels' ``ggml_quantize_mat_q8_0_4x8`` / ``_q8_K_4x8``, which use the same formulas.
What stays unmodelled is the order of the float sums in the integer dot products (float noise).
"""

from __future__ import annotations

import torch

__all__ = ["VEC_DOT_TYPE", "vec_dot_type", "round_activations"]

#: weight type → the type ggml's CPU backend converts the activations to
VEC_DOT_TYPE: dict[str, str] = {
    "f32": "f32", "f16": "f16", "bf16": "bf16",
    "q4_0": "q8_0", "q5_0": "q8_0", "q8_0": "q8_0", "iq4_nl": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1",
    "q2_k": "q8_k", "q3_k": "q8_k", "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k",
}
_BLOCK = {"q8_0": 32, "q8_1": 32, "q8_k": 256}


def vec_dot_type(weight_type: str) -> str:
    try:
        return VEC_DOT_TYPE[weight_type.lower()]
    except KeyError:
        raise ValueError(f"no activation rule for ggml weight type {weight_type!r}; "
                         f"known: {', '.join(VEC_DOT_TYPE)}") from None


def round_activations(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` (…, n) as llama.cpp's CPU matmul sees it after converting each row to ``kind``
    (a ``vec_dot_type``: ``q8_0``, ``q8_1``, ``q8_k``, ``f16``, ``bf16`` or ``f32``), in fp32 and
    of ``x``'s dtype on return.  Rows must be whole blocks, as ggml requires."""
    if kind == "f32":
        return x
    if kind in ("f16", "bf16"):
        return x.to(torch.float16 if kind == "f16" else torch.bfloat16).to(x.dtype)
    if kind not in _BLOCK:
        raise ValueError(f"unknown activation type {kind!r}; known: f32, f16, bf16, {', '.join(_BLOCK)}")
    block = _BLOCK[kind]
    n = x.shape[-1]
    if n % block:
        raise ValueError(f"llama.cpp converts activations to {kind} in blocks of {block}; rows of {n} do not divide")
    b = x.to(torch.float32).reshape(*x.shape[:-1], n // block, block)
    amax = b.abs().amax(dim=-1, keepdim=True)
    live, c127, one, zero = amax != 0, torch.full_like(amax, 127.0), torch.ones_like(amax), torch.zeros_like(amax)
    # element-wise tensor divisions (IEEE, as the C code), not a scalar divisor torch might turn into a reciprocal
    inv = torch.where(live, c127 / torch.where(live, amax, one), zero)
    q = torch.round(b * inv)  # torch.round: half to even
    if kind == "q8_k":
        d = torch.where(live, one / torch.where(live, inv, one), zero)
    else:
        d = (amax / c127).to(torch.float16).to(torch.float32)
    return (q * d).reshape(x.shape).to(x.dtype)
