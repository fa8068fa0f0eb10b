"""Recipe parsing under generated input: random nested YAML-like mappings give a valid
:class:`Recipe` or a ``ValueError`` whose message starts with the key path of the fault —
never another exception (issue 20)."""

import re

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowbit.numerics.formats import FORMATS
from lowbit.numerics.scheme import PRESETS
from lowbit.quantization.methods import METHODS
from lowbit.quantization.recipe import Recipe, load_recipe, recipe_from_dict

_KEYS = ["name", "description", "weights", "inputs", "rules", "ignore", "kv_cache", "algorithms",
         "targets", "scheme", "keys", "values", "value_scheme", "format", "granularity", "symmetric",
         "scale_dtype", "global_scale", "dynamic", "mx_round_up", "full_range", "mx_nearest",
         "observer", "mse_importance", "batch", *METHODS, "alpha", "damp", "block_size", "act_order",
         "static_groups", "hessian", "grid", "clip", "tokens", "seed", "threshold", "top_k", "bitz"]
_WORDS = [*PRESETS, *FORMATS, "tensor", "channel", "token", "head", "group:64", "group(0)", "block:2x3",
          "block:0x1", "fp32", "bf16", "fp16", "e8m0", "minmax", "mse", "*", "*.mlp.down_proj", "lm_head", ""]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(_WORDS), st.text(max_size=8),
)
keys = st.one_of(st.sampled_from(_KEYS), st.text(max_size=5), st.integers(-2, 2), st.none(), st.booleans())
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=5)),
    max_leaves=20,
)
# mostly well-formed recipes, each field perturbed, so the parser is driven deep as well as wide
scheme_like = st.one_of(
    st.sampled_from(list(PRESETS)),
    st.fixed_dictionaries({"format": st.sampled_from([*FORMATS, 3]),
                           "granularity": st.sampled_from(_WORDS[len(PRESETS) + len(FORMATS):] + [7])},
                          optional={k: st.one_of(st.booleans(), st.sampled_from(_WORDS), st.integers(0, 2))
                                    for k in ("symmetric", "scale_dtype", "global_scale", "dynamic",
                                              "mx_round_up", "full_range", "mx_nearest")}),
    values,
)
method_like = st.one_of(st.booleans(), st.none(), st.dictionaries(st.sampled_from(_KEYS), scalars, max_size=3), values)
recipe_like = st.fixed_dictionaries({}, optional={
    "name": scalars, "description": scalars, "weights": scheme_like, "inputs": scheme_like,
    "rules": st.one_of(st.lists(st.fixed_dictionaries({"targets": st.one_of(st.lists(st.sampled_from(_WORDS), max_size=3), values)},
                                                      optional={"weights": scheme_like, "inputs": scheme_like, "bitz": scalars}),
                                max_size=3), values),
    "ignore": st.one_of(st.lists(st.text(max_size=6), max_size=3), values),
    "kv_cache": st.one_of(st.fixed_dictionaries({"scheme": scheme_like},
                                                optional={"keys": values, "values": values, "value_scheme": scheme_like}), values),
    "algorithms": st.one_of(st.dictionaries(st.sampled_from([*METHODS, "observer", "mse_importance", "batch"]),
                                            method_like, max_size=4), values),
    "bogus": scalars,
})

_SEG = re.compile(r"\.([^.\[\]]+)|\[(\d+)\]")


def _check_path(msg: str, d) -> None:
    """The message starts with ``recipe`` and the path after it walks into ``d`` (its last
    step may name a missing required key)."""
    assert msg.startswith("recipe"), msg
    head = msg.split(":", 1)[0]
    path = head[len("recipe"):]
    segs = _SEG.findall(path)
    assert "".join(f".{k}" if k else f"[{i}]" for k, i in segs) == path, (path, msg)
    node = d
    for n, (k, i) in enumerate(segs):
        last = n == len(segs) - 1
        if k:
            assert isinstance(node, dict), (msg, node)
            if k not in node:
                assert last, msg
                return
            node = node[k]
        else:
            assert isinstance(node, list) and int(i) < len(node), (msg, node)
            node = node[int(i)]


def _parse(d):
    try:
        r = recipe_from_dict(d)
    except ValueError as e:
        _check_path(str(e), d)
        return None
    assert isinstance(r, Recipe)
    r.summary()
    r.resolve(["model.layers.0.mlp.down_proj", "lm_head"])
    return r


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe_like)
def test_structured_recipes_parse_or_name_the_key(d):
    _parse(d)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_arbitrary_values_parse_or_name_the_key(d):
    _parse(d)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(recipe_like.map(lambda d: yaml.safe_dump(d)), st.text(max_size=40)))
def test_yaml_files_parse_or_raise_value_error(tmp_path_factory, text):
    p = tmp_path_factory.mktemp("r") / "r.yaml"
    p.write_text(text)
    try:
        load_recipe(p)
    except ValueError as e:
        assert str(e).startswith(str(p)), e
