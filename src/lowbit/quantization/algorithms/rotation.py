"""Orthogonal rotations that spread activation outliers over all channels.

Ashkboos et al., "QuaRot: Outlier-Free 4-Bit Inference in Rotated LLMs" (NeurIPS 2024),
§3–§4; Liu et al., "SpinQuant: LLM Quantization with Learned Rotations" (ICLR 2025), §3.
A rotation ``Q`` (``QQᵀ = I``) applied to a layer's input and folded into its weight
leaves the product unchanged: ``(xQ)(WQ)ᵀ = x Wᵀ``.  A random Hadamard matrix mixes
every channel into every other with equal weight, so a few huge channels become many
moderate ones, which 4-bit activations can represent.
"""

from __future__ import annotations

import math
import warnings
from functools import lru_cache

import torch

__all__ = ["hadamard", "random_hadamard", "rotate_weight_in", "rotate_weight_out"]


def hadamard(n: int) -> torch.Tensor:
    """An orthonormal Hadamard matrix ``H/√n`` (entries ``±1/√n``, ``HHᵀ = I``), float32.

    Built as a Kronecker product (Sylvester, "Thoughts on inverse orthogonal
    matrices…", 1867) of ``H_{2^k}`` and one Paley matrix (Paley, "On orthogonal
    matrices", J. Math. Phys. 1933): construction I gives order ``q + 1`` for a prime
    ``q ≡ 3 (mod 4)`` (12, 20, 24, 32, 44, 48, …), construction II order ``2(q + 1)`` for
    a prime ``q ≡ 1 (mod 4)`` (28, 36, 60, …).  Covers every power of two and e.g.
    576 = 36·16, 640 = 20·32, 1536 = 12·128, 768 = 12·64, 3072 = 12·256.

    Raises:
        ValueError: no such construction for ``n`` (then use :func:`random_hadamard`,
            which falls back to a random orthogonal matrix).
    """
    return _hadamard_pm1(n).to(torch.float32) / math.sqrt(n)


def random_hadamard(n: int, seed: int = 0) -> torch.Tensor:
    """QuaRot (Ashkboos et al., 2024), §4: the randomised Hadamard ``Q = diag(d) · H/√n``
    with ``d`` uniform random signs, so ``xQ`` flips signs then mixes channels.  ``(n, n)``
    float32, orthonormal, reproducible from ``seed``.

    For an ``n`` without a Hadamard construction (see :func:`hadamard`) this falls back,
    with a warning, to a Haar-random orthogonal matrix (QR of a Gaussian matrix with the
    signs of ``R``'s diagonal fixed): also exact, but it spreads outliers less evenly and
    cannot be applied with a fast transform.
    """
    g = torch.Generator().manual_seed(seed)
    try:
        h = hadamard(n)
    except ValueError:
        warnings.warn(f"random_hadamard: no Hadamard matrix of order {n}; using a random orthogonal matrix", stacklevel=2)
        a = torch.randn(n, n, generator=g, dtype=torch.float64)
        q, r = torch.linalg.qr(a)
        return (q * torch.sign(torch.diagonal(r))[None, :]).to(torch.float32)
    d = torch.randint(0, 2, (n,), generator=g).to(torch.float32).mul_(2).sub_(1)  # (n,) ±1
    return d[:, None] * h


