import pytest
import torch

from lowbit.quantization.algorithms.rotation import hadamard, random_hadamard, rotate_weight_in, rotate_weight_out
from lowbit.numerics.qtensor import fake_quantize
from lowbit.numerics.scheme import PRESETS


def _orthonormal_error(q):
    q = q.double()
    return float((q @ q.T - torch.eye(q.shape[0], dtype=torch.float64)).abs().max())


# powers of two, each Paley construction, and the sizes of SmolLM2 (576, 1536) and Gemma-3 (640, 2048, 64, 256)
@pytest.mark.parametrize("n", [1, 2, 4, 12, 20, 28, 36, 44, 64, 256, 576, 640, 1536, 2048])
def test_hadamard_is_orthonormal_with_equal_magnitudes(n):
    h = hadamard(n)
    assert h.shape == (n, n) and h.dtype == torch.float32
    assert torch.all((h.abs() * n**0.5 - 1).abs() < 1e-6)  # every entry ±1/√n
    assert _orthonormal_error(h) < 1e-5


@pytest.mark.parametrize("n", [3, 6, 10, 0])
def test_hadamard_without_construction_is_a_clear_error(n):
    with pytest.raises(ValueError, match="random_hadamard|positive"):
        hadamard(n)


def test_random_hadamard_is_seeded_and_orthonormal():
    a, b, c = random_hadamard(576, seed=1), random_hadamard(576, seed=1), random_hadamard(576, seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert _orthonormal_error(a) < 1e-5
    assert torch.all((a.abs() * 576**0.5 - 1).abs() < 1e-6)


def test_random_orthogonal_fallback_warns():
    with pytest.warns(UserWarning, match="random orthogonal"):
        q = random_hadamard(6, seed=0)
    assert _orthonormal_error(q) < 1e-6
    assert not torch.allclose(q.abs(), torch.full((6, 6), 6**-0.5))


def test_rotations_are_exact():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 64, generator=g, dtype=torch.float64)
    w, b = torch.randn(12, 64, generator=g, dtype=torch.float64), torch.randn(12, generator=g, dtype=torch.float64)
    q_in, q_out = random_hadamard(64, seed=3).double(), random_hadamard(12, seed=4).double()
    torch.testing.assert_close((x @ q_in) @ rotate_weight_in(w, q_in).T, x @ w.T)
    torch.testing.assert_close(x @ rotate_weight_out(w, q_out).T + rotate_weight_out(b, q_out), (x @ w.T + b) @ q_out)
    # a rotated residual stream: an output rotation followed by an input rotation cancels
    w2 = torch.randn(7, 12, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        (x @ rotate_weight_out(w, q_out).T) @ rotate_weight_in(w2, q_out).T, (x @ w.T) @ w2.T
    )
    assert rotate_weight_in(w.float(), q_in).dtype == torch.float32
    with pytest.raises(ValueError, match="Q must be"):
        rotate_weight_in(w, q_out)


def _kurtosis(x):
    x = x.flatten().double()
    x = x - x.mean()
    return float(x.pow(4).mean() / x.pow(2).mean() ** 2)


def test_rotation_spreads_outlier_channels():
    """QuaRot's premise: outlier channels dominate a token's absmax; after a random
    Hadamard the values are near-Gaussian and 4-bit per-token quantization works."""
    g = torch.Generator().manual_seed(0)
    n = 576
    x = torch.randn(32, n, generator=g)
    x[:, [5, 100, 333]] *= 60
    q = random_hadamard(n, seed=0)
    xr = x @ q
    assert _kurtosis(x) > 50 and _kurtosis(xr) < 4
    peak = lambda a: float((a.abs().amax(1) / a.abs().mean(1)).mean())  # noqa: E731
    assert peak(xr) < peak(x) / 5
    a4 = PRESETS["int4-token"]
    err = lambda a: float((fake_quantize(a, a4) - a).pow(2).sum())  # noqa: E731
    assert err(xr) < err(x) / 3  # rotation is orthogonal: the errors are in the same units
