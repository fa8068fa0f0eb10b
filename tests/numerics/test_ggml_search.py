"""The k-quants' round to nearest (llama-quantize's least-squares search): it finds a grid the
weights already lie on — lowbit's own output here, and the Q4_K/Q6_K tensors of the published Gemma
GGUF the packaged model was converted from — and rounds Gaussian weights with less error than
min-max.  The measured figures quoted below are printed by ``benchmarks/kquant_search.py``."""

import numpy as np
import pytest
import torch

from lowbit.numerics import ggml as G
from lowbit.numerics.ggml_pack import pack
from lowbit.numerics.ggml_search import _affine_fit, _symmetric_fit, rtn_params, search_weights
from lowbit.numerics.qtensor import fake_quantize, quantize
from lowbit.numerics.scheme import PRESETS
from lowbit.quantization.algorithms.rtn import mse_qparams

K_QUANTS = ["q4_k", "q5_k", "q6_k", "q3_k"]
SEARCHED = [*K_QUANTS, "iq4_nl"]                 # every type rtn_params searches


def _rounded(m, t, params):
    scale, zero = params[0], params[1]
    return G.dequantize_values(G.element_values(m, t, scale, zero), t, scale, zero)


def _rel(a, b):
    return float(((a - b) ** 2).sum() / (b ** 2).sum())


def _gaussian(rows=16, cols=2048, seed=0):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02


#: measured fraction of elements given back exactly (seeds 0-4): 0.999-1.0, 0.982-0.994, 0.9995-1.0,
#: 0.9988-1.0 (q3_k), 1.0 (iq4_nl; 0.988-0.994 with ggml's candidates alone)
GIVEN_BACK = {"q4_k": 0.999, "q5_k": 0.98, "q6_k": 0.999, "q3_k": 0.998, "iq4_nl": 0.999}


@pytest.mark.parametrize("name", SEARCHED)
def test_rounding_is_idempotent(name):
    """Weights already on a grid llama-quantize's way (here: lowbit's own output) come back; min-max
    rounds them a second time."""
    t, scheme = G.get_type(name), PRESETS[f"gguf-{name}"]
    w = fake_quantize(_gaussian(), scheme)
    again = fake_quantize(w, scheme)
    assert float((again == w).float().mean()) > GIVEN_BACK[name]
    assert _rel(again, w) < 1e-5
    assert _rel(_rounded(w, t, G.minmax_params(w, t)), w) > 1e-4


#: measured squared error relative to min-max's (seeds 1-5): q4_k 0.83, q5_k 0.90, q6_k 0.89, q3_k 0.970-0.979
#: (x²-weighted fits at 3 bits), iq4_nl 0.900-0.906
BELOW_MIN_MAX = {"q4_k": 0.95, "q5_k": 0.95, "q6_k": 0.95, "q3_k": 0.985, "iq4_nl": 0.92}


@pytest.mark.parametrize("name", SEARCHED)
def test_less_error_than_min_max_on_gaussian_weights(name):
    t = G.get_type(name)
    m = _gaussian(64, seed=1)
    search, minmax = _rel(_rounded(m, t, rtn_params(m, t)), m), _rel(_rounded(m, t, G.minmax_params(m, t)), m)
    assert search < BELOW_MIN_MAX[name] * minmax, (search, minmax)


def test_iq4_nl_search_beats_the_positive_amax_scale():
    """iq4_nl's table is lopsided (−127 … 113): ``d = amax / 127`` saturates a positive extreme at 113;
    the search's squared error is 0.77-0.78 of that one (seeds 1-5) and its scales are fp16."""
    t = G.get_type("iq4_nl")
    m = _gaussian(64, seed=1)
    scale, zero, sup, _ = rtn_params(m, t)
    assert zero is None and sup is None and torch.equal(scale, scale.half().float())
    amax = (G.subblock_view(m, t).abs().amax(dim=-1) / 127).half().float()
    search, plain = _rel(_rounded(m, t, (scale, None)), m), _rel(_rounded(m, t, (amax, None)), m)
    assert search < 0.8 * plain, (search, plain)


