"""The real engine in the loop (marker ``vllm``; CI runs it, ``make test-fast`` skips it).

Creates the vLLM environment with ``make vllm`` when it is missing (cached afterwards),
exports W8A8 INT8 dynamic and W4A16 INT4 g64 from SmolLM2 with a few calibration windows,
verifies both on a few windows and asserts the issue's targets.
"""


import pytest

from lowbit.engines.verify import TARGET_KL_FRACTION, verify

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RECIPES = ("w8a8-int8", "w4a16-int4-g64")
WINDOWS = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from lowbit.workflows import quantize_to_folder

    root = tmp_path_factory.mktemp("verify")
    out = []
    for r in RECIPES:
        quantize_to_folder("smollm2-135m", r, root / r, calib_windows=4, evaluate=False, progress=False)
        out.append(root / r)
    return out


def test_vllm_serves_what_lowbit_predicts(vllm_python, folders, tmp_path):
    res = verify(folders, windows=WINDOWS, python=vllm_python.python)
    assert not res.refused, res.refused
    assert [c.recipe for c in res.checks] == list(RECIPES)
    assert res.noise is not None and res.noise.tokens == WINDOWS * 511
    assert res.noise.top1 > 0.97  # same model, same dtype: the engine and lowbit agree almost everywhere
    for c in res.checks:
        assert c.engine["dtype"] == "bfloat16" and not c.engine["kv_cache_dtype"].startswith("fp8"), c.engine
        p = c.pair
        # the quantization is visible at all (a folder served as its unquantized model would fail here)
        assert p.kl_reference > 5 * res.noise.kl, (c.recipe, p.kl_reference, res.noise.kl)
        assert c.ppl_ok, (c.recipe, p.engine_ppl, p.lowbit_ppl, c.ppl_target)
        assert p.kl <= TARGET_KL_FRACTION * p.kl_reference, (c.recipe, p.kl, p.kl_reference)
        assert c.engine_seconds + c.lowbit_seconds < 180, (c.recipe, c.engine_seconds, c.lowbit_seconds)
