"""Whether a model needs accelerate's device map: its size in a dtype from the safetensors
headers, against a GPU's free memory."""

import torch

from lowbit.models.loading import model_bytes, needs_device_map


def test_model_bytes_from_the_headers(tiny_folder):
    folder, _ = tiny_folder
    from safetensors.torch import load_file

    numel = sum(t.numel() for f in folder.glob("*.safetensors") for t in load_file(f).values())
    assert model_bytes(folder, torch.float32) == 4 * numel
    assert model_bytes(folder, torch.bfloat16) == 2 * numel


def test_a_device_map_only_for_a_gpu_too_small(tiny_folder):
    folder, _ = tiny_folder
    size = model_bytes(folder, torch.bfloat16)
    assert not needs_device_map(folder, torch.device("cpu"), torch.bfloat16, None)
    assert not needs_device_map(folder, torch.device("cuda", 0), torch.bfloat16, 10 * size)
    assert needs_device_map(folder, torch.device("cuda", 0), torch.bfloat16, size)  # no room for activations
