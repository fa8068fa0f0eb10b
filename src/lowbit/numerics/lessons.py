"""The numbers behind ``lowbit formats``: format facts and the outliers-and-granularity lesson."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from . import formats as F
from .qtensor import fake_quantize, sqnr
from .scheme import PRESETS, bits_per_element

__all__ = ["FormatFacts", "format_facts", "synthetic_weight", "SchemeError", "scheme_errors", "WEIGHT_PRESETS"]


@dataclass(frozen=True)
class FormatFacts:
    name: str
    bits: int
    layout: str  # e.g. "s1 e4 m3", "int (two's complement)"
    max: float
    min_normal: float
    min_subnormal: float
    step_near_one: float
    grid: tuple[float, ...] | None  # every non-negative value, for formats of ≤ 4 bits
    specials: str

    def to_dict(self) -> dict:
        return asdict(self)


def _layout(f: F.Format) -> str:
    if f.kind == "float":
        return f"s1e{f.exponent_bits}m{f.mantissa_bits}"
    if f.kind == "e8m0":
        return "e8 (2^k)"
    return "2's compl." if f.signed else "unsigned"


def _specials(f: F.Format) -> str:
    nan = len(f.nan_codes)
    if f.has_inf:
        return f"±inf, {nan} NaN"
    if nan:
        return f"NaN {','.join(f'{c:02X}' for c in f.nan_codes)}"
    return "none"


def format_facts() -> list[FormatFacts]:
    """One row per format of :data:`lowbit.numerics.formats.FORMATS`."""
    rows = []
    for f in F.FORMATS.values():
        sub = f.min_positive if (f.kind == "float" and f.min_positive < f.min_normal) else float("nan")
        grid = tuple(v for v in f.finite if v >= 0) if f.bits <= 4 else None
        rows.append(
            FormatFacts(f.name, f.bits, _layout(f), f.max, f.min_normal, sub, f.step_near_one(), grid, _specials(f))
        )
    return rows


def synthetic_weight(rows: int = 1024, cols: int = 4096, seed: int = 0) -> torch.Tensor:
    """A weight matrix shaped like real LLM weights: bell-shaped (Student-t, 5 degrees of
    freedom) values, rows whose scales differ by ~10× (log-normal), and 0.05% of entries
    replaced by outliers 10–30× the row's typical size."""
    if rows < 1 or cols < 1:
        raise ValueError(f"synthetic weight needs rows and cols >= 1, got {rows}x{cols}")
    g = torch.Generator().manual_seed(seed)
    base = _student_t(rows, cols, 5, g)
    row_scale = torch.exp(torch.randn(rows, 1, generator=g) * 0.8) * 0.02
    w = base * row_scale
    n_out = max(1, rows * cols // 2000)
    idx = torch.randint(0, rows * cols, (n_out,), generator=g)
    mag = 10 + 20 * torch.rand(n_out, generator=g)
    sign = torch.where(torch.rand(n_out, generator=g) < 0.5, -1.0, 1.0)
    flat = w.view(-1)
    flat[idx] = sign * mag * row_scale.view(-1)[idx // cols]
    return w


def _student_t(rows: int, cols: int, df: int, g: torch.Generator) -> torch.Tensor:
    """Student-t samples as z / sqrt(χ²_df / df), the χ² drawn as a sum of squared
    normals so that one seeded generator drives everything."""
    z = torch.randn(rows, cols, generator=g)
    chi2 = torch.randn(rows, cols, df, generator=g).pow(2).sum(-1)
    return z / torch.sqrt(chi2 / df)


#: presets that describe weights (the activation ones are per-token)
WEIGHT_PRESETS = [n for n, s in PRESETS.items() if s.granularity.kind != "token"]


@dataclass(frozen=True)
class SchemeError:
    scheme: str
    format: str
    granularity: str
    bits_per_element: float
    rel_error: float  # ‖W − Q(W)‖ / ‖W‖
    sqnr_db: float

    def to_dict(self) -> dict:
        return asdict(self)


def scheme_errors(w: torch.Tensor, names: list[str] | None = None) -> list[SchemeError]:
    """Quantize ``w`` with each preset in ``names`` (default: every weight preset, the GGUF types whose
    blocks divide ``w``'s rows)."""
    out = []
    for name in names or WEIGHT_PRESETS:
        s = PRESETS[name]
        if names is None and s.ggml and w.shape[-1] % s.ggml_type.super_block:
            continue  # a GGUF type whose blocks do not divide these rows (asked for by name, it raises)
        q = fake_quantize(w, s)
        rel = float(torch.linalg.vector_norm(w - q) / torch.linalg.vector_norm(w))
        out.append(
            SchemeError(name, s.format.name, str(s.granularity), bits_per_element(s, tuple(w.shape)), rel, sqnr(w, q))
        )
    return out
