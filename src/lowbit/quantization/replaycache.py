"""Replay without recomputing what can no longer change.

A layer pass by replay (:func:`lowbit.util.lockstep.run_by_replay`) runs every chunk from
the layer's input once per group of Linears: to reach the MLP's ``down_proj``, each chunk
runs the whole attention block again, although every Linear in it was quantized rounds
ago.  Once all the quantized Linears inside one of the layer's direct children (the
attention module, say) are final, that child's output on a chunk is the same in every
later round — its input comes from the chunk's input through modules that are final too,
since groups are met in the order the forward runs them — so it is kept from the first
round that runs it in full and handed back, as a copy, in the rounds after, without
running the child.  The statistics, the quantized weights and the outputs stay the same
bit for bit (``tests/quantization/test_recompute.py``); the price is one output of that
child per chunk, held until the layer's pass ends.

Nothing is kept where the pass observes the KV cache (the attention's writes must run in
the final round) or where no later round would read it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_map

__all__ = ["FrozenChildren"]


def _copy(out):
    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, out)


class FrozenChildren:
    """The outputs, per chunk, of a layer's direct children whose quantized Linears are
    all final, for the rounds of one layer pass by replay.

    Args:
        layer: the decoder layer.
        groups: for each direct child that holds Linears of the pass, nothing else is
            read: ``groups_of(child)`` gives the groups (leader names) of those Linears.
        all_groups: every group of the pass.
        final_round: whether a round runs after the last group is met (the pass's outputs,
            or the KV cache observed there).
    """

    #: off: every round runs every module (the test's reference)
    enabled = True

    def __init__(self, layer: nn.Module, groups_of, all_groups: set[str], final_round: bool) -> None:
        self.children: list[tuple[nn.Module, set[str]]] = []
        for child in layer.children():
            g = groups_of(child)
            if g:
                self.children.append((child, g))
        self.all_groups = set(all_groups)
        self.final_round = final_round
        self.kept: dict[int, dict[int, object]] = {}
        self._unsafe: set[int] = set()   # children that ran twice in one chunk: never handed back
        self._frozen: list[int] = []
        self._record = False

    def start_round(self, done: set[str]) -> None:
        """A new round starts with the groups in ``done`` quantized."""
        pending = len(self.all_groups - done)
        later = pending - 1 + int(self.final_round) if pending else 0   # each round meets one group
        self._frozen = ([j for j, (_, g) in enumerate(self.children) if g <= done and j not in self._unsafe]
                        if self.enabled else [])
        self._record = later > 0

    @contextmanager
    def chunk(self, k: int) -> Iterator[None]:
        """Around chunk ``k``'s run: frozen children hand back what they gave before, or,
        where a later round will read it, keep a copy of what they give now."""
        patched: list[tuple[nn.Module, object]] = []
        try:
            for j in self._frozen:
                child = self.children[j][0]
                store = self.kept.setdefault(j, {})
                if k in store:
                    forward = (lambda *a, _out=store[k], **kw: _copy(_out))
                elif self._record:
                    forward = _recorder(child.forward, store, k, self, j)
                else:
                    continue
                patched.append((child, child.__dict__.get("forward")))
                child.forward = forward
            yield
        finally:
            for child, before in patched:
                if before is None:
                    del child.forward
                else:
                    child.forward = before


    def _disable(self, j: int) -> None:
        """Child ``j`` ran twice in one chunk: one kept output cannot stand for both calls."""
        self._unsafe.add(j)
        self.kept.pop(j, None)
        self._frozen = [f for f in self._frozen if f != j]


def _recorder(forward, store: dict, k: int, owner: FrozenChildren, j: int):
    calls = [0]

    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls[0] += 1
        if calls[0] > 1:
            owner._disable(j)
        elif j in owner.kept:
            store[k] = _copy(out)
        return out
    return run
