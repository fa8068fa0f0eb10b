"""Recipes: parsing, strict keys with paths, last-match-wins rules, presets."""

import pytest
import yaml

import lowbit as lb
from lowbit.quantization.recipe import RECIPES, COMPARE_DEFAULT, load_recipe, recipe_from_dict

NAMES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.mlp.down_proj",
    "model.layers.1.mlp.down_proj",
    "model.layers.0.mlp.gate",  # a MoE router
    "lm_head",
]


def test_last_match_wins_and_ignore():
    r = recipe_from_dict({
        "weights": "int4-g128",
        "rules": [
            {"targets": ["*.down_proj"], "weights": "int8-channel", "inputs": "int8-token"},
            {"targets": ["model.layers.1.*"], "weights": None},
        ],
    })
    plan = r.resolve(NAMES)
    assert plan["model.layers.0.self_attn.q_proj"] == (lb.PRESETS["int4-g128"], None)
    assert plan["model.layers.0.mlp.down_proj"] == (lb.PRESETS["int8-channel"], lb.PRESETS["int8-token"])
    assert "model.layers.1.mlp.down_proj" not in plan  # the last rule leaves it alone
    assert "lm_head" not in plan and "model.layers.0.mlp.gate" not in plan  # default ignore


def test_custom_ignore_replaces_default():
    r = recipe_from_dict({"weights": "int8-channel", "ignore": ["*.q_proj"]})
    plan = r.resolve(NAMES)
    assert "lm_head" in plan and "model.layers.0.self_attn.q_proj" not in plan


@pytest.mark.parametrize(
    "d, path",
    [
        ({"wieghts": "int4-g128"}, r"recipe: unknown key\(s\) \['wieghts'\]"),
        ({"rules": [{"targets": ["*"], "weights": {"format": "int4", "granularity": "channel", "bitz": 4}}]},
         r"recipe.rules\[0\].weights: unknown key\(s\) \['bitz'\]"),
        ({"rules": [{"weights": "int4-g128"}]}, r"recipe.rules\[0\].targets: required"),
        ({"rules": [{"targets": ["*"], "weights": "int3-g7"}]}, r"recipe.rules\[0\].weights: unknown scheme 'int3-g7'"),
        ({"kv_cache": {"scheme": "fp8-tensor", "keyz": True}}, r"recipe.kv_cache: unknown key\(s\) \['keyz'\]"),
        ({"kv_cache": {"scheme": "fp8-tensor", "keys": False, "values": False}}, r"recipe.kv_cache: at least one"),
        ({"weights": {"format": "fp8_e4m3", "granularity": "channel", "symmetric": False}},
         r"recipe.weights: asymmetric quantization needs an integer format"),
        ({"algorithms": {"gptq": {"blocksize": 4}}}, r"recipe.algorithms.gptq: unknown key\(s\) \[.blocksize.\]"),
        ({"algorithms": {"awq": {}, "smoothquant": {}}}, r"recipe.algorithms: smoothquant and awq"),
        ({"rules": [{"targets": ["*"], "inputs": {"format": "int8", "granularity": "tensor", "signed_scale": True}}]},
         r"recipe.rules\[0\].inputs: signed_scale is for weights"),
        ({"kv_cache": {"scheme": {"format": "int8", "granularity": "tensor", "signed_scale": True}}},
         r"recipe.kv_cache: signed_scale is for weights"),
    ],
)
def test_errors_name_the_key_path(d, path):
    with pytest.raises(ValueError, match=path):
        recipe_from_dict(d)


def test_yaml_file_roundtrip(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text(yaml.safe_dump({"name": "mine", "weights": "nvfp4", "inputs": "nvfp4", "kv_cache": {"scheme": "fp8-tensor"}}))
    r = load_recipe(p)
    assert r.name == "mine" and r.kv_cache.scheme == lb.PRESETS["fp8-tensor"]
    assert r.needs_calibration  # static KV scales and the NVFP4 input global scale
    with pytest.raises(FileNotFoundError):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        load_recipe("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("weights: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_recipe(bad)


def test_presets_are_valid_and_compare_default_exists():
    for name in COMPARE_DEFAULT:
        assert name in RECIPES
    assert not RECIPES["fp8-dynamic"].needs_calibration
    assert RECIPES["fp8-tensor"].needs_calibration
    assert RECIPES["kv-fp8-k"].kv_cache.values is False


def test_static_kv_needs_tensor_or_head():
    with pytest.raises(ValueError, match="static .* needs tensor or head"):
        recipe_from_dict({"kv_cache": {"scheme": {"format": "fp8_e4m3", "granularity": "token"}}})


def test_a_rule_matching_nothing_is_named(tiny_llama, caplog):
    """The pipeline warns (a rule matching nothing may be meant, e.g. rotation only);
    ``lowbit quantize`` refuses it (tests/cli/test_damaged_inputs.py)."""
    import logging

    from lowbit.quantization.pipeline import linear_names, quantize

    r = recipe_from_dict({"rules": [{"targets": ["*.mlp.fc9"], "weights": "int8-channel"}]})
    assert "the rule for targets ['*.mlp.fc9'] matches no Linear" in r.unmatched(linear_names(tiny_llama))
    assert RECIPES["w8a16-int8"].unmatched(linear_names(tiny_llama)) == ""
    with caplog.at_level(logging.WARNING, logger="lowbit"):
        quantize(tiny_llama, r)
    assert "matches no Linear" in caplog.text
