"""lowbit's quantized tensors in the compressed-tensors layout that vLLM and SGLang load.

Every convention conversion of lowbit lives here:

* lowbit's NVFP4 ``global_scale`` is a multiplier ``g``; compressed-tensors stores the
  divisor, so ``weight_global_scale = input_global_scale = _global_divisor(g)`` (the
  exact fp32 number lowbit divides by), and CT's ``scale / global`` reproduces lowbit.
* INT4/INT8 codes are written offset binary in int32 words (``lowbit.numerics.pack``); lowbit's
  asymmetric formats are unsigned (``uint4`` codes and zero points in [0, 15]) while
  compressed-tensors' are signed, so both are shifted by ``2**(bits-1)`` — the
  difference ``code − zero`` is unchanged.
* MXFP4 scales (powers of two) are written as E8M0 biased exponents in uint8.
* A tensor-granularity scale of shape ``(1, 1)`` is written with shape ``(1,)``.

Scale tensors are written in the checkpoint dtype when lowbit rounded them to that dtype
(bf16 scales in a bf16 checkpoint, as llm-compressor does), otherwise in fp32, so that
the values on disk are exactly lowbit's.  ``quantization_config`` carries only the keys
that compressed-tensors 0.11 and later all accept (its pydantic models forbid unknown
keys): no ``scale_dtype``/``zp_dtype``/``observer``.

A scheme that compressed-tensors or vLLM cannot represent is refused by
:func:`check_recipe` (no model needed) and :func:`check_shapes`, before any work.
"""

from __future__ import annotations

import logging

import torch

from ..numerics import formats as F
from ..numerics.pack import pack_int32, pack_nibbles
from ..numerics.qtensor import QTensor
from ..quantization.recipe import KVConfig, Recipe
from ..quantization.runtime import ActQuant
from ..numerics.scheme import Scheme, _global_divisor

__all__ = [
    "UnsupportedScheme", "ct_format", "scheme_args", "kv_args", "check_recipe", "check_shapes",
    "weight_tensors", "input_tensors", "scale_store_dtype", "MARLIN_GROUPS",
]

log = logging.getLogger(__name__)

#: group sizes vLLM's Marlin (W4A16 / W8A16) kernels run; "channel" is group -1
MARLIN_GROUPS = (32, 64, 128)
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


class UnsupportedScheme(ValueError):
    """A scheme compressed-tensors or vLLM cannot represent; the message says what to use."""


# -- which compressed-tensors format a (weight, input) pair becomes ---------------------


def _is_nvfp4(s: Scheme) -> bool:
    return (s.format == F.FP4_E2M1 and s.global_scale and s.scale_dtype == "fp8_e4m3"
            and s.granularity.kind == "group" and s.granularity.cols == 16)


def _is_mxfp4(s: Scheme) -> bool:
    return (s.format == F.FP4_E2M1 and s.scale_dtype == "e8m0" and not s.mx_round_up
            and s.granularity.kind == "group" and s.granularity.cols == 32)


def _refuse(what: str, why: str, use: str) -> UnsupportedScheme:
    return UnsupportedScheme(f"cannot export {what}: {why}; use {use}")


