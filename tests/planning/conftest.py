"""A bench on a tiny Llama built from a config (random weights, seeded), its config.json on disk
for the target's shape, and a short load for the real simulator.  Module-scoped: the tests of
one module share the bench's reference, row and simulation caches, as repeated plans do."""

import pytest
import torch

from lowbit.evaluation.compare import Workbench
from lowbit.models.loading import ModelInfo
from lowbit.planning import Load
from lowbit.sim.metrics import SLO
from lowbit.sim.workload import Lengths


from tinymodels import tiny_llama as _tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    model = _tiny_llama()
    model.config.save_pretrained(tmp / "model")
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(0, 256, (6, 24), generator=g)
    calib = torch.randint(0, 256, (4, 24), generator=g)
    info = ModelInfo("tiny-llama", tmp / "model", False, "")
    return Workbench(model, None, info, windows, calib, "synthetic", 0, tmp / "cache", kl_topk=64, progress=False,
                     workers=1)


@pytest.fixture(scope="module")
def load():
    """A short load: few requests and one seed keep the real simulator fast."""
    return Load(Lengths.fixed(512), Lengths.fixed(64), SLO(ttft=1.0, tpot=0.04), n_requests=200, seeds=(0,))
