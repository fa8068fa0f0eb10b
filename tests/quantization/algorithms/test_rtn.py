import pytest
import torch

from lowbit.numerics import formats as F
from lowbit.quantization.algorithms.gptq import gptq
from lowbit.quantization.algorithms.rtn import clip_ratios, mse_qparams
from lowbit.numerics.granularity import blocked, block, group
from lowbit.numerics.qtensor import QParams, compute_qparams, dequantize, fake_quantize
from lowbit.numerics.scheme import PRESETS, Scheme

SCHEMES = {
    "int4-g32": Scheme(F.INT4, group(32), scale_dtype="bf16"),
    "int4-g64-asym": PRESETS["int4-g64-asym"],
    "int8-channel": PRESETS["int8-channel"],
    "int4-channel": PRESETS["int4-channel"],
    "fp8-channel": PRESETS["fp8-channel"],
    "int4-block8x32": Scheme(F.INT4, block(8, 32)),
    "mxfp4": PRESETS["mxfp4"],
    "nvfp4": PRESETS["nvfp4"],
    "mxfp4-round-up": Scheme(F.FP4_E2M1, group(32), scale_dtype="e8m0", mx_round_up=True),
}


def _heavy_tailed(out=32, inp=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Student-t-like: most weights small, a few large, as in LLM weight rows
    return torch.randn(out, inp, generator=g) / (torch.rand(out, inp, generator=g) + 0.05).sqrt() * 0.02


def _block_error(w, qp, scheme, importance=None, norm=2.0):
    e = (w - fake_quantize(w, scheme, qp)).abs().pow(norm)
    if importance is not None:
        e = e * importance
    return blocked(e, scheme.granularity).sum(dim=(1, 3))


def test_clip_ratios():
    assert clip_ratios(100, 0.2)[0] == 1.0
    assert len(clip_ratios(100, 0.2)) == 21
    assert clip_ratios(100, 0.2)[-1] == pytest.approx(0.8)
    assert clip_ratios(10, 0.0) == [1.0]
    with pytest.raises(ValueError):
        clip_ratios(0, 0.2)


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("weighted", [False, True])
def test_never_worse_than_minmax_per_block(name, weighted):
    scheme = SCHEMES[name]
    w = _heavy_tailed()
    imp = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(5)) ** 4 if weighted else None
    mse = mse_qparams(w, scheme, importance=imp, max_shrink=0.5, grid=20)
    mm = compute_qparams(w, scheme)
    e_mse, e_mm = _block_error(w, mse, scheme, imp), _block_error(w, mm, scheme, imp)
    assert torch.all(e_mse <= e_mm)
    assert mse.scale.shape == mm.scale.shape
    if scheme.global_scale:
        assert torch.equal(mse.global_scale, mm.global_scale)


@pytest.mark.parametrize("name", ["int4-g32", "int4-g64-asym", "int4-channel", "nvfp4", "mxfp4-round-up"])
def test_clipping_pays_off_on_heavy_tailed_weights(name):
    scheme = SCHEMES[name]
    w = _heavy_tailed()
    e_mse = _block_error(w, mse_qparams(w, scheme, max_shrink=0.5, grid=20), scheme).sum()
    e_mm = _block_error(w, compute_qparams(w, scheme), scheme).sum()
    assert e_mse < 0.97 * e_mm


def test_no_shrink_is_minmax_exactly():
    for scheme in SCHEMES.values():
        w = _heavy_tailed(seed=1)
        a, b = mse_qparams(w, scheme, max_shrink=0.0), compute_qparams(w, scheme)
        assert torch.equal(a.scale, b.scale)
        assert (a.zero is None and b.zero is None) or torch.equal(a.zero, b.zero)


def test_matches_brute_force_search_on_one_block():
    scheme = Scheme(F.INT4, group(16))
    w = _heavy_tailed(out=1, inp=16, seed=3)
    imp = torch.linspace(0.1, 3.0, 16)
    got = mse_qparams(w, scheme, grid=50, max_shrink=0.6, importance=imp, norm=2.4)
    amax = w.abs().max()
    errs = []
    for k in range(31):
        s = (amax * (1 - k / 50)) / 7
        errs.append(((w - F.INT4.round(w / s) * s).abs().pow(2.4) * imp).sum())
    best = int(torch.argmin(torch.stack(errs)))
    torch.testing.assert_close(got.scale[0, 0], amax * (1 - best / 50) / 7)


def test_importance_steers_the_choice():
    scheme = Scheme(F.INT4, group(64))
    w = _heavy_tailed(out=64, inp=64, seed=4)
    # all the importance on the largest-magnitude column: clipping it costs the most
    big = int(w.abs().amax(0).argmax())
    imp = torch.full((64,), 1e-3)
    imp[big] = 1.0
    uniform = mse_qparams(w, scheme, max_shrink=0.5, grid=20)
    steered = mse_qparams(w, scheme, max_shrink=0.5, grid=20, importance=imp)
    assert not torch.equal(uniform.scale, steered.scale)
    assert _block_error(w, steered, scheme, imp).sum() <= _block_error(w, uniform, scheme, imp).sum()


def test_bad_importance_is_refused():
    with pytest.raises(ValueError, match="importance"):
        mse_qparams(_heavy_tailed(), SCHEMES["int4-g32"], importance=torch.ones(3))
    with pytest.raises(ValueError, match="importance"):
        mse_qparams(_heavy_tailed(), SCHEMES["int4-g32"], importance=-torch.ones(128))


@pytest.mark.parametrize("name", ["int4-g32", "nvfp4"])
def test_as_gptq_observer(name):
    """With an identity Hessian, GPTQ with the MSE observer is RTN with MSE scales."""
    scheme = SCHEMES[name]
    w = _heavy_tailed()
    imp = torch.rand(w.shape[1], generator=torch.Generator().manual_seed(6))

    def observer(wg, cols, g):
        return mse_qparams(wg, scheme, importance=imp[cols], global_scale=g, max_shrink=0.5, grid=20)

    got = dequantize(gptq(w, torch.eye(w.shape[1]), scheme, qparams_fn=observer))
    want = fake_quantize(w, scheme, mse_qparams(w, scheme, importance=imp, max_shrink=0.5, grid=20))
    assert torch.equal(got, want)
    assert isinstance(observer(w[:, :32], torch.arange(32), None if not scheme.global_scale else torch.tensor(1e-3)), QParams)
