"""Bit packing: docs/references.md §3 worked examples, round trips, and compressed-tensors' own
unpackers as the reference."""

import pytest
import torch

from lowbit.numerics import formats as F
from lowbit.numerics.pack import pack_int32, pack_nibbles, unpack_int32, unpack_nibbles


def test_int4_worked_example():
    words = pack_int32(torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7]]), 4)
    assert words.dtype == torch.int32 and words.shape == (1, 1)
    assert int(words[0, 0]) & 0xFFFFFFFF == 0xFCBA9810


def test_fp4_worked_examples():
    codes = F.FP4_E2M1.encode(torch.tensor([[0.5, -1.0, 6.0, -0.0]]))
    assert pack_nibbles(codes).tolist() == [[0xA1, 0x87]]


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_int_round_trip_ragged(bits, dim):
    g = torch.Generator().manual_seed(bits)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1)
    v = torch.randint(lo, hi, (13, 21), generator=g)  # neither dim divides 32 / bits
    words = pack_int32(v, bits, dim)
    k = 32 // bits
    expect = (-(-13 // k), 21) if dim == 0 else (13, -(-21 // k))
    assert words.shape == expect
    assert torch.equal(unpack_int32(words, bits, v.shape[dim], dim).long(), v)


@pytest.mark.parametrize("bits", [4, 8])
def test_int_matches_compressed_tensors(bits):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    g = torch.Generator().manual_seed(0)
    v = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (16, 64), generator=g).to(torch.int8)
    for dim in (0, 1):
        ours = pack_int32(v, bits, dim)
        assert torch.equal(ours, helpers.pack_to_int32(v, bits, packed_dim=dim))
        assert torch.equal(helpers.unpack_from_int32(ours, bits, v.shape, packed_dim=dim), v)


def test_nibbles_match_compressed_tensors():
    helpers = pytest.importorskip("compressed_tensors.compressors.nvfp4.helpers")
    codes = torch.arange(16, dtype=torch.uint8).repeat(4, 2)  # every code, both nibble positions
    codes[1] = codes[1].flip(0)
    packed = pack_nibbles(codes)
    assert torch.equal(unpack_nibbles(packed), codes)
    values = helpers.unpack_fp4_from_uint8(packed, 4, 32, dtype=torch.float32)
    assert torch.equal(values, F.FP4_E2M1.decode(codes))


def test_refusals():
    with pytest.raises(ValueError, match="divide 32"):
        pack_int32(torch.zeros(2, 8), 3)
    with pytest.raises(ValueError, match="range"):
        pack_int32(torch.tensor([[8]]), 4)
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))
