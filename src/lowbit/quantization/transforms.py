"""Function-preserving edits of a model: scale balancing and rotations.

Each transform computes new weights from old ones and hands them to :func:`_assign`, the
one place that writes into a module.  In real arithmetic the model computes the same
function before and after (tests check it to float tolerance); what changes is how easy
the weights and activations are to quantize.

* :func:`balance` moves a per-channel scale ``s`` from the output of ``prev`` (a norm or a
  linear) into the input columns of the linears ``next`` that read it (SmoothQuant, AWQ).
* :func:`rotate_residual` rotates the residual stream by an orthogonal ``Q`` (QuaRot /
  SpinQuant): norms are folded into the linears that read them, embeddings and every
  writer to the residual are multiplied by ``Q``, every reader by ``Qᵀ``.
* :func:`rotate_down_inputs` rotates the input of each ``down_proj`` by ``H``: the weight
  absorbs ``H`` and the runtime applies ``x ↦ x·H`` before quantizing the activation.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.arch import Arch, arch_of, decoder_layers, submodule

__all__ = ["balance", "fold_norms", "rotate_residual", "rotate_residual_ends", "rotate_residual_layer",
           "rotate_down_inputs", "rotate_down_input", "residual_rotation_supported",
           "balance_groups", "expert_balance_groups"]


@torch.no_grad()
def _assign(module: nn.Module, attr: str, value: torch.Tensor) -> None:
    """The one place a transform writes into a module: replace ``module.<attr>``'s data."""
    p = getattr(module, attr)
    if p.shape != value.shape:
        setattr(module, attr, nn.Parameter(value.to(p.dtype), requires_grad=False))
    else:
        p.copy_(value.to(p.dtype))


def _is_norm(m: nn.Module) -> bool:
    return not isinstance(m, nn.Linear) and hasattr(m, "weight") and m.weight.ndim == 1


def balance(prev: nn.Module, nexts: list[nn.Linear], s: torch.Tensor, *, norm_offset: float = 0.0) -> None:
    """Divide ``prev``'s output channel ``j`` by ``s_j`` and multiply input column ``j`` of
    every linear in ``nexts`` by ``s_j`` (SmoothQuant eq. 3; AWQ eq. 5).

    ``prev`` is an RMSNorm (its scale ``offset + weight`` is divided) or a Linear (its
    output rows, and bias, are divided).
    """
    s = s.to(prev.weight.device, torch.float32)  # where the layer is
    if _is_norm(prev):
        w = prev.weight.detach().float()
        _assign(prev, "weight", (norm_offset + w) / s - norm_offset)
    elif isinstance(prev, nn.Linear):
        if prev.weight.shape[0] != s.numel():
            raise ValueError(f"cannot balance: {prev.weight.shape[0]} output channels, {s.numel()} scales")
        _assign(prev, "weight", prev.weight.detach().float() / s[:, None])
        if prev.bias is not None:
            _assign(prev, "bias", prev.bias.detach().float() / s)
    else:
        raise ValueError(f"cannot fold a scale into a {type(prev).__name__}")
    for lin in nexts:
        _assign(lin, "weight", lin.weight.detach().float() * s[None, :])


def residual_rotation_supported(model: nn.Module) -> str | None:
    """``None`` when the residual stream can be rotated exactly, else the reason."""
    arch = arch_of(model)
    layer = decoder_layers(model)[0]
    for extra in ("post_feedforward_layernorm",):
        if hasattr(layer, extra):
            return ("norms applied to sub-layer outputs (Gemma's sandwich norms) scale channels after the "
                    "residual rotation, which no longer commutes; rotate only the down_proj inputs")
    if arch.norm_offset not in (0.0, 1.0):
        return f"norm offset {arch.norm_offset} not handled"
    return None


def _get(model: nn.Module, path: str) -> nn.Module:
    return model.get_submodule(path)


def fold_norms(model: nn.Module) -> None:
    """Fold every pre-sub-layer RMSNorm scale into the linears that read it, leaving the
    norms with unit scale (needed before a residual rotation)."""
    arch = arch_of(model)
    for layer in decoder_layers(model):
        _fold_layer_norms(layer, arch)
    _fold_final_norm(model, arch)


def _fold_layer_norms(layer: nn.Module, arch: Arch) -> None:
    for b in arch.balances:
        prev = _get(layer, b.prev)
        if _is_norm(prev):
            gamma = arch.norm_offset + prev.weight.detach().float()
            balance(prev, [_get(layer, n) for n in b.next], gamma, norm_offset=arch.norm_offset)


def _fold_final_norm(model: nn.Module, arch: Arch) -> None:
    final = model.get_decoder().norm
    head = model.get_output_embeddings()
    gamma = arch.norm_offset + final.weight.detach().float()
    _untie(model)
    balance(final, [head], gamma, norm_offset=arch.norm_offset)


def _untie(model: nn.Module) -> None:
    """Give lm_head its own weight when it shares the embedding's (a rotation treats the
    two differently once the final norm is folded into lm_head)."""
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if head.weight is emb.weight or head.weight.data_ptr() == emb.weight.data_ptr():
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False


@torch.no_grad()
def rotate_residual(model: nn.Module, Q: torch.Tensor) -> None:
    """Rotate the residual stream by orthogonal ``Q`` (hidden × hidden): h ↦ h·Q.

    The same as :func:`rotate_residual_ends` followed by :func:`rotate_residual_layer`
    for every decoder layer (the pipeline applies the per-layer part as it reaches each
    layer).  Raises ``ValueError`` where the architecture makes this inexact (see
    :func:`residual_rotation_supported`).
    """
    rotate_residual_ends(model, Q)
    for i in range(len(decoder_layers(model))):
        rotate_residual_layer(model, i, Q)


