import dataclasses

import pytest

from lowbit.sim.hardware import load_hardware


@pytest.fixture(scope="session")
def hw():
    return load_hardware()


@pytest.fixture()
def bare_gpu(hw):
    """H100 with every overhead set to zero: a pure roofline."""
    return dataclasses.replace(hw.gpu("h100"), step_overhead_ms=0.0, seq_overhead_us=0.0)


@pytest.fixture()
def bare_kernels(hw):
    return dataclasses.replace(hw.kernels, weight_only_linear_us=0.0, activation_quant_us=0.0, layer_overhead_us=0.0)
