import pytest
import torch

from lowbit.quantization.algorithms.outliers import fake_quantize_with_outliers, outlier_channels
from lowbit.numerics.qtensor import fake_quantize
from lowbit.numerics.scheme import PRESETS


def test_outlier_channels_by_threshold_and_top_k():
    a = torch.tensor([0.5, 7.0, 6.0, 2.0, 100.0])
    assert outlier_channels(a).tolist() == [1, 2, 4]
    assert outlier_channels(a, threshold=50).tolist() == [4]
    assert outlier_channels(a, top_k=2).tolist() == [1, 4]
    assert outlier_channels(a, top_k=0).tolist() == []
    with pytest.raises(ValueError, match="top_k"):
        outlier_channels(a, top_k=9)
    with pytest.raises(ValueError, match="threshold or top_k"):
        outlier_channels(a, threshold=None)


@pytest.mark.parametrize("name", ["int8-channel", "int4-g64-asym", "int4-g64", "nvfp4"])
def test_kept_columns_exact_and_rest_quantized_without_them(name):
    scheme = PRESETS[name]
    g = torch.Generator().manual_seed(0)
    w = torch.randn(16, 128, generator=g)
    w[:, 9] *= 50
    keep = torch.tensor([9, 70])
    out = fake_quantize_with_outliers(w, scheme, keep)
    assert torch.equal(out[:, keep], w[:, keep])
    rest = w.clone()
    rest[:, keep] = 0
    mask = torch.ones(128, dtype=torch.bool)
    mask[keep] = False
    assert torch.equal(out[:, mask], fake_quantize(rest, scheme)[:, mask])
    # the outlier column no longer sets the scale of its block: the rest is finer
    err = lambda a: float((a - w)[:, mask].pow(2).sum())  # noqa: E731
    assert err(out) < err(fake_quantize(w, scheme))


def test_mixed_precision_decomposition_reduces_w8a8_error():
    """The paper's setting: activation outlier channels break per-token int8; keeping
    them (and the matching weight columns) in high precision restores the product."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 96, generator=g)
    x[:, [4, 50]] *= 80
    w = torch.randn(32, 96, generator=g) * 0.05
    ref = x @ w.T
    a8, w8 = PRESETS["int8-token"], PRESETS["int8-channel"]
    keep = outlier_channels(x.abs().amax(0), threshold=20.0)
    assert keep.tolist() == [4, 50]
    plain = fake_quantize(x, a8) @ fake_quantize(w, w8).T
    mixed = fake_quantize_with_outliers(x, a8, keep) @ fake_quantize_with_outliers(w, w8, keep).T
    assert (mixed - ref).pow(2).mean() < 0.2 * (plain - ref).pow(2).mean()


def test_bad_columns_are_refused():
    with pytest.raises(ValueError, match="keep_cols"):
        fake_quantize_with_outliers(torch.randn(4, 8), PRESETS["int8-channel"], torch.tensor([8]))
