"""How one tensor is quantized: element format × granularity × scales.

The one scale convention of lowbit, used everywhere::

    x ≈ (decode(code) − zero) · scale · global_scale

``scale`` has one entry per block of the granularity and is stored rounded to
``scale_dtype``; ``zero`` exists only for asymmetric schemes and lies in the element
format's value range; ``global_scale`` (one fp32 number per tensor) exists only for
two-level schemes such as NVFP4.  Other tools' conventions (compressed-tensors'
divisor-style global scale, offset-binary int4, E8M0 scales as biased exponents) are
converted in ``lowbit.checkpoint`` and nowhere else.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass

import torch

from . import formats as F
from . import ggml as G
from ..util.validate import from_mapping
from .granularity import CHANNEL, TENSOR, TOKEN, Granularity, block, group, parse_granularity

__all__ = [
    "Scheme",
    "PRESETS",
    "SCALE_DTYPES",
    "get_scheme",
    "bits_per_element",
    "scheme_from_dict",
]

#: scale storage formats and their widths in bits
SCALE_DTYPES: dict[str, int] = {"fp32": 32, "bf16": 16, "fp16": 16, "fp8_e4m3": 8, "e8m0": 8}
_TORCH_SCALE = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Scheme:
    """How one tensor is quantized.

    Attributes:
        format: the element format (see :mod:`lowbit.numerics.formats`).
        granularity: which elements share a scale.
        symmetric: ``False`` adds an integer zero point per block (integer formats only).
        scale_dtype: how scales are stored: ``fp32``, ``bf16``, ``fp16``, ``fp8_e4m3``
            (NVFP4 block scales) or ``e8m0`` (power-of-two MX scales).
        global_scale: one extra fp32 scale per tensor (NVFP4): block scales are then
            stored relative to it, so that they fit the FP8 range.
        dynamic: for activations, scales are computed from each tensor at run time;
            otherwise they come from calibration.  A global scale is always calibrated.
        mx_round_up: for ``e8m0`` scales, round the shared exponent up so that nothing
            clips (NVIDIA's rule) instead of the OCP MX rule ``floor(log2 amax) − emax``.
        mx_nearest: for ``e8m0`` scales, first round ``amax`` to the nearest power of two
            at one mantissa bit (a block whose ``amax`` is ≥ 1.75·2^e counts as 2^(e+1)),
            then apply the OCP rule — compressed-tensors' (llm-compressor's) rule.  Blocks
            that would clip their largest element by more than 1/7 get the next exponent.
        full_range: for symmetric integer formats, map ``amax`` to ``(qmax − qmin) / 2``
            (7.5 for INT4, 127.5 for INT8) so that all ``2^bits`` levels are used, as
            compressed-tensors and llm-compressor do; the positive end may clip by half a
            step.  ``False``: ``amax / qmax`` over the restricted range [−qmax, qmax].
        signed_scale: for symmetric integer weights, the scale takes the sign that puts
            each block's largest-magnitude element exactly on the most negative level
            (``scale = x_ext / qmin``: −8 for INT4, −2 for INT2), so that all ``2^bits``
            levels are used with a step of ``amax / 8`` (INT4), finer than full_range's
            ``amax / 7.5``; the extreme is exact, and only elements of the other sign beyond
            ``qmax + ½`` steps saturate — the rule of llama.cpp's Q4_0 and of AutoRound's
            symmetric integers.  Scales are then negative for blocks whose extreme is
            positive; dequantization ``q · scale`` is unchanged, so checkpoints keep the
            plain symmetric layout.  Excludes ``full_range`` (which it supersedes) and
            dynamic (activation) schemes.
    """

    format: F.Format
    granularity: Granularity
    symmetric: bool = True
    scale_dtype: str = "fp32"
    global_scale: bool = False
    dynamic: bool = False
    mx_round_up: bool = False
    full_range: bool = False
    mx_nearest: bool = False
    ggml: str = ""
    signed_scale: bool = False

    def __post_init__(self) -> None:
        fmt = self.format
        if self.ggml:
            self._check_ggml()
        if fmt.kind == "e8m0":
            raise ValueError("e8m0 is a scale format, not an element format; use it as scale_dtype")
        if self.scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"unknown scale_dtype {self.scale_dtype!r}; expected one of {list(SCALE_DTYPES)}")
        if not self.symmetric and fmt.kind != "int":
            raise ValueError(
                f"asymmetric quantization needs an integer format, got {fmt.name}: float formats are "
                "symmetric around zero (compressed-tensors and vLLM refuse asymmetric FP4/FP8); use symmetric=True"
            )
        if not self.symmetric and self.scale_dtype == "e8m0":
            raise ValueError("power-of-two (e8m0) scales are defined for symmetric schemes only")
        if fmt.kind == "int" and self.symmetric and not fmt.signed:
            raise ValueError(f"symmetric quantization needs a signed format, got {fmt.name}")
        if self.global_scale and self.scale_dtype != "fp8_e4m3":
            raise ValueError("a global scale is used with fp8_e4m3 block scales (NVFP4-style); set scale_dtype='fp8_e4m3'")
        if self.mx_round_up and self.scale_dtype != "e8m0":
            raise ValueError("mx_round_up applies to e8m0 scales only")
        if self.mx_nearest and (self.scale_dtype != "e8m0" or self.mx_round_up):
            raise ValueError("mx_nearest applies to e8m0 scales only, and excludes mx_round_up")
        if self.full_range and not (fmt.kind == "int" and self.symmetric):
            raise ValueError("full_range applies to symmetric integer formats only")
        if self.signed_scale:
            if not (fmt.kind == "int" and self.symmetric) or self.global_scale or self.scale_dtype == "e8m0":
                raise ValueError("signed_scale applies to symmetric integer formats with float scales only")
            if self.full_range:
                raise ValueError("signed_scale and full_range exclude each other: signed_scale already uses "
                                 "all levels (the block's extreme on qmin); set full_range: false")
            if self.dynamic:
                raise ValueError("signed_scale is for weights: engines compute dynamic activation scales "
                                 "as positive amax / qmax")

    def _check_ggml(self) -> None:
        t = G.get_type(self.ggml)
        want = dict(format=t.format_name, granularity=f"group({t.block})", symmetric=not t.has_min,
                    scale_dtype="fp16", global_scale=False, dynamic=False, full_range=False, mx_round_up=False,
                    mx_nearest=False, signed_scale=False)
        have = {k: (getattr(self, k).name if k == "format" else str(getattr(self, k)) if k == "granularity"
                    else getattr(self, k)) for k in want}
        bad = [f"{k}={have[k]!r} (needs {v!r})" for k, v in want.items() if have[k] != v]
        if bad:
            raise ValueError(f"ggml type {t.name}: " + ", ".join(bad) + f"; use the preset gguf-{t.name}")

    @property
    def ggml_type(self) -> "G.GGMLType | None":
        return G.get_type(self.ggml) if self.ggml else None

    def __str__(self) -> str:
        """Every field that differs from its default, so that different schemes print differently."""
        if self.ggml:
            return f"gguf {self.ggml}"
        parts = [self.format.name, str(self.granularity)]
        if not self.symmetric:
            parts.append("asym")
        parts.append(f"scale={self.scale_dtype}")
        flags = {"global_scale": "+global", "dynamic": "dynamic", "full_range": "full-range",
                 "mx_round_up": "mx-round-up", "mx_nearest": "mx-nearest", "signed_scale": "signed-scale"}
        parts += [label for name, label in flags.items() if getattr(self, name)]
        return " ".join(parts)

    @property
    def qmin(self) -> float:
        return self.format.min

    @property
    def qmax(self) -> float:
        return self.format.max

    def to_dict(self) -> dict:
        """The fields as plain values: what :func:`scheme_from_dict` reads back."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.name if isinstance(v, F.Format) else (str(v) if isinstance(v, Granularity) else v)
        return out

    # -- scales ------------------------------------------------------------------------

    def round_scale(self, s: torch.Tensor) -> torch.Tensor:
        """Round scales (fp32) to how they are stored; returns fp32."""
        if self.scale_dtype in _TORCH_SCALE:
            return s.to(_TORCH_SCALE[self.scale_dtype]).to(torch.float32)
        if self.scale_dtype == "fp8_e4m3":
            return F.FP8_E4M3.round(s)
        return F.E8M0.round_by_table(s)

    def global_scale_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """The per-tensor scale that maps the tensor's absmax to ``format.max · fp8.max``.

        An all-zero tensor gets 1, so that nothing divides by zero.
        """
        denom = self.format.max * F.FP8_E4M3.max
        g = amax.to(torch.float32) / denom
        return torch.where(amax > 0, g, torch.ones_like(g)).reshape(())

    def scales_from_range(
        self,
        lo: torch.Tensor,
        hi: torch.Tensor,
        global_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Scale and zero point per block from the block's min ``lo`` and max ``hi``.

        Zero is always representable: the range is widened to include it.  A block whose
        range is zero gets scale 0, and every element of it quantizes to zero.

        Returns ``(scale, zero)``; ``zero`` is ``None`` for symmetric schemes.
        """
        fmt = self.format
        if self.ggml:
            raise NotImplementedError(
                f"scales_from_range is not defined for ggml type {self.ggml} (signed or two-level scales); "
                "use compute_qparams or the GGUF-aware MSE / GPTQ observers")
        lo = torch.minimum(lo.to(torch.float32), torch.zeros((), dtype=torch.float32, device=lo.device))
        hi = torch.maximum(hi.to(torch.float32), torch.zeros((), dtype=torch.float32, device=hi.device))
        if not self.symmetric:
            scale = self.round_scale((hi - lo) / (fmt.max - fmt.min))
            safe = torch.where(scale > 0, scale, torch.ones_like(scale))
            zero = torch.round(fmt.min - lo / safe).clamp_(fmt.min, fmt.max)
            return scale, torch.where(scale > 0, zero, torch.zeros_like(zero))
        amax = torch.maximum(-lo, hi)
        if self.signed_scale:            # the extreme on qmin: positive scale when it is negative
            return self.round_scale(torch.where(-lo >= hi, amax, -amax) / -fmt.min), None
        if self.scale_dtype == "e8m0":
            return _mx_scale(amax, fmt, self.mx_round_up, self.mx_nearest), None
        if self.global_scale:
            if global_scale is None:
                raise ValueError("this scheme has a global scale; pass global_scale")
            # stored block scale, relative to the global scale; saturates at fp8 max (448)
            return F.FP8_E4M3.round(amax / fmt.max * _global_divisor(global_scale)), None
        levels = (fmt.max - fmt.min) / 2 if self.full_range else fmt.max
        return self.round_scale(amax / levels), None


def _global_divisor(global_scale: torch.Tensor) -> torch.Tensor:
    """``1 / global_scale`` as runtimes that store the reciprocal (compressed-tensors,
    vLLM) hold it.  Every use of a global scale goes through this one number, so lowbit
    rounds exactly as they do."""
    return (1.0 / global_scale.to(torch.float32)).to(torch.float32)


def _mx_scale(amax: torch.Tensor, fmt: F.Format, round_up: bool, nearest: bool = False) -> torch.Tensor:
    """OCP MX shared scale 2^(floor(log2 amax) − emax_elem); or, rounded up,
    2^ceil(log2(amax / max_elem)) so that no element clips; or (``nearest``) the OCP
    rule applied to ``amax`` rounded to one mantissa bit (frexp mantissa ≥ 0.875 carries
    to the next power of two).  Exponents clamp to the E8M0 range [−127, 127]; an
    all-zero block gets 2^−127."""
    a = amax.clamp(min=2.0**-127)
    if round_up:
        e = torch.ceil(torch.log2(a / fmt.max))
    else:
        m, ex = torch.frexp(a)  # a = m·2^ex, m in [0.5, 1): exact floor(log2 a) = ex − 1
        if nearest:
            ex = ex + (m >= 0.875).to(ex.dtype)  # 1.75·2^(ex−1) and up round to 2^ex
        e = (ex - 1 - fmt.emax).to(torch.float32)
    return torch.exp2(e.clamp(-127, 127))


# -- presets -------------------------------------------------------------------------

PRESETS: dict[str, Scheme] = {
    # weights
    "fp8-tensor": Scheme(F.FP8_E4M3, TENSOR),
    "fp8-channel": Scheme(F.FP8_E4M3, CHANNEL, scale_dtype="bf16"),
    "fp8-block": Scheme(F.FP8_E4M3, block(128, 128)),
    # integer weights use all 2^bits levels (scale = amax / 7.5 for INT4), as compressed-tensors does
    "int8-tensor": Scheme(F.INT8, TENSOR),
    "int8-channel": Scheme(F.INT8, CHANNEL, scale_dtype="bf16", full_range=True),
    "int4-channel": Scheme(F.INT4, CHANNEL, scale_dtype="bf16", full_range=True),
    "int4-tensor": Scheme(F.INT4, TENSOR, full_range=True),
    "int4-g128": Scheme(F.INT4, group(128), scale_dtype="bf16", full_range=True),
    "int4-g128-asym": Scheme(F.UINT4, group(128), symmetric=False, scale_dtype="bf16"),
    "int4-g64": Scheme(F.INT4, group(64), scale_dtype="bf16", full_range=True),
    "int4-g64-asym": Scheme(F.UINT4, group(64), symmetric=False, scale_dtype="bf16"),
    "int4-g32": Scheme(F.INT4, group(32), scale_dtype="bf16", full_range=True),
    "int2-g64": Scheme(F.INT2, group(64), scale_dtype="bf16", full_range=True),  # levels −2…1, amax → 1.5
    # the block's extreme on the most negative level (llama.cpp Q4_0's and AutoRound's rule): step amax / 8
    "int4-g128-signed": Scheme(F.INT4, group(128), scale_dtype="bf16", signed_scale=True),
    "int4-g64-signed": Scheme(F.INT4, group(64), scale_dtype="bf16", signed_scale=True),
    "int4-g32-signed": Scheme(F.INT4, group(32), scale_dtype="bf16", signed_scale=True),
    "int2-g64-signed": Scheme(F.INT2, group(64), scale_dtype="bf16", signed_scale=True),
    "mxfp4": Scheme(F.FP4_E2M1, group(32), scale_dtype="e8m0", dynamic=True, mx_nearest=True),
    "mxfp6": Scheme(F.FP6_E2M3, group(32), scale_dtype="e8m0", dynamic=True),
    "mxfp8": Scheme(F.FP8_E4M3, group(32), scale_dtype="e8m0", dynamic=True, mx_nearest=True),
    "nvfp4": Scheme(F.FP4_E2M1, group(16), scale_dtype="fp8_e4m3", global_scale=True, dynamic=True),
    # GGUF (llama.cpp) element types, `lowbit quantize --format gguf`
    **{f"gguf-{t.name}": Scheme(F.FORMATS[t.format_name], group(t.block), symmetric=not t.has_min,
                                scale_dtype="fp16", ggml=t.name) for t in G.GGML_TYPES.values()},
    # activations (the scale comes from each token / group at run time)
    "fp8-token": Scheme(F.FP8_E4M3, TOKEN, dynamic=True),
    "fp8-group128": Scheme(F.FP8_E4M3, group(128), dynamic=True),
    "int8-token": Scheme(F.INT8, TOKEN, dynamic=True),
    "int4-token": Scheme(F.INT4, TOKEN, dynamic=True),
}


def get_scheme(name: str) -> Scheme:
    """A preset by name, with an error that lists the presets."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown scheme {name!r}; presets are: {', '.join(PRESETS)}") from None


