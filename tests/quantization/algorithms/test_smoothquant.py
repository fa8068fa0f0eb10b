import pytest
import torch

from lowbit.quantization.algorithms.smoothquant import smooth, smoothquant_scales
from lowbit.numerics.qtensor import fake_quantize
from lowbit.numerics.scheme import PRESETS


def test_reference_worked_example():
    # docs/references.md §1: α = 0.5, max|X_j| = 100, max|W_j| = 0.01 → s = 100, both new maxima 1
    w = torch.tensor([[0.01, 0.5], [-0.005, 0.5]])
    s = smoothquant_scales(torch.tensor([100.0, 1.0]), [w], alpha=0.5)
    assert s[0].item() == pytest.approx(100.0, rel=1e-6)
    assert (100.0 / s[0]).item() == pytest.approx(1.0, rel=1e-6)
    assert (w[:, 0].abs().max() * s[0]).item() == pytest.approx(1.0, rel=1e-6)
    assert s[1].item() == pytest.approx((1.0 / 0.5) ** 0.5, rel=1e-6)


def test_weight_max_is_shared_across_linears():
    a = torch.tensor([[0.1, 1.0]])
    b = torch.tensor([[0.4, 0.2]])
    s = smoothquant_scales(torch.tensor([4.0, 4.0]), [a, b], alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([2.0 / 0.4**0.5, 2.0 / 1.0]))


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_alpha_extremes(alpha):
    x_max, w = torch.tensor([3.0, 50.0]), torch.tensor([[0.2, 0.1]])
    s = smoothquant_scales(x_max, [w], alpha=alpha)
    torch.testing.assert_close(s, x_max if alpha == 1 else 1 / w[0])


def test_dead_channels_give_finite_scales_and_bad_args_are_refused():
    s = smoothquant_scales(torch.tensor([0.0, 2.0]), [torch.tensor([[0.0, 1.0]])])
    assert torch.isfinite(s).all() and (s > 0).all()
    with pytest.raises(ValueError, match="alpha"):
        smoothquant_scales(torch.ones(2), [torch.ones(1, 2)], alpha=1.5)
    with pytest.raises(ValueError, match="expected"):
        smoothquant_scales(torch.ones(3), [torch.ones(1, 2)])
    with pytest.raises(ValueError, match="positive"):
        smooth(torch.ones(2), None, [torch.ones(1, 2)], torch.tensor([1.0, 0.0]))


def _rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _setup(seed=0, n=64, d=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    x[:, 3] *= 40  # an outlier channel, as in LLM activations
    norm_w = torch.rand(d, generator=g) + 0.5
    nexts = [torch.randn(48, d, generator=g) * 0.1, torch.randn(16, d, generator=g) * 0.1]
    return x, norm_w, nexts


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_then_linears_unchanged(offset):
    x, norm_w, nexts = _setup()
    norm_w = norm_w - offset  # Gemma stores w with output x̂·(1 + w)
    act = _rms(x) * (offset + norm_w)
    s = smoothquant_scales(act.abs().amax(0), nexts, alpha=0.5)
    new_norm, new_bias, new_nexts = smooth(norm_w, None, nexts, s, norm_offset=offset)
    assert new_bias is None
    act_s = _rms(x) * (offset + new_norm)
    for w, w2 in zip(nexts, new_nexts):
        torch.testing.assert_close(act_s @ w2.T, act @ w.T, rtol=1e-5, atol=1e-5)
    # and the smoothed activation is flatter across channels
    spread = lambda a: (a.abs().amax(0).max() / a.abs().amax(0).median()).item()  # noqa: E731
    assert spread(act_s) < spread(act) / 2


def test_linear_then_linear_unchanged_with_bias():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20, 12, generator=g)
    v, bv = torch.randn(8, 12, generator=g), torch.randn(8, generator=g)
    o = torch.randn(5, 8, generator=g)
    s = torch.rand(8, generator=g) * 10 + 0.1
    v2, bv2, (o2,) = smooth(v, bv, [o], s)
    torch.testing.assert_close((x @ v2.T + bv2) @ o2.T, (x @ v.T + bv) @ o.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(v2, v)


def test_keeps_dtypes_and_does_not_touch_inputs():
    norm_w = torch.ones(4, dtype=torch.bfloat16)
    nxt = torch.ones(2, 4, dtype=torch.bfloat16)
    before = (norm_w.clone(), nxt.clone())
    a, _, (b,) = smooth(norm_w, None, [nxt], torch.full((4,), 2.0))
    assert a.dtype == b.dtype == torch.bfloat16
    assert torch.equal(norm_w, before[0]) and torch.equal(nxt, before[1])


def test_smoothing_reduces_w8a8_error_with_outlier_channels():
    """The point of the method (§4, Fig. 4): with a per-tensor int8 activation scale an
    outlier channel wastes the range; after smoothing, W8A8 output error drops."""
    x, norm_w, nexts = _setup(seed=2)
    act = _rms(x) * norm_w
    w = nexts[0]
    ref = act @ w.T
    a8, w8 = PRESETS["int8-tensor"], PRESETS["int8-channel"]

    def w8a8_error(a, ww):
        return (fake_quantize(a, a8) @ fake_quantize(ww, w8).T - ref).pow(2).mean().item()

    s = smoothquant_scales(act.abs().amax(0), [w], alpha=0.5)
    new_norm, _, (w2,) = smooth(norm_w, None, [w], s)
    assert w8a8_error(_rms(x) * new_norm, w2) < 0.5 * w8a8_error(act, w)