def _check_weight(w: Scheme) -> None:
    fmt, g = w.format, w.granularity
    if fmt == F.FP4_E2M1:
        if not (_is_nvfp4(w) or _is_mxfp4(w)):
            raise _refuse(f"FP4 weights ({w})", "compressed-tensors stores FP4 only as NVFP4 (groups of 16, FP8 "
                          "scales, global scale) or MXFP4 (groups of 32, E8M0 scales rounded the OCP way)",
                          "the nvfp4 or mxfp4 scheme")
        return
    if fmt == F.FP8_E4M3:
        if w.scale_dtype not in ("fp32", "bf16", "fp16"):
            raise _refuse(f"FP8 weights with {w.scale_dtype} scales", "vLLM reads FP8 weight scales as floats "
                          "(MXFP8 is not a compressed-tensors format vLLM serves)", "fp8-channel or fp8-block")
        if g.kind == "block" and (g.rows, g.cols) != (128, 128):
            raise _refuse(f"FP8 blocks {g}", "vLLM's block-FP8 kernels are built for 128×128 blocks", "fp8-block")
        if g.kind not in ("tensor", "channel", "block"):
            raise _refuse(f"FP8 weights per {g}", "vLLM runs FP8 weights per tensor, per channel or in 128×128 "
                          "blocks", "fp8-tensor, fp8-channel or fp8-block")
        return
    if fmt.kind == "int" and fmt.bits in (4, 8):
        if w.scale_dtype not in ("fp32", "bf16", "fp16"):
            raise _refuse(f"integer weights with {w.scale_dtype} scales", "vLLM reads integer weight scales "
                          "as floats", "scale_dtype bf16")
        if g.kind == "group" and g.cols not in MARLIN_GROUPS:
            raise _refuse(f"INT{fmt.bits} groups of {g.cols}", f"vLLM's Marlin kernels run group sizes "
                          f"{MARLIN_GROUPS} and per-channel only", "int4-g128, int4-g64 or int4-g32")
        if g.kind not in ("channel", "group"):
            raise _refuse(f"INT{fmt.bits} weights per {g}", "vLLM runs integer weights per channel or in "
                          "groups", "a channel or group scheme (e.g. int4-g128, int8-channel)")
        return
    raise _refuse(f"{fmt.name} weights", "compressed-tensors/vLLM have no kernel for this element format",
                  "fp8_e4m3, int8, int4 (or uint4 asymmetric), nvfp4 or mxfp4")


def _check_input(w: Scheme, i: Scheme) -> None:
    if not i.symmetric:
        raise _refuse(f"asymmetric inputs ({i})", "lowbit writes symmetric activation scales only",
                      "a symmetric input scheme")
    if _is_nvfp4(w) or _is_mxfp4(w):
        if (_is_nvfp4(w) and _is_nvfp4(i)) or (_is_mxfp4(w) and _is_mxfp4(i) and i.dynamic):
            return
        raise _refuse(f"{w} weights with {i} inputs", "vLLM pairs FP4 weights with FP4 inputs of the same "
                      "kind (or none)", "the nvfp4 / mxfp4 recipes, or w4a16-nvfp4 / w4a16-mxfp4")
    family = "float" if w.format == F.FP8_E4M3 else "int8"
    ok_fmt = F.FP8_E4M3 if family == "float" else F.INT8
    if w.format.bits != 8 or i.format != ok_fmt or i.scale_dtype not in ("fp32", "bf16", "fp16"):
        raise _refuse(f"{w} weights with {i} inputs", "vLLM's activation-quantized kernels are W8A8 FP8 "
                      "and W8A8 INT8 (W4A8 is not exported)", "fp8-dynamic, fp8-tensor, w8a8-int8 or a weight-only "
                      "recipe")
    g = i.granularity
    if g.kind == "token" and i.dynamic:
        return
    if g.kind == "tensor" and not i.dynamic:
        return
    if g.kind == "group" and g.cols == 128 and i.dynamic and family == "float" and w.granularity.kind == "block":
        return
    raise _refuse(f"inputs quantized as {i}", "vLLM quantizes activations per token (dynamic), per tensor "
                  "(static, calibrated) or, with 128×128 FP8 weight blocks, in dynamic groups of 128",
                  "fp8-token / int8-token, fp8-tensor / int8-tensor, or fp8-group128 with fp8-block")


def ct_format(w: Scheme | None, i: Scheme | None = None) -> str:
    """The compressed-tensors format name of a Linear quantized with weight scheme ``w``
    and input scheme ``i`` (``None``: not quantized).

    Raises:
        UnsupportedScheme: the pair cannot be written so that vLLM loads it.
    """
    if w is None:
        raise UnsupportedScheme(f"cannot export input-only quantization ({i}): compressed-tensors schemes "
                                "quantize weights; add a weight scheme")
    _check_weight(w)
    if i is not None:
        _check_input(w, i)
    if _is_nvfp4(w):
        return "nvfp4-pack-quantized"
    if _is_mxfp4(w):
        return "mxfp4-pack-quantized"
    if w.format == F.FP8_E4M3:
        return "float-quantized"
    if i is not None:
        return "int-quantized"
    return "pack-quantized"


