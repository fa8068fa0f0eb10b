"""``--device`` / ``--dtype`` parsing and checking, the memory-aware batch size, cache keys."""

import pytest
import torch

from lowbit.util import device as D


def test_dtypes_by_name():
    assert D.parse_dtype("fp32") is torch.float32
    assert D.parse_dtype("BF16") is torch.bfloat16
    assert D.parse_dtype("float16") is torch.float16
    assert D.parse_dtype(torch.bfloat16) is torch.bfloat16
    assert D.dtype_name(torch.bfloat16) == "bf16"
    with pytest.raises(ValueError, match="unknown dtype 'fp64'; use one of fp32, bf16, fp16"):
        D.parse_dtype("fp64")
    with pytest.raises(ValueError, match="not supported"):
        D.parse_dtype(torch.float64)


def test_devices_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert D.resolve_device(None) == D.resolve_device("cpu") == torch.device("cpu")
    assert D.resolve_device("auto") == torch.device("cpu")
    for name in ("cuda", "cuda:0", "CUDA:1"):
        with pytest.raises(ValueError, match="sees no CUDA GPU on this machine.*use --device cpu"):
            D.resolve_device(name)
    with pytest.raises(ValueError, match="unknown device 'tpu'; use cpu, cuda, cuda:N or auto"):
        D.resolve_device("tpu")
    with pytest.raises(ValueError, match="GPU index must be a number"):
        D.resolve_device("cuda:x")


def test_devices_with_two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.resolve_device("auto") == torch.device("cuda:0")
    assert D.resolve_device("cuda") == torch.device("cuda:0")
    assert D.resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ValueError, match=r"has 2 CUDA GPU\(s\) \(cuda:0..cuda:1\)"):
        D.resolve_device("cuda:2")


def test_batch_from_free_memory():
    assert D.fit_batch(None, 10, 50) == 1  # the CPU: no memory figure
    assert D.fit_batch(1000, 100, 50) == 5  # half of 1000 bytes at 100 each
    assert D.fit_batch(10**12, 100, 50) == 50  # never more than the windows
    assert D.fit_batch(10**12, 100, 500) == D.MAX_BATCH
    assert D.fit_batch(10, 100, 50) == 1  # at least one
    with pytest.raises(ValueError, match="must be positive"):
        D.fit_batch(1000, 0, 5)


def test_default_settings_add_nothing_to_cache_keys():
    assert D.setting_key(torch.device("cpu"), torch.float32) == ()
    assert D.setting_key(None, None) == ()
    assert D.setting_key(torch.device("cpu"), torch.bfloat16) == ("device=cpu", "dtype=bf16")
    assert D.setting_key(torch.device("cuda", 1), torch.float32) == ("device=cuda", "dtype=fp32")


def test_move_reaches_nested_tensors():
    kw = {"position_embeddings": (torch.ones(2), torch.zeros(2)), "mask": [torch.ones(1)], "flag": True}
    out = D.move(kw, torch.device("meta"))
    assert out["position_embeddings"][0].is_meta and out["mask"][0].is_meta and out["flag"] is True