def rotate_weight_in(w: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """QuaRot §4 (eq. for a linear ``y = x Wᵀ`` whose input is rotated ``x → xQ``):
    ``W' = W Q`` so that ``(xQ) W'ᵀ = x Q Qᵀ Wᵀ = x Wᵀ``.

    ``w`` is ``(out, in)`` with ``Q`` ``(in, in)``.  An embedding table ``(vocab, hidden)``
    holds residual-stream rows and rotates the same way.  Computed in float64, returned
    in ``w``'s dtype.
    """
    _check(w, Q, w.shape[-1], "rotate_weight_in")
    return (w.detach().to(torch.float64) @ Q.to(torch.float64)).to(w.dtype)       # (out, in)


def rotate_weight_out(w: torch.Tensor, Q: torch.Tensor) -> torch.Tensor:
    """QuaRot §4, for a linear whose *output* is rotated ``y → yQ``: ``W' = Qᵀ W`` (and a
    bias ``b' = bQ``), so that ``x W'ᵀ + b' = (x Wᵀ + b) Q``.

    ``w`` is ``(out, in)`` with ``Q`` ``(out, out)``, or a ``(out,)`` bias.  Computed in
    float64, returned in ``w``'s dtype.
    """
    _check(w, Q, w.shape[0], "rotate_weight_out")
    Q64 = Q.to(torch.float64)
    w64 = w.detach().to(torch.float64)
    return (w64 @ Q64 if w.dim() == 1 else Q64.T @ w64).to(w.dtype)              # (out, in) or (out,)


def _check(w: torch.Tensor, Q: torch.Tensor, n: int, what: str) -> None:
    if Q.dim() != 2 or Q.shape != (n, n):
        raise ValueError(f"{what}: Q must be ({n}, {n}) for a weight of shape {tuple(w.shape)}, got {tuple(Q.shape)}")


# -- constructions -------------------------------------------------------------------


@lru_cache(maxsize=32)
def _hadamard_pm1(n: int) -> torch.Tensor:
    """The ±1 Hadamard matrix of order ``n`` (int8), or ValueError."""
    if n < 1:
        raise ValueError(f"hadamard: order must be positive, got {n}")
    for b in _paley_orders_dividing(n):
        rest = n // b
        if rest & (rest - 1) == 0:
            h = _sylvester(rest)
            return torch.kron(h, _paley(b)) if b > 1 else h
    raise ValueError(
        f"hadamard: no Hadamard matrix of order {n} from Sylvester × Paley constructions "
        "(orders are 1, 2 or multiples of 4 of the form 2^k·(q+1), q prime ≡ 3 mod 4, or 2^k·2(q+1), q prime ≡ 1 mod 4); "
        "use random_hadamard for a random orthogonal matrix instead"
    )


def _paley_orders_dividing(n: int) -> list[int]:
    """Orders ``b`` dividing ``n`` with a Paley construction, smallest first; 1 first."""
    out = [1]
    for b in range(4, n + 1, 4):
        if n % b == 0 and _paley_prime(b) is not None:
            out.append(b)
    return out


def _paley_prime(b: int) -> tuple[int, int] | None:
    """``(q, construction)`` for a Paley matrix of order ``b``, or ``None``."""
    q = b - 1
    if q % 4 == 3 and _is_prime(q):
        return q, 1
    if b % 2 == 0:
        q = b // 2 - 1
        if q % 4 == 1 and _is_prime(q):
            return q, 2
    return None


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, math.isqrt(q) + 1))


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.int8)
    h2 = torch.tensor([[1, 1], [1, -1]], dtype=torch.int8)
    while h.shape[0] < n:
        h = torch.kron(h, h2)
    return h


def _paley(b: int) -> torch.Tensor:
    """Paley construction I (order q+1, q ≡ 3 mod 4) or II (order 2(q+1), q ≡ 1 mod 4)."""
    q, kind = _paley_prime(b)
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if a in residues else -1 for a in range(1, q)], dtype=torch.int64)
    idx = torch.arange(q)
    jac = chi[(idx[:, None] - idx[None, :]) % q]                             # (q, q) Jacobsthal
    if kind == 1:                                                            # jac is skew: H = I + S
        s = torch.zeros(q + 1, q + 1, dtype=torch.int64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = 1, -1, jac
        return (s + torch.eye(q + 1, dtype=torch.int64)).to(torch.int8)
    c = torch.zeros(q + 1, q + 1, dtype=torch.int64)                         # jac is symmetric
    c[0, 1:], c[1:, 0], c[1:, 1:] = 1, 1, jac
    one = torch.tensor([[1, 1], [1, -1]])
    zero = torch.tensor([[1, -1], [-1, -1]])
    return (torch.kron(c, one) + torch.kron((c == 0).to(torch.int64), zero)).to(torch.int8)