def check_recipe(recipe: Recipe) -> None:
    """Refuse, before any work, a recipe that compressed-tensors or vLLM cannot represent."""
    for r in recipe.rules:
        if r.weights is None and r.inputs is None:
            continue
        try:
            ct_format(r.weights, r.inputs)
        except UnsupportedScheme as e:
            raise UnsupportedScheme(f"recipe {recipe.name!r}, rule {list(r.targets)}: {e}") from None
    if recipe.kv_cache is not None:
        kv_args(recipe.kv_cache)
    algo = recipe.algorithms
    if algo.rotation is not None:
        raise UnsupportedScheme(
            f"recipe {recipe.name!r}: rotations need an online Hadamard transform (down_proj inputs) and an "
            "untied lm_head, which this exporter does not write yet; export the recipe without `rotation`"
        )
    if algo.outliers is not None:
        raise UnsupportedScheme(
            f"recipe {recipe.name!r}: outlier channels kept in 16 bits (LLM.int8()-style) have no compressed-tensors "
            "layout; they are for accuracy comparisons only"
        )


def kv_args(kv: KVConfig) -> dict:
    """``kv_cache_scheme`` for a KV config vLLM reads: FP8 E4M3, one calibrated scale per layer
    for keys and for values."""
    s = kv.scheme
    if kv.center_keys:
        raise _refuse("a KV cache with centered keys (center_keys)", "no serving engine subtracts a per-channel key "
                      "mean at the cache write", "kv-fp8")
    if kv.residual:
        raise _refuse(f"a KV cache with a full-precision window of {kv.residual} tokens (residual)",
                      "vLLM's cache quantizes every token it stores", "kv-fp8")
    if kv.value_scheme not in (None, s) or not (kv.keys and kv.values):
        raise _refuse("a KV cache with keys and values treated differently", "vLLM's FP8 cache quantizes both "
                      "keys and values with one format", "kv-fp8")
    if s.format != F.FP8_E4M3 or s.granularity.kind != "tensor" or s.dynamic or not s.symmetric:
        raise _refuse(f"KV cache scheme {s}", "vLLM reads one calibrated FP8 E4M3 k_scale / v_scale per "
                      "attention layer", "kv-fp8")
    return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


# -- quantization args ------------------------------------------------------------------


def scheme_args(s: Scheme, role: str) -> dict:
    """The minimal ``QuantizationArgs`` mapping of ``s`` for ``role`` ``"weights"`` or ``"inputs"``."""
    g = s.granularity
    d = {"num_bits": s.format.bits, "type": "float" if s.format.kind == "float" else "int",
         "symmetric": s.symmetric}
    if g.kind == "group":
        d.update(strategy="tensor_group" if s.global_scale else "group", group_size=g.cols)
    elif g.kind == "block":
        d.update(strategy="block", block_structure=[g.rows, g.cols])
    else:
        d["strategy"] = g.kind  # tensor, channel, token
    if role == "weights":
        d["dynamic"] = False
    elif s.global_scale:
        d["dynamic"] = "local"  # per-group scales at run time, calibrated global scale
    else:
        d["dynamic"] = bool(s.dynamic)
    return d


# -- tensors ----------------------------------------------------------------------------


def scale_store_dtype(scheme: Scheme, dtype: torch.dtype) -> torch.dtype:
    """The dtype a float scale is written in: the checkpoint ``dtype`` when lowbit rounded
    the scale to it, else fp32 (every bf16/fp16 value is an fp32 value)."""
    return dtype if _DTYPE_NAMES.get(dtype) == scheme.scale_dtype else torch.float32


def _signed(qt: QTensor) -> torch.Tensor:
    """Signed integer codes as compressed-tensors counts them (unsigned formats shifted)."""
    v = qt.values()
    if not qt.scheme.format.signed:
        v = v - 2 ** (qt.scheme.format.bits - 1)
    return v


def _scale(qt: QTensor, dtype: torch.dtype) -> torch.Tensor:
    s = qt.scale.to(scale_store_dtype(qt.scheme, dtype))
    return s.reshape(1) if qt.scheme.granularity.kind == "tensor" else s.contiguous()


