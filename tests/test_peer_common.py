"""benchmarks/_peer_common.max_group_levels, the check that a peer's dense export (AutoRound's `fake`
format, GPTQModel's dequantized weights) really lies on a ``bits``-bit grid, ragged last group included."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _peer_common import max_group_levels  # noqa: E402

from lowbit.numerics.qtensor import dequantize, quantize  # noqa: E402
from lowbit.numerics.scheme import get_scheme  # noqa: E402


def test_a_weight_on_the_int4_g128_grid_has_at_most_16_levels_per_group_ragged_edge_included():
    w = torch.randn(32, 576, generator=torch.Generator().manual_seed(0))   # 576 = 4 x 128 + 64
    wq = dequantize(quantize(w, get_scheme("int4-g128-signed")))
    assert max_group_levels(wq, 128) <= 16
    assert max_group_levels(w, 128) == 128                                   # float weights: every value distinct


def test_the_count_is_per_row_and_group_and_the_ragged_group_counts_its_own_columns():
    w = torch.zeros(2, 576)
    w[1, 512:529] = torch.arange(17.0)                  # 17 distinct values in the ragged group (64 columns)
    assert max_group_levels(w, 128) == 17
    assert max_group_levels(w[:, :512], 128) == 1
    w[0, 100:300] = torch.arange(200.0)                 # spans groups 0 (28 values + zeros) and 1 (128 values)
    assert max_group_levels(w, 128) == 128
    w2 = torch.zeros(2, 256)
    w2[0, :16], w2[1, :128] = torch.arange(16.0), 100 + torch.arange(128.0) % 16   # 32 values in the group, 16 per row
    assert max_group_levels(w2, 128) == 16


def test_in_activation_order_a_group_is_the_columns_sharing_a_g_idx_entry():
    """GPTQ in activation order (desc_act) quantizes columns in a permuted order, so group g holds the
    columns with g_idx == g, scattered over the row: a dequantized weight on the grid then has up to
    16 levels per g_idx group but more per contiguous run (GPTQModel's desc side failed on that)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 256, generator=gen)
    perm = torch.randperm(256, generator=gen)
    wq = dequantize(quantize(w[:, perm], get_scheme("int4-g64-signed")))     # quantized in permuted order
    w_back = torch.empty_like(wq)
    w_back[:, perm] = wq                                                      # stored in the original order
    g_idx = torch.empty(256, dtype=torch.long)
    g_idx[perm] = torch.arange(256) // 64
    assert max_group_levels(w_back, 64, g_idx) <= 16
    assert max_group_levels(w_back, 64) > 16
    assert max_group_levels(w, 64, g_idx) == 64                               # float weights: every value distinct


def test_every_peer_worker_defines_every_global_name_its_functions_read():
    """The workers run only in the peers' venvs, so a name used but never imported (GPTQModel's worker
    once called max_group_levels without importing it, failing after its whole quantization) shows here."""
    import ast
    import builtins

    for path in sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("_*_worker.py")):
        tree = ast.parse(path.read_text())
        defined = set(dir(builtins)) | {"__file__", "__name__"}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                defined.add(node.id)
            elif isinstance(node, ast.arg):
                defined.add(node.arg)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                defined.add(node.name)
        read = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
        assert not read - defined, f"{path.name} reads names it never defines or imports: {sorted(read - defined)}"
