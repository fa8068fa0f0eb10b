"""Where a model runs and in which float type: ``--device`` and ``--dtype``, checked.

``resolve_device("auto")`` is the first CUDA GPU when torch sees one, else the CPU;
``cuda`` / ``cuda:N`` are refused with a message when there is no such GPU.  ``parse_dtype``
maps the CLI's names (``fp32``, ``bf16``, ``fp16``) to torch dtypes.  ``fit_batch`` turns a
device's free memory and a per-window estimate into a batch size (GPUs only: the CPU path
shares windows between forked workers instead, :mod:`lowbit.util.parallel`).

``move`` sends tensors nested in tuples, lists and dicts to a device (the keyword arguments
a decoder layer is called with: position embeddings, masks).
"""

from __future__ import annotations

import torch

__all__ = ["DTYPES", "DEFAULT_DEVICE", "DEFAULT_DTYPE", "parse_dtype", "dtype_name", "resolve_device",
           "is_default", "setting_key", "free_bytes", "fit_batch", "move", "MAX_BATCH"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DEVICE = torch.device("cpu")
DEFAULT_DTYPE = torch.float32
#: the most windows one forward takes when the batch is chosen from free memory
MAX_BATCH = 64


def parse_dtype(text: str | torch.dtype) -> torch.dtype:
    """``fp32`` / ``bf16`` / ``fp16`` (or a torch dtype among them) → the torch dtype."""
    if isinstance(text, torch.dtype):
        if text not in DTYPES.values():
            raise ValueError(f"dtype {text} is not supported; use one of {', '.join(DTYPES)}")
        return text
    key = str(text).strip().lower()
    aliases = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
    key = aliases.get(key, key)
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {text!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    """The CLI's name of ``dtype`` (``fp32``, ``bf16``, ``fp16``)."""
    for k, v in DTYPES.items():
        if v == dtype:
            return k
    raise ValueError(f"dtype {dtype} is not one of {', '.join(DTYPES)}")


def resolve_device(text: str | torch.device | None) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (``None`` = ``cpu``) → a device that exists.

    Raises:
        ValueError: an unknown name, CUDA asked for where torch has none, or a GPU index
            beyond the GPUs present (each named).
    """
    if text is None:
        return DEFAULT_DEVICE
    if isinstance(text, torch.device):
        text = str(text)
    key = str(text).strip().lower()
    if key == "auto":
        return torch.device("cuda:0") if torch.cuda.is_available() else DEFAULT_DEVICE
    if key == "cpu":
        return DEFAULT_DEVICE
    if key == "cuda" or key.startswith("cuda:"):
        index = 0
        if key != "cuda":
            tail = key.split(":", 1)[1]
            if not tail.isdigit():
                raise ValueError(f"device {text!r}: the GPU index must be a number (cuda:0, cuda:1, ...)")
            index = int(tail)
        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r}: torch {torch.__version__} sees no CUDA GPU on this machine "
                             f"(CUDA build: {torch.version.cuda or 'no'}); use --device cpu")
        count = torch.cuda.device_count()
        if index >= count:
            raise ValueError(f"device {text!r}: this machine has {count} CUDA GPU(s) (cuda:0..cuda:{count - 1})")
        return torch.device("cuda", index)
    raise ValueError(f"unknown device {text!r}; use cpu, cuda, cuda:N or auto")


def is_default(device: torch.device | None, dtype: torch.dtype | None) -> bool:
    """Whether ``(device, dtype)`` is lowbit's default, CPU in fp32."""
    return (device is None or torch.device(device).type == "cpu") and (dtype is None or dtype == DEFAULT_DTYPE)


def setting_key(device: torch.device | None, dtype: torch.dtype | None) -> tuple:
    """What enters a cache key for ``(device, dtype)``: nothing for the default (keys
    computed before devices existed stay valid), else the device type and dtype — results
    on another device or in another dtype differ beyond float rounding of the default."""
    if is_default(device, dtype):
        return ()
    dev = torch.device(device or DEFAULT_DEVICE).type
    return (f"device={dev}", f"dtype={dtype_name(dtype or DEFAULT_DTYPE)}")


def free_bytes(device: torch.device) -> int | None:
    """Free memory of a CUDA device in bytes (``None`` for the CPU and other devices)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def fit_batch(free: int | None, per_window: int, n: int, *, fraction: float = 0.5, cap: int = MAX_BATCH) -> int:
    """Windows per forward: as many as ``fraction`` of ``free`` bytes holds at
    ``per_window`` bytes each, at least 1, at most ``cap`` and ``n``.  ``free=None`` (no
    memory figure: the CPU) gives 1."""
    if per_window <= 0:
        raise ValueError(f"per-window memory must be positive, got {per_window}")
    if n < 1:
        return 1
    if free is None:
        return 1
    return max(1, min(cap, n, int(free * fraction) // per_window))


def move(obj, device: torch.device):
    """``obj`` with every tensor in it (through tuples, lists and dicts) on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(move(o, device) for o in obj)
    if isinstance(obj, list):
        return [move(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: move(v, device) for k, v in obj.items()}
    return obj