def _format(v, where: str) -> F.Format:
    if not isinstance(v, str) or v not in F.FORMATS:
        raise ValueError(f"{where}: unknown format {v!r}; known: {', '.join(F.FORMATS)}")
    return F.FORMATS[v]


def _granularity(v, where: str) -> Granularity:
    try:
        return parse_granularity(str(v))
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def scheme_from_dict(d: dict | str, where: str = "scheme") -> Scheme:
    """A scheme from a preset name or a mapping with the keys of :meth:`Scheme.to_dict`
    (parsed field by field, :func:`lowbit.util.validate.from_mapping`).

    ``where`` names the place in a config file for error messages.
    """
    if isinstance(d, str):
        try:
            return get_scheme(d)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{where}: expected a preset name or a mapping, got {type(d).__name__}")
    return from_mapping(Scheme, d, where, parsers={"format": _format, "granularity": _granularity},
                        required=("format", "granularity"))


# -- sizes ---------------------------------------------------------------------------

#: the matrix used when no shape is given: large enough that per-tensor overheads vanish
DEFAULT_SHAPE = (4096, 4096)


def bits_per_element(scheme: Scheme, shape: tuple[int, ...] = DEFAULT_SHAPE) -> float:
    """Storage bits per element of a tensor of ``shape``, scales and zero points included.

    ``element bits + (scale bits + zero bits) · blocks / elements + 32 / elements`` for
    a global scale.  Examples: NVFP4 ≈ 4.5, MXFP4 = 4.25, INT4 group 128 with a 16-bit
    scale = 4.125; INT4 group 64 with an fp16 scale and an int4 zero point = 4.3125.
    This is the one source of truth for sizes in lowbit (memory planning uses it too).
    """
    numel = math.prod(shape)
    if numel == 0:
        raise ValueError(f"bits_per_element: empty shape {shape}")
    if scheme.ggml:
        return scheme.ggml_type.bits_per_element
    nr, nc = scheme.granularity.scale_shape(tuple(shape))
    per_block = SCALE_DTYPES[scheme.scale_dtype] + (0 if scheme.symmetric else scheme.format.bits)
    total = numel * scheme.format.bits + nr * nc * per_block + (32 if scheme.global_scale else 0)
    return total / numel