def test_fits_never_lose_to_min_max_under_their_weights():
    """Before the second level: each sub-block's fit has at most min-max's weighted error, the
    min stays ≤ 0 (offset ≥ 0) and scales stay positive."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, 32, generator=g, dtype=torch.float64) * 0.02
    x[:64] = x[:64].abs() + 0.01                                   # blocks of one sign
    x[64:72] = 0.0                                                 # empty blocks
    t = G.get_type("q4_k")
    w = search_weights(x.reshape(1, -1, 32), t).reshape(-1, 32)
    s, o = _affine_fit(x, w, 15, -1.0, 0.1, 20)
    lo = x.amin(dim=-1).clamp(max=0)
    s0 = (x.amax(dim=-1) - lo) / 15
    l0 = torch.round((x - lo[:, None]) / torch.where(s0 > 0, s0, 1)[:, None]).clamp(0, 15)
    err0 = (w * (s0[:, None] * l0 + lo[:, None] - x) ** 2).sum(-1)
    l1 = torch.round((x + o[:, None]) / torch.where(s > 0, s, 1)[:, None]).clamp(0, 15)
    err1 = (w * (s[:, None] * l1 - o[:, None] - x) ** 2).sum(-1)
    assert (err1 <= err0 * (1 + 1e-9) + 1e-30).all()
    assert (err1 < err0 * 0.999).float().mean() > 0.5
    assert (o >= 0).all() and (s[:64] > 0).all() and (s[64:72] == 0).all()


def test_symmetric_fit_never_loses_to_min_max_under_its_weights():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4096, 16, generator=g, dtype=torch.float64) * 0.02
    x[:8] = 0.0
    w = search_weights(x.reshape(1, -1, 16), G.get_type("q6_k")).reshape(-1, 16)
    s = _symmetric_fit(x, w, G.get_type("q6_k"))
    s0 = G._signed_extreme(x) / -32

    def err(sc):
        safe = torch.where(sc != 0, sc, 1)[:, None]
        return (w * (torch.round(x / safe).clamp(-32, 31) * sc[:, None] - x) ** 2).sum(-1)

    e, e0 = err(s), err(s0)
    assert (s[:8] == 0).all() and torch.equal(torch.sign(s[8:]), torch.sign(s0[8:]))
    assert (e <= e0 * (1 + 1e-9)).all()
    assert (e[8:] < e0[8:] * 0.999).float().mean() > 0.5


def test_importance_weights_the_search():
    """An importance per column (an imatrix) steers the fit: the importance-weighted error drops."""
    g = torch.Generator().manual_seed(3)
    m = torch.randn(32, 1024, generator=g) * 0.02
    imp = torch.ones(32, 1024)
    imp[:, ::8] = 100.0
    t = G.get_type("q4_k")
    plain, weighted = _rounded(m, t, rtn_params(m, t)), _rounded(m, t, rtn_params(m, t, imp))
    wsum = lambda q: float((imp * (q - m) ** 2).sum())  # noqa: E731
    assert wsum(weighted) < 0.9 * wsum(plain)


def test_clipping_search_starts_from_the_refit():
    """The mse observer's candidates include the refit, so it also gives back on-grid weights and is
    never worse than the plain round to nearest."""
    w = fake_quantize(_gaussian(seed=4), PRESETS["gguf-q4_k"])
    qp = mse_qparams(w, PRESETS["gguf-q4_k"])
    assert _rel(fake_quantize(w, PRESETS["gguf-q4_k"], qp), w) < 1e-6
    m = torch.randn(16, 1024, generator=torch.Generator().manual_seed(5)) * 0.02
    qp = mse_qparams(m, PRESETS["gguf-q4_k"])
    assert _rel(fake_quantize(m, PRESETS["gguf-q4_k"], qp), m) <= _rel(fake_quantize(m, PRESETS["gguf-q4_k"]), m) + 1e-12


@pytest.mark.slow
def test_published_gemma_q4_k_m_tensors_are_found_again():
    """The Q4_K and Q6_K tensors of the published Gemma-3-270m GGUF (made by llama-quantize),
    dequantized by the ``gguf`` package and re-quantized by lowbit: the values come back (measured
    over the whole file: ≥ 99.8% of Q4_K super-blocks byte-identical, relative error ≤ 7e-7;
    Q6_K values identical but for ≤ 0.07% per tensor, its bytes less often: a sub-block with a
    symmetric code range has two signs)."""
    gguf = pytest.importorskip("gguf")
    from lowbit.models.assets import source_gguf

    reader = gguf.GGUFReader(source_gguf("gemma3-270m"))
    picked = [x for x in reader.tensors if x.name in ("blk.0.attn_output.weight", "blk.0.ffn_down.weight",
                                                      "blk.3.ffn_down.weight", "blk.5.attn_output.weight")]
    assert [x.tensor_type.name for x in picked] == ["Q4_K", "Q6_K", "Q4_K", "Q4_K"]
    for x in picked:
        name = x.tensor_type.name.lower()
        raw = np.asarray(x.data)
        w = gguf.quants.dequantize(raw, x.tensor_type)
        qt = quantize(torch.from_numpy(np.ascontiguousarray(w)), PRESETS[f"gguf-{name}"])
        t = G.get_type(name)
        mine = pack(qt.values(), t, qt.scale, qt.zero, qt.super_scale, qt.super_min).numpy()
        back = gguf.quants.dequantize(mine, x.tensor_type)
        assert _rel(torch.from_numpy(back), torch.from_numpy(w)) < 1e-6, x.name
        assert np.mean(back == w) > 0.999, x.name
        if name == "q4_k":
            same = (mine.reshape(-1, t.type_size) == raw.reshape(-1, t.type_size)).all(axis=1).mean()
            assert same > 0.99, (x.name, same)
        minmax = _rounded(torch.from_numpy(w).float(), t, G.minmax_params(torch.from_numpy(w).float(), t))
        assert _rel(minmax, torch.from_numpy(w)) > 1e-5            # what lowbit did before the search
