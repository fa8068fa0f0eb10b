"""llama.cpp's activation rounding (``lowbit.numerics.ggml_act``) and the hooks that put it into
the prediction of a GGUF file (``lowbit.engines.llama_cpp.engine_activations``)."""

import gguf
import numpy as np
import pytest
import torch

from lowbit.engines.llama_cpp import engine_activations
from lowbit.numerics.ggml_act import VEC_DOT_TYPE, round_activations, vec_dot_type


def _rows(n=576, rows=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g) * torch.rand(rows, 1, generator=g).mul(8).add(1e-3)
    x[0, :32] = 0.0  # an all-zero block
    x[1, 5] = 300.0  # an outlier
    x[2] = -x[2].abs()  # one-signed rows
    return x


def test_q8_0_equals_ggufs_reference_quantizer():
    """gguf's numpy port of ggml's Q8_0 quantizer, stored and decoded: the same values bit for bit."""
    x = _rows()
    ref = gguf.quants.dequantize(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)
    got = round_activations(x, "q8_0")
    assert torch.equal(got, torch.from_numpy(np.asarray(ref, dtype=np.float32)).reshape(x.shape))
    assert torch.equal(round_activations(x, "q8_1"), got)  # q8_1: the same values (plus a sum for mins)


def test_q8_k_blocks_of_256_with_fp32_scales():
    x = _rows(n=512)
    y = round_activations(x, "q8_k").reshape(x.shape[0], 2, 256)
    b = x.reshape(x.shape[0], 2, 256)
    amax = b.abs().amax(-1, keepdim=True)
    live = amax.squeeze(-1) != 0
    d = torch.ones_like(amax) / (torch.full_like(amax, 127.0) / amax)
    q = (y / d)[live]  # (q·d)/d: within float rounding of the integer q
    assert (q - q.round()).abs().max() < 1e-4 and q.round().abs().max() == 127  # integers on a 255-level grid
    assert torch.equal(y[live], q.round() * d.expand_as(y)[live])  # value = q · d, d in fp32
    assert torch.all(y[~live] == 0)
    big = b.abs().argmax(-1, keepdim=True)  # the largest element lands on ±127 steps exactly
    assert torch.equal(y.gather(-1, big)[live], (b.gather(-1, big).sign() * 127 * d)[live])
    assert torch.all((y - b).abs() <= d / 2 * (1 + 1e-6))  # round to nearest
    # the scale is kept in fp32 (q8_0's is fp16): on the same 256 elements the two differ
    assert not torch.equal(round_activations(x, "q8_k"), round_activations(x, "q8_0"))
    assert torch.equal(round_activations(-x, "q8_k"), -round_activations(x, "q8_k"))  # the signed max cancels


def test_ties_round_to_even_and_float_kinds():
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 1], x[0, 2] = 127.0, 2.5, 3.5  # amax 127: scale 1, the ties sit exactly on .5
    assert round_activations(x, "q8_0")[0, :3].tolist() == [127.0, 2.0, 4.0]
    h = torch.tensor([[1 + 2**-12, 3.0]])
    assert round_activations(h, "f16").tolist() == [[1.0, 3.0]] and round_activations(h, "f32") is h
    assert round_activations(h, "bf16").dtype == torch.float32


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="blocks of 256"):
        round_activations(torch.ones(2, 576), "q8_k")
    with pytest.raises(ValueError, match="unknown activation type"):
        round_activations(torch.ones(2, 32), "q4_0")
    with pytest.raises(ValueError, match="iq4_xs"):
        vec_dot_type("iq4_xs")
    assert vec_dot_type("Q4_K") == "q8_k" and VEC_DOT_TYPE["q5_1"] == "q8_1"


def test_every_ggml_type_has_an_activation_type():
    """ggml-cpu's type_traits: IQ4_NL multiplies against Q8_0 blocks, Q3_K against Q8_K."""
    from lowbit.numerics.ggml import GGML_TYPES

    assert set(GGML_TYPES) <= set(VEC_DOT_TYPE)
    assert vec_dot_type("IQ4_NL") == "q8_0" and vec_dot_type("q3_k") == "q8_k"


def test_engine_activations_hook_every_linear(tiny_llama):
    """Each Linear sees its input rounded for its own weight type; the tied head takes the
    embedding's type; the hooks are gone after the block; a Linear without a type is refused."""
    m = tiny_llama
    linears = [n for n, mod in m.named_modules() if isinstance(mod, torch.nn.Linear)]
    types = {n: "q4_0" for n in linears if n != "lm_head"} | {"model.embed_tokens": "q8_0"}
    seen = {}

    def spy(name):
        return lambda mod, args: seen.__setitem__(name, args[0].detach().clone())

    hs = [dict(m.named_modules())[n].register_forward_pre_hook(spy(n)) for n in linears]
    ids = torch.randint(0, m.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), engine_activations(m, types):
        out = m(ids).logits
    for h in hs:
        h.remove()
    for n in linears:  # the spies ran before the rounding hooks: round what they saw, as the Linear got it
        x = seen[n]
        assert not torch.equal(round_activations(x, "q8_0"), x), n
    with torch.no_grad():
        plain = m(ids).logits
    assert not torch.equal(out, plain)  # the hooks changed the forward, and are removed now
    with torch.no_grad(), engine_activations(m, {n: "f32" for n in linears}):
        assert torch.equal(m(ids).logits, plain)  # F32 weights: nothing rounded
    with pytest.raises(ValueError, match="no weight type for model.layers.0.mlp.down_proj"):
        with engine_activations(m, {n: "q4_0" for n in linears if not n.endswith("0.mlp.down_proj")}):
            pass
    assert all(not mod._forward_pre_hooks for mod in m.modules())
