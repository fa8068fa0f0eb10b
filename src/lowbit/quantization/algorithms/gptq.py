"""GPTQ: one-shot weight quantization with second-order error feedback.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers" (ICLR 2023), Algorithm 1.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

from ...numerics import ggml as G
from ...numerics.qtensor import QParams, QTensor, _check_finite, _effective_scale, compute_qparams
from ...numerics.scheme import Scheme
from ...util.parallel import torch_threads

__all__ = ["gptq", "QParamsFn"]

#: ``qparams_fn(w_cols, columns, global_scale) -> QParams``: scales of whole column groups.
#: ``w_cols`` is ``(out, width)`` in storage order — one group, or with static groups the
#: whole weight — ``columns`` the storage indices of its columns (to slice a
#: per-input-channel importance), ``global_scale`` the tensor's global scale or ``None``.
#: The returned scale has shape ``(R, groups in w_cols)``, blocks laid out as the scheme's
#: granularity lays them out on ``w_cols``.
QParamsFn = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], QParams]

_KINDS = ("tensor", "channel", "group", "block")


def gptq(
    w: torch.Tensor,
    hessian: torch.Tensor,
    scheme: Scheme,
    *,
    block_size: int = 128,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = False,
    qparams_fn: QParamsFn | None = None,
    global_scale: torch.Tensor | None = None,
    rounding_inputs: bool = False,
) -> QTensor | tuple[QTensor, torch.Tensor]:
    """GPTQ (Frantar et al., ICLR 2023), Algorithm 1: quantize ``w`` column by column,
    spreading each column's rounding error over the columns not yet quantized so that
    ``‖(W − Ŵ) Xᵀ‖²`` stays small, with lazy batch updates and the Cholesky form of H⁻¹.

    For column ``q`` in order, with ``U = chol(H⁻¹)ᵀ`` (upper)::

        Ŵ[:, q]   = quant(W[:, q])
        E[:, q]   = (W[:, q] − Ŵ[:, q]) / U[q, q]
        W[:, q:] -= E[:, q] · U[q, q:]            (eq. 4 / Alg. 1, inside a block of B columns)
        W[:, B':] -= E[:, B] · U[B, B':]          (lazy batch update after each block)

    Args:
        w: ``(out, in)`` weight of a Linear.
        hessian: ``(in, in)`` ``2·XᵀX/n`` of the layer's inputs (any positive multiple:
            the result does not change, dampening is relative).  Inputs that never fire
            (``H_ii = 0``) get ``W[:, i] = 0`` and ``H_ii = 1``, as in the reference.
        scheme: any weight scheme with tensor, channel, group or block granularity.
        block_size: columns per lazy batch (B in the paper).
        damp: ``λ = damp · mean(diag H)`` is added to the diagonal.  If the (damped) H
            is not positive definite (float32), λ becomes ``0.01·mean(diag H)`` (the
            reference's default) and grows tenfold until it is, with a warning.
        act_order: quantize columns in order of decreasing ``H_ii`` (the "act-order"
            heuristic of the reference implementation).
        static_groups: compute every group's scale up front from the original ``w`` (one
            ``qparams_fn`` call over the whole weight).
            Otherwise a group's scale is computed when GPTQ reaches its first column,
            from the weights as updated so far (as the reference does).  Either way,
            groups are contiguous in *storage* order, so with ``act_order`` the result
            is still an ordinary group-quantized tensor (no ``g_idx``).
        qparams_fn: how a column group's scales are chosen (see :data:`QParamsFn`);
            default min-max (:func:`lowbit.numerics.qtensor.compute_qparams`).
        global_scale: for a scheme with a global scale, use this one (e.g. shared by
            fused siblings) instead of computing it from ``w``.
        rounding_inputs: also return the ``(out, in)`` weights each column had when it was
            rounded (the original column plus the error fed back to it): rounding them to
            nearest at the returned scales gives the returned codes.  Learned rounding
            (:func:`~lowbit.quantization.algorithms.optimize_rounding`) starts from them.

    Returns:
        The :class:`QTensor` in storage (original column) order; ``dequantize`` of it is
        the GPTQ weight.  With ``H = I`` it equals ``quantize(w, scheme)`` exactly.
        For a scheme with a global scale (NVFP4), the global scale comes from the whole
        ``w`` first.

    Cost: ``O(in³)`` for one Cholesky factorization and one triangular inverse, ``O(out · in²)`` flops for the
    updates (most of it in the lazy-batch GEMMs), and ``O(in)`` small vector operations
    (one column quantization and one rank-1 update per column).  Measured on 2 shared
    CPU cores, float32, int4 group 64: 1536×576 (576² Hessian) 0.3–0.6 s, 576×1536
    (1536² Hessian) 0.7–0.8 s; NVFP4 with act-order up to ~2 s.
    """
    if w.dim() != 2:
        raise ValueError(f"gptq: expected a 2-D (out, in) weight, got shape {tuple(w.shape)}")
    rows, cols = w.shape
    if tuple(hessian.shape) != (cols, cols):
        raise ValueError(f"gptq: hessian must be ({cols}, {cols}) for a weight of shape {tuple(w.shape)}, got {tuple(hessian.shape)}")
    gran = scheme.granularity
    if gran.kind not in _KINDS:
        raise ValueError(f"gptq: granularity {gran} is not a weight granularity; expected one of {_KINDS}")
    if block_size < 1:
        raise ValueError(f"gptq: block_size must be positive, got {block_size}")
    _check_finite(w, "gptq weight")
    _check_finite(hessian, "gptq hessian")

    W = w.detach().to(torch.float32).clone()                     # (out, in)
    H = hessian.detach().to(torch.float32).clone()               # (in, in)
    dead = H.diagonal() == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    fmt = scheme.format
    br, gc = gran.block_shape(rows, cols)
    br, gc = min(br, rows), min(gc, cols)                        # scale block: br rows × gc cols
    n_groups = math.ceil(cols / gc)
    if not scheme.global_scale:
        global_scale = None
    elif global_scale is None:
        global_scale = compute_qparams(W, scheme).global_scale
    observe = qparams_fn or (lambda wg, _cols, g: compute_qparams(wg, scheme, g))
    # GGUF k-quants: scales are observed a whole super-block at a time (their sub-block scales are
    # quantized against it), each column then rounds on its sub-block's stored two-level grid
    t = scheme.ggml_type
    per = t.super_block // t.block if t is not None else 1
    if t is not None and cols % (gc * per):
        raise ValueError(f"gptq: {cols} columns are not a whole number of {gc * per}-column scale groups")
    ow = gc * per                                                # columns per observation

    def group_columns(o: int) -> torch.Tensor:                   # storage indices of observation o
        return torch.arange(o * ow, min((o + 1) * ow, cols), device=W.device)

    qps: list[QParams | None] = [None] * (n_groups // per if t is not None else n_groups)
    if static_groups:                                            # one observer call for every group
        qps = _split_groups(observe(W, torch.arange(cols, device=W.device), global_scale), len(qps), per)

    perm = (torch.argsort(H.diagonal(), descending=True, stable=True) if act_order
            else torch.arange(cols, device=W.device))
    inv_perm = torch.argsort(perm)
    # columns become rows: every column GPTQ visits is then one contiguous vector
    Wt = W[:, perm].T.contiguous()                               # (in, out), permuted order
    H = H[perm][:, perm]
    group_of = (perm // gc).tolist()                             # storage group of each position
    U = _upper_cholesky_of_inverse(H, damp)                      # (in, in), H⁻¹ = Uᵀ U

    Qt = torch.empty_like(Wt)                                    # (in, out) element values (with zero)
    Pt = torch.empty_like(Wt) if rounding_inputs else None       # (in, out) the columns as rounded
    col_scale: list[tuple | None] = [None] * n_groups            # per group: _per_row's (s, safe, z)
    # `in` rounds of small vector ops: with several intra-op threads each one pays a synchronisation,
    # 5–10× when the cores are shared with other work (measured: 576×1536, 2 busy cores, 2.0 s → 0.4 s)
    with torch_threads(1):
        for i1 in range(0, cols, block_size):
            i2 = min(i1 + block_size, cols)
            W1 = Wt[i1:i2].clone()                                   # (B, out)
            E1 = torch.empty_like(W1)                                # (B, out)
            U1 = U[i1:i2, i1:i2]                                     # (B, B)
            d = U1.diagonal().tolist()
            for i in range(i2 - i1):
                g = group_of[i1 + i]
                if col_scale[g] is None:
                    o = g // per
                    if qps[o] is None:
                        c = group_columns(o)
                        current = _current_columns(inv_perm[c], Wt, W1, E1, U, i1, i)  # (out, width)
                        qps[o] = observe(current, c, global_scale)
                    col_scale[g] = _per_row(qps[o], br, rows, g % per)
                s, safe, z = col_scale[g]
                w_col = W1[i]                                        # (out,)
                q, w_hat = _round_column(w_col, s, safe, z, fmt, t)
                Qt[i1 + i] = q
                if Pt is not None:
                    Pt[i1 + i] = w_col
                err = E1[i]
                torch.sub(w_col, w_hat, out=err).div_(d[i])          # (out,)
                if i + 1 < i2 - i1:
                    W1[i + 1:].addr_(U1[i, i + 1:], err, alpha=-1.0)  # rank-1 update of the block
            if i2 < cols:
                Wt[i2:].addmm_(U[i1:i2, i2:].T, E1, alpha=-1.0)      # lazy batch update

    Qv = Qt.T[:, inv_perm]                                       # (out, in), storage order
    scale = torch.cat([qp.scale for qp in qps], dim=1)          # (R, n_groups)
    zero = None if scheme.symmetric else torch.cat([qp.zero for qp in qps], dim=1)
    supers = [None if getattr(qps[0], f) is None else torch.cat([getattr(qp, f) for qp in qps], dim=1)
              for f in ("super_scale", "super_min")]                # GGUF k-quants' (R, super-blocks)
    codes = fmt.encode(Qv).reshape(w.shape)
    qt = QTensor(codes, scale, zero, global_scale, scheme, *supers)
    return (qt, Pt.T[:, inv_perm].contiguous()) if Pt is not None else qt


def _split_groups(qp: QParams, n_obs: int, per: int = 1) -> list[QParams]:
    """The ``(R, n_obs · per)`` scales of a whole tensor as one ``(R, per)`` QParams per
    observation (a group; for GGUF k-quants a super-block of ``per`` sub-blocks)."""
    if qp.scale.shape[1] != n_obs * per:
        raise ValueError(f"gptq: the observer returned {qp.scale.shape[1]} column groups, expected {n_obs * per}")

    def parts(x, width):
        return [None] * n_obs if x is None else list(x.split(width, dim=1))

    return [QParams(s, z, qp.global_scale, ss, sm) for s, z, ss, sm in
            zip(parts(qp.scale, per), parts(qp.zero, per), parts(qp.super_scale, 1), parts(qp.super_min, 1))]




def _upper_cholesky_of_inverse(H: torch.Tensor, damp: float) -> torch.Tensor:
    """``U`` upper triangular with ``(H + λI)⁻¹ = Uᵀ U``; λ grows until it exists.

    The reference factors three times (chol, chol_inverse, chol).  One factorization
    does: with ``J`` the reversal permutation and ``J H J = L Lᵀ``, ``U = J L⁻¹ J`` is
    upper triangular and ``Uᵀ U = J L⁻ᵀ L⁻¹ J = H⁻¹``; being the Cholesky factor is
    unique (positive diagonal), so it is the same ``U``.  (``torch.cholesky_inverse`` is
    also ~20× slower on CPU than the triangular solve.)
    """
    n = H.shape[0]
    mean_diag = float(H.diagonal().mean())
    lam = damp * mean_diag
    eye = torch.eye(n, dtype=H.dtype, device=H.device)
    for attempt in range(12):
        Hd = H.flip(0, 1)                                        # J H J
        Hd.diagonal().add_(lam)
        L, info = torch.linalg.cholesky_ex(Hd)
        if info == 0:
            U = torch.linalg.solve_triangular(L, eye, upper=False).flip(0, 1)
            if torch.isfinite(U).all():
                if attempt:
                    warnings.warn(
                        f"gptq: the Hessian is not positive definite with damp={damp}; "
                        f"used dampening {lam / mean_diag:.3g}·mean(diag H)",
                        stacklevel=3,
                    )
                return U
        lam = max(lam * 10, 0.01 * mean_diag)  # from the reference's default upwards
    raise ValueError("gptq: the Hessian could not be made positive definite (is it finite and symmetric?)")


def _current_columns(
    positions: torch.Tensor, Wt: torch.Tensor, W1: torch.Tensor, E1: torch.Tensor, U: torch.Tensor, i1: int, i: int
) -> torch.Tensor:
    """The current (updated) values of the not-yet-quantized columns at ``positions``
    (permuted order, all ``≥ i1 + i``), as ``(out, width)``: inside the block they are
    rows of ``W1``; beyond it ``Wt`` still lacks this block's pending update
    ``U[i1:i1+i, p]ᵀ · E1[:i]``.  (``Wt``, ``W1``, ``E1`` hold columns as rows.)"""
    i2 = i1 + W1.shape[0]
    out = torch.empty(len(positions), Wt.shape[1], dtype=Wt.dtype, device=Wt.device)  # (width, out)
    inside = positions < i2
    out[inside] = W1[positions[inside] - i1]
    beyond = positions[~inside]
    if len(beyond):
        out[~inside] = Wt[beyond] - U[i1:i1 + i, beyond].T @ E1[:i]
    return out.T

def _per_row(qp: QParams, br: int, rows: int, k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Column ``k`` of an observation's ``(R, ·)`` effective scale and zero expanded to one
    entry per row: ``(s, safe, z)`` with ``safe`` the divisor :func:`_round_column` uses
    (``inf`` where ``s`` is 0, so that such rows round to zero — GGUF and ``signed_scale``
    scales may be negative), formed once per group."""
    s = _effective_scale(qp)[:, k].repeat_interleave(br)[:rows]  # (out,)
    safe = torch.where(s != 0, s, torch.full_like(s, float("inf")))
    z = None if qp.zero is None else qp.zero[:, k].repeat_interleave(br)[:rows]
    return s, safe, z


def _round_column(
    w: torch.Tensor, s: torch.Tensor, safe: torch.Tensor, z: torch.Tensor | None, fmt, ggml: G.GGMLType | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Element values ``q`` and dequantized ``(q − z)·s`` of one column, with exactly the
    arithmetic of :func:`lowbit.numerics.qtensor.fake_quantize` (so that ``H = I`` gives RTN bit
    for bit).  A zero scale (``safe = inf``) sends the column to zero.  GGUF types
    (``ggml``, the type): ``q`` the element value nearest ``(w + z) / s`` on the type's grid
    (iq4_nl: its table, :func:`lowbit.numerics.ggml.round_values`), ``q·s − z``."""
    if ggml is not None:
        q = G.round_values((w if z is None else w + z) / safe, ggml)
        return q, (q * s if z is None else q * s - z)
    x = w / safe
    if z is not None:
        x += z
    q = fmt.round(x)
    w_hat = (q - z) * s if z is not None else q * s
    return q, w_hat
