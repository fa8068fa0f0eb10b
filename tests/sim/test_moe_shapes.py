"""The simulator's MoE shape and the quantizer agree on what is quantized: bytes of the
experts and of attention at the plan's scheme, routers in 16 bits, from both sides."""

import pytest
import torch

from lowbit.checkpoint.write import export
from lowbit.numerics.scheme import bits_per_element, get_scheme
from lowbit.quantization.pipeline import quantize
from lowbit.quantization.recipe import recipe_from_dict
from lowbit.sim.memory import weight_bytes
from lowbit.sim.plans import PLANS
from lowbit.sim.shapes import shape_from_config


@pytest.mark.parametrize("plan", ["fp8", "w8a8-int8", "nvfp4"])
def test_sim_and_quantizer_count_the_same_quantized_weights(tiny_moe, plan, tmp_path):
    p = PLANS[plan]
    shape = shape_from_config(tiny_moe.config.to_dict())
    assert shape.is_moe and shape.experts == 8
    sim = weight_bytes(shape, p)
    recipe = recipe_from_dict({"name": plan, "weights": p.weights})
    state = quantize(tiny_moe, recipe, keep_qtensors=True, progress=False)
    mods = dict(tiny_moe.named_modules())
    ours = {"attention": 0.0, "expert": 0.0}
    for n, s in state.weight_schemes.items():
        w = mods[n].weight
        ours["expert" if ".experts." in n else "attention"] += w.numel() * bits_per_element(s, tuple(w.shape)) / 8
    assert set(state.weight_schemes) == {n for n in mods if n.endswith(("_proj",)) and "experts." in n or
                                         n.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))}
    # two-level schemes: the simulator prices each expert's fused gate_up (vLLM's w13) with one
    # 4-byte global scale; the checkpoint stores gate and up with one each (equal values)
    extra = 4 * len(tiny_moe.model.layers) * shape.experts if get_scheme(p.weights).global_scale else 0
    assert ours["expert"] - extra == pytest.approx(sim["expert"], rel=1e-9)
    extra_qkv = 2 * extra // shape.experts  # likewise q, k, v fused into one qkv: two more per layer
    assert ours["attention"] - extra_qkv == pytest.approx(sim["attention"], rel=1e-9)
    routers = sum(layer.mlp.gate.weight.numel() for layer in tiny_moe.model.layers) * 2  # bf16, never quantized
    assert sim["router"] == routers
    # and the bytes written: codes + scales of the quantized Linears, measured in the file
    res = export(tiny_moe, state, tmp_path / "o", dtype=torch.bfloat16)
    assert res.sizes.predicted_bytes == round(ours["expert"] + ours["attention"])
    assert res.sizes.quantized_bytes == pytest.approx(res.sizes.predicted_bytes, rel=0.02)
    assert get_scheme(p.weights) == next(iter(state.weight_schemes.values()))