def weight_tensors(qt: QTensor, fmt: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tensors of one quantized Linear weight, by local name (``weight_packed``, ...).

    ``fmt`` is the Linear's :func:`ct_format`; ``dtype`` the checkpoint dtype (see
    :func:`scale_store_dtype`).
    """
    s = qt.scheme
    if fmt in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
        out = {"weight_packed": pack_nibbles(qt.codes)}
        if fmt == "nvfp4-pack-quantized":
            out["weight_scale"] = qt.scale.to(torch.float8_e4m3fn)  # exact: lowbit rounded it to fp8
            out["weight_global_scale"] = _global_divisor(qt.global_scale).reshape(1)
        else:
            out["weight_scale"] = F.E8M0.encode(qt.scale)  # biased exponent, exact for powers of two
        return out
    if s.format == F.FP8_E4M3:
        return {"weight": qt.codes.view(torch.float8_e4m3fn), "weight_scale": _scale(qt, dtype)}
    if fmt == "int-quantized":
        return {"weight": qt.codes.view(torch.int8), "weight_scale": _scale(qt, dtype)}
    bits = s.format.bits
    out = {
        "weight_packed": pack_int32(_signed(qt), bits),
        "weight_scale": _scale(qt, dtype),
        "weight_shape": torch.tensor(qt.shape, dtype=torch.int64, device=qt.codes.device),
    }
    if qt.zero is not None:
        out["weight_zero_point"] = pack_int32(qt.zero - 2 ** (bits - 1), bits, dim=0)
    return out


def input_tensors(aq: ActQuant) -> dict[str, torch.Tensor]:
    """Calibrated input scales of one Linear, by local name (none for dynamic schemes)."""
    if aq.global_scale is not None:
        return {"input_global_scale": _global_divisor(aq.global_scale).reshape(1)}
    if aq.qparams is not None:
        return {"input_scale": aq.qparams.scale.to(torch.float32).reshape(1)}
    return {}


def check_shapes(shapes: dict[str, tuple[int, int]], plan: dict[str, tuple[Scheme | None, Scheme | None]],
                 fused: list[tuple[str, ...]]) -> None:
    """Refuse shapes the format cannot hold, before any work.

    Args:
        shapes: ``(out_features, in_features)`` of each Linear.
        plan: weight and input scheme of each quantized Linear (``Recipe.resolve``).
        fused: Linears vLLM fuses into one matmul (q/k/v, gate/up), in their fused order.

    Raises:
        UnsupportedScheme: a group that does not divide ``in_features`` (compressed-tensors
            cannot decompress a ragged group and Marlin cannot run it), or FP8 blocks that
            vLLM's merged q/k/v or gate/up cannot split.
    """
    for name, (w, i) in plan.items():
        out_f, in_f = shapes[name]
        for s, role in ((w, "weight"), (i, "input")):
            if s is None:
                continue
            g = s.granularity
            if g.kind in ("group", "block") and in_f % g.cols:
                alt = [n for n in MARLIN_GROUPS if in_f % n == 0] if s.format.kind == "int" else []
                hint = f"a group size that divides {in_f} (e.g. {', '.join(f'g{n}' for n in alt)})" if alt else \
                    f"a scheme whose groups divide {in_f}"
                raise UnsupportedScheme(
                    f"cannot export {name}: its {role} scheme {s} splits in_features={in_f} into groups of "
                    f"{g.cols} with a ragged last group, which compressed-tensors and vLLM cannot hold; use {hint}")
    for members in fused:
        ws = [plan.get(n, (None, None))[0] for n in members]
        if any(w is not None and w.granularity.kind == "block" for w in ws):
            for n, w in zip(members[:-1], ws[:-1]):  # vLLM lets the last shard be ragged
                if w is not None and shapes[n][0] % w.granularity.rows:
                    raise UnsupportedScheme(
                        f"cannot export {n} with {w}: vLLM fuses {', '.join(members)} and needs out_features="
                        f"{shapes[n][0]} to be a multiple of the {w.granularity.rows}-row block; use fp8-dynamic")
    if any(w is not None and w.format.kind == "int" for w, _ in plan.values()):
        odd = sorted(n for n, (w, _) in plan.items()
                     if w is not None and w.format.kind == "int" and (shapes[n][1] % 128 or shapes[n][0] % 64))
        if odd:
            log.warning("%d Linears (e.g. %s) have in_features not a multiple of 128 or out_features not a multiple "
                        "of 64: vLLM's Marlin kernels cannot run them and fall back to slower kernels", len(odd), odd[0])