@torch.no_grad()
def rotate_residual_ends(model: nn.Module, Q: torch.Tensor) -> None:
    """The part of :func:`rotate_residual` outside the decoder layers: the final norm
    folded into lm_head, the embeddings' outputs and lm_head's inputs rotated."""
    why = residual_rotation_supported(model)
    if why:
        raise ValueError(f"residual rotation is not function-preserving here: {why}")
    emb = model.get_input_embeddings()
    Q = Q.to(emb.weight.device, torch.float32)  # where the model is
    _fold_final_norm(model, arch_of(model))
    _assign(emb, "weight", emb.weight.detach().float() @ Q)
    head = model.get_output_embeddings()
    _assign(head, "weight", head.weight.detach().float() @ Q)


@torch.no_grad()
def rotate_residual_layer(model: nn.Module, i: int, Q: torch.Tensor) -> None:
    """The part of :func:`rotate_residual` inside decoder layer ``i``: its pre-sub-layer
    norms folded into the linears that read them, readers of the residual rotated on
    their inputs (``W·Q``), writers on their outputs (``Qᵀ·W``)."""
    arch = arch_of(model)
    layer = decoder_layers(model)[i]
    Q = Q.to(next(layer.parameters()).device, torch.float32)  # where the layer is
    _fold_layer_norms(layer, arch)
    for b in arch.balances:
        if _is_norm(_get(layer, b.prev)):
            for n in b.next:  # readers of the residual: their inputs are now h·Q
                lin = _get(layer, n)
                _assign(lin, "weight", lin.weight.detach().float() @ Q)
    for n in (arch.o, arch.down):  # writers to the residual: outputs must become y·Q
        lin = _get(layer, n)
        _assign(lin, "weight", Q.T @ lin.weight.detach().float())
        if lin.bias is not None:
            _assign(lin, "bias", lin.bias.detach().float() @ Q)


@torch.no_grad()
def rotate_down_inputs(model: nn.Module, H: torch.Tensor) -> dict[str, torch.Tensor]:
    """Absorb ``H`` (intermediate × intermediate, orthogonal) into every down_proj weight.

    Returns ``{down_proj name: H}``: the runtime must multiply each down_proj input by
    ``H`` (online), so that (x·H)(W·H)ᵀ = x·Wᵀ.
    """
    return dict(rotate_down_input(model, i, H) for i in range(len(decoder_layers(model))))


@torch.no_grad()
def rotate_down_input(model: nn.Module, i: int, H: torch.Tensor) -> tuple[str, torch.Tensor]:
    """:func:`rotate_down_inputs` for decoder layer ``i``: ``(down_proj name, H)``."""
    arch = arch_of(model)
    lin = _get(decoder_layers(model)[i], arch.down)
    _assign(lin, "weight", lin.weight.detach().float() @ H.to(lin.weight.device, torch.float32))
    return f"{arch.layers}.{i}.{arch.down}", H


def balance_groups(model: nn.Module, layer_index: int, arch: Arch | None = None):
    """The balancing groups of one decoder layer as ``(prev module, prev name, [next
    modules], [next names])`` with full names, skipping groups whose shapes do not allow
    it (v_proj → o_proj under grouped-query attention).

    In a mixture-of-experts layer (:func:`expert_balance_groups`) the MLP's norm feeds the
    router and every expert, so no scale goes through it; each expert's (and a shared
    expert's) ``up_proj → down_proj`` pair is a group of its own."""
    arch = arch or arch_of(model)
    layer = decoder_layers(model)[layer_index]
    prefix = f"{arch.layers}.{layer_index}"
    out = []
    for b in arch.balances:
        prev = _get(layer, b.prev)
        nexts = [_get(layer, n) for n in b.next]
        width = prev.weight.shape[0]
        if any(n.weight.shape[1] != width for n in nexts):
            continue
        out.append((prev, f"{prefix}.{b.prev}", nexts, [f"{prefix}.{n}" for n in b.next]))
    return out + expert_balance_groups(layer, prefix, arch)


def expert_balance_groups(layer: nn.Module, prefix: str, arch: Arch):
    """The balancing groups inside the experts of one MoE decoder layer (``prefix``: its
    name), in :func:`balance_groups`' form: per routed expert ``e`` (and for a shared
    expert), ``up_proj → down_proj``.

    Why these and no others: a scale must fold exactly into what produces the scaled input.
    The experts' gate/up read the output of the MLP's norm, which the router and every
    other expert read too: a per-expert scale cannot be folded there, and one scale for
    all would change the router's weights (kept exact).  Inside an expert,
    ``down(act(gate x) ⊙ up x)`` is elementwise in the intermediate channels, so dividing
    up_proj's output row ``j`` by ``s_j`` and multiplying down_proj's input column ``j`` by
    ``s_j`` leaves the expert's function unchanged, separately for every expert."""
    e = arch.experts
    if e is None:
        return []
    out = []
    experts = submodule(layer, e.path)  # None in a dense layer of a MoE model
    parts = [(f"{e.path}.{k}", ex) for k, ex in enumerate(experts)] if isinstance(experts, nn.ModuleList) else []
    shared = submodule(layer, e.shared) if e.shared is not None else None
    if shared is not None:
        parts.append((e.shared, shared))
    for path, ex in parts:
        up, down = getattr(ex, e.up, None), getattr(ex, e.down, None)
        if isinstance(up, nn.Linear) and isinstance(down, nn.Linear):
            out.append((up, f"{prefix}.{path}.{e.up}", [down], [f"{prefix}.{path}.{e.down}"]))
    return out
