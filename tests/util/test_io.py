"""Atomic, checksummed cache entries (issue 20): a truncated, corrupted or half-written file
is never read back as valid, and the owners recompute it."""

import logging
import os
import random
import signal
import time

import pytest
import torch

from lowbit.util.io import CHECKSUM_KEY, CorruptFile, load_tensors, save_tensors


def _tensors(seed=0, n=200_000):
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, generator=g), "b": torch.randint(0, 9, (n // 4,), generator=g),
            "h": torch.randn(8, generator=g).to(torch.bfloat16)}


def test_round_trip_keeps_metadata(tmp_path):
    t = _tensors()
    save_tensors(tmp_path / "x.safetensors", t, {"tokens": "5"})
    back, meta = load_tensors(tmp_path / "x.safetensors")
    assert meta == {"tokens": "5"} and all(torch.equal(back[k], t[k]) for k in t)
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary left


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "foreign", "garbage"])
def test_damaged_entries_are_detected(tmp_path, damage):
    p = tmp_path / "x.safetensors"
    save_tensors(p, _tensors())
    raw = p.read_bytes()
    if damage == "truncate":
        p.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":  # one byte of tensor data: still a readable file
        b = bytearray(raw)
        b[-100] ^= 0xFF
        p.write_bytes(bytes(b))
    elif damage == "empty":
        p.write_bytes(b"")
    elif damage == "foreign":  # a valid safetensors file without lowbit's checksum
        from safetensors.torch import save_file

        save_file(_tensors(), str(p))
    else:
        p.write_bytes(os.urandom(4096))
    with pytest.raises(CorruptFile):
        load_tensors(p)


def _writer(path, seed):
    """In a forked child: rewrite ``path`` with fresh contents until killed."""
    torch.set_num_threads(1)
    i = 0
    while True:
        save_tensors(path, _tensors(seed + i), {"i": str(i)})
        i += 1


def test_sigkill_during_writes_never_leaves_a_readable_partial_entry(tmp_path):
    """20 writers killed at seeded random moments: the entry is absent or verifies, and its
    contents are exactly one of the written versions."""
    rng = random.Random(20)
    p = tmp_path / "x.safetensors"
    outcomes = {"absent": 0, "valid": 0}
    for k in range(20):
        if k % 4 == 0:
            p.unlink(missing_ok=True)
        pid = os.fork()
        if pid == 0:
            try:
                _writer(p, 1000 * k)
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if not p.exists():
            outcomes["absent"] += 1
            continue
        t, meta = load_tensors(p)  # raises CorruptFile if a partial file were visible
        i = int(meta["i"])
        seed = 1000 * k + i if i >= 0 else None
        ref = _tensors(seed)
        if not torch.equal(t["a"], ref["a"]):  # an earlier writer's last version
            assert any(torch.equal(t["a"], _tensors(1000 * j + i)["a"]) for j in range(k)), "unknown contents"
        outcomes["valid"] += 1
    assert outcomes["valid"] > 0
    # the temporary files a killed writer leaves are never under the entry's name
    others = [q.name for q in tmp_path.iterdir() if q != p]
    assert all(n.startswith(".") for n in others), others  # hidden temporaries (ours, safetensors')


def test_stream_cache_recomputes_a_corrupt_entry(tmp_path, caplog):
    from lowbit.data.windows import _cached_stream

    p = tmp_path / "tokens" / "s.safetensors"
    calls = []

    def build():
        calls.append(1)
        return {"tokens": torch.arange(1000)}

    def cached():
        return _cached_stream(p, build, {}, {"tokens"})["tokens"]

    assert torch.equal(cached(), torch.arange(1000))
    p.write_bytes(p.read_bytes()[:-10])  # truncated
    with caplog.at_level(logging.WARNING, logger="lowbit"):
        assert torch.equal(cached(), torch.arange(1000))
    assert len(calls) == 2 and "corrupt cache entry" in caplog.text
    assert torch.equal(cached(), torch.arange(1000)) and len(calls) == 2  # the new one is used


def test_reference_and_stats_refuse_damaged_files(tmp_path):
    from lowbit.evaluation.metrics import Reference
    from lowbit.quantization.calibrate import CalibStats

    ref = Reference(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3), torch.zeros(2, 3, 4, dtype=torch.int32),
                    torch.zeros(2, 3, 4))
    ref.save(tmp_path / "r.safetensors")
    assert torch.equal(Reference.load(tmp_path / "r.safetensors").nll, ref.nll)
    st = CalibStats({"l": torch.ones(4)}, {0: torch.ones(2)}, {0: torch.ones(2)}, tokens=7)
    st.save(tmp_path / "s.safetensors")
    assert CalibStats.load(tmp_path / "s.safetensors").tokens == 7
    for name, cls in (("r", Reference), ("s", CalibStats)):
        f = tmp_path / f"{name}.safetensors"
        f.write_bytes(f.read_bytes()[:-3])
        with pytest.raises(CorruptFile):
            cls.load(f)
    save_tensors(tmp_path / "w.safetensors", {"tokens": torch.arange(3)})  # intact, but not a reference
    with pytest.raises(CorruptFile, match="not a reference"):
        Reference.load(tmp_path / "w.safetensors")
    assert CHECKSUM_KEY.startswith("lowbit")
