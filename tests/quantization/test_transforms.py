"""Function-preserving transforms: the model computes the same logits before and after."""

import pytest
import torch

from lowbit.models.arch import decoder_layers
from lowbit.quantization.transforms import balance, balance_groups, fold_norms, rotate_down_inputs, rotate_residual


def _orthogonal(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q.float()


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _perturb_norms(model):
    """Random norm scales, so that folding them is not trivially exact."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(p + 0.3 * torch.randn(p.shape, generator=g))


def test_balance_preserves_outputs(tiny_model, windows):
    _perturb_norms(tiny_model)
    ids = windows[:1]
    before = _logits(tiny_model, ids)
    g = torch.Generator().manual_seed(1)
    for i in range(len(decoder_layers(tiny_model))):
        for prev, _, nexts, _ in balance_groups(tiny_model, i):
            s = torch.rand(prev.weight.shape[0], generator=g) * 4 + 0.25
            from lowbit.models.arch import arch_of

            off = arch_of(tiny_model).norm_offset if not isinstance(prev, torch.nn.Linear) else 0.0
            balance(prev, nexts, s, norm_offset=off)
    assert torch.allclose(_logits(tiny_model, ids), before, atol=1e-4)


def test_fold_norms_preserves_outputs(tiny_llama, windows):
    _perturb_norms(tiny_llama)
    before = _logits(tiny_llama, windows[:1])
    fold_norms(tiny_llama)
    assert torch.allclose(_logits(tiny_llama, windows[:1]), before, atol=1e-4)
    for name, p in tiny_llama.named_parameters():
        if name.endswith("norm.weight"):
            assert torch.allclose(p, torch.ones_like(p))
    assert tiny_llama.lm_head.weight is not tiny_llama.model.embed_tokens.weight


def test_residual_rotation_is_exact(tiny_llama, windows):
    _perturb_norms(tiny_llama)
    before = _logits(tiny_llama, windows[:1])
    rotate_residual(tiny_llama, _orthogonal(64))
    assert torch.allclose(_logits(tiny_llama, windows[:1]), before, atol=1e-4)


def test_residual_rotation_refused_for_gemma_sandwich_norms(tiny_gemma3):
    with pytest.raises(ValueError, match="not function-preserving"):
        rotate_residual(tiny_gemma3, _orthogonal(64))


def test_down_input_rotation_with_online_transform(tiny_model, windows):
    before = _logits(tiny_model, windows[:1])
    H = _orthogonal(128)
    online = rotate_down_inputs(tiny_model, H)
    handles = [tiny_model.get_submodule(n).register_forward_pre_hook(lambda m, a, H=H: (a[0] @ H,)) for n in online]
    try:
        assert torch.allclose(_logits(tiny_model, windows[:1]), before, atol=1e-4)
    finally:
        for h in handles:
            h.remove()
