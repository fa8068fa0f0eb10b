"""The vLLM environment for the ``vllm`` tier, created with ``make vllm`` when it is missing."""

import subprocess

import pytest

from lowbit.engines import venv


@pytest.fixture(scope="module")
def vllm_python():
    if not (venv.default_venv() / ".installed").exists():
        r = subprocess.run(["make", "-C", str(venv.repo_root()), "vllm"], capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return venv.find_vllm_python()
