import pytest
import torch

from lowbit.numerics import formats as F
from lowbit.quantization.algorithms.awq import awq_clip, awq_scales
from lowbit.numerics.granularity import block, group
from lowbit.numerics.qtensor import compute_qparams, fake_quantize
from lowbit.numerics.scheme import PRESETS, Scheme

G32 = Scheme(F.INT4, group(32))
G32_ASYM = Scheme(F.UINT4, group(32), symmetric=False)


def _salient(n=256, inp=64, seed=0):
    """Inputs where a few channels carry most of the magnitude (AWQ §3.1, Fig. 2)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inp, generator=g)
    x[:, torch.randperm(inp, generator=g)[:4]] *= 20
    ws = [torch.randn(48, inp, generator=g) * 0.05, torch.randn(32, inp, generator=g) * 0.05]
    return x, ws


def _group_error(x, ws, s, scheme, out_fn=None):
    f = out_fn or (lambda inp, wl: torch.cat([inp @ w.T for w in wl], dim=-1))
    return float((f(x / s, [fake_quantize(w * s, scheme) for w in ws]) - f(x, ws)).pow(2).sum())


@pytest.mark.parametrize("scheme", [G32, G32_ASYM, PRESETS["int4-channel"], PRESETS["nvfp4"]], ids=str)
def test_scales_protect_salient_channels(scheme):
    x, ws = _salient()
    s, alpha = awq_scales(x, ws, scheme)
    ones = torch.ones(x.shape[1])
    assert 0 < alpha <= 1
    assert _group_error(x, ws, s, scheme) < 0.8 * _group_error(x, ws, ones, scheme)
    # normalised as the reference: √(max·min) = 1
    assert float((s.max() * s.min()).sqrt()) == pytest.approx(1.0, rel=1e-5)


def test_matches_brute_force_over_alpha():
    x, ws = _salient(seed=1)
    s, alpha = awq_scales(x, ws, G32, grid=10)
    s_x = x.abs().mean(0)
    errs = []
    for k in range(11):
        c = s_x.pow(k / 10).clamp(min=1e-4)
        c = c / (c.max() * c.min()).sqrt()
        errs.append(_group_error(x, ws, c, G32))
    assert alpha == pytest.approx(int(torch.tensor(errs).argmin()) / 10)
    assert _group_error(x, ws, s, G32) == pytest.approx(min(errs), rel=1e-5)


@pytest.mark.parametrize("scheme", [G32_ASYM, PRESETS["nvfp4"]], ids=str)
def test_gram_error_equals_the_products_error_in_float64(scheme):
    """The search judges each α through XᵀX; that must be the products' own error."""
    from lowbit.quantization.algorithms.awq import _output_error
    x, ws = _salient(n=512, seed=5)
    error = _output_error(x, ws)
    s_x = x.abs().mean(0)
    for alpha in (0.0, 0.4, 1.0):
        s = s_x.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        q = [fake_quantize(w * s, scheme) for w in ws]
        xd = x.double()
        want = sum(float(((xd / s.double()) @ qk.double().T - xd @ w.double().T).pow(2).sum()) for qk, w in zip(q, ws))
        assert error(s, q) == pytest.approx(want, rel=1e-5)


def test_never_worse_than_rtn_even_without_salient_channels():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(128, 64, generator=g)
    ws = [torch.randn(16, 64, generator=g)]
    s, alpha = awq_scales(x, ws, G32)
    assert _group_error(x, ws, s, G32) <= _group_error(x, ws, torch.ones(64), G32)
    if alpha == 0:
        assert torch.equal(s, torch.ones(64))


def test_out_fn_and_duo_scaling_and_subsampling():
    x, ws = _salient(seed=3)
    ws = [ws[0], ws[0].flip(0)]  # gate and up of equal width

    def mlp(inp, wl):
        return torch.nn.functional.silu(inp @ wl[0].T) * (inp @ wl[1].T)

    for kwargs in ({"out_fn": mlp}, {"out_fn": mlp, "duo_scaling": True}, {"n_tokens": 64}):
        s, alpha = awq_scales(x, ws, G32, **kwargs)
        assert s.shape == (64,) and torch.isfinite(s).all() and (s > 0).all()
        f = kwargs.get("out_fn")
        assert _group_error(x, ws, s, G32, f) <= _group_error(x, ws, torch.ones(64), G32, f)
    # subsampling is seeded: same seed, same answer
    assert torch.equal(awq_scales(x, ws, G32, n_tokens=64, seed=4)[0], awq_scales(x, ws, G32, n_tokens=64, seed=4)[0])


def _clip_block_errors(x, w, qp, scheme, gc):
    """Per (row, column group) output error, computed group by group."""
    q = fake_quantize(w, scheme, qp)
    errs = []
    for j in range(0, w.shape[1], gc):
        d = x[:, j:j + gc] @ (q[:, j:j + gc] - w[:, j:j + gc]).T  # (t, out)
        errs.append(d.pow(2).sum(0))
    return torch.stack(errs, dim=1)  # (out, C)


@pytest.mark.parametrize("scheme", [G32, G32_ASYM, Scheme(F.INT4, group(24)), PRESETS["nvfp4"]], ids=str)
def test_clip_never_worse_than_minmax_per_block(scheme):
    x, ws = _salient(seed=5)
    w = ws[0] / (torch.rand_like(ws[0]) + 0.05).sqrt()  # heavier tails: clipping matters
    qp = awq_clip(x, w, scheme)
    gc = scheme.granularity.cols
    e_clip = _clip_block_errors(x, w, qp, scheme, gc)
    e_mm = _clip_block_errors(x, w, compute_qparams(w, scheme), scheme, gc)
    assert torch.all(e_clip <= e_mm * (1 + 1e-4) + 1e-6)
    assert e_clip.sum() < 0.95 * e_mm.sum()


def test_clip_row_blocks_and_channels():
    x, ws = _salient(seed=6)
    w = ws[0] / (torch.rand_like(ws[0]) + 0.05).sqrt()
    for scheme in (Scheme(F.INT4, block(8, 32)), PRESETS["int4-channel"]):
        qp = awq_clip(x, w, scheme)
        mm = compute_qparams(w, scheme)
        assert qp.scale.shape == mm.scale.shape
        out = lambda p: float((x @ (fake_quantize(w, scheme, p) - w).T).pow(2).sum())  # noqa: E731
        assert out(qp) <= out(mm)


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="expected"):
        awq_scales(torch.randn(4, 8), [torch.randn(2, 7)], G32)
    with pytest.raises(ValueError, match="tokens, in"):
        awq_clip(torch.randn(8), torch.randn(2, 8), G32)
