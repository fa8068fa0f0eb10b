"""The A100-40GB Llama-3.1-8B knee (docs/references.md §6), in AccelMark's configuration (see benchmarks/sim_validation.py)."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sim_validation as sv  # noqa: E402


def test_knee_p50_flat_p99_grows_more_than_10x_by_slot_queueing():
    sc = sv.scenario("llama-3.1-8b", "bf16", "a100-40gb", max_num_seqs=256)
    out = sv.accel_output(1.0)
    p50_10, p99_10, _ = sv.accel_online(sc, 10, out)
    p50_25, p99_25, _ = sv.accel_online(sc, 25, out)
    assert p50_25 < 2 * p50_10
    assert p99_25 > 10 * p99_10
    # not KV: nothing is preempted; slots: with 512 sequences the tail is gone
    runs = [sc.run(sv.Workload(25, 300, sv.ACCEL_PROMPT, out, seed=s, normalize=False)) for s in (0, 1, 2)]
    assert sum(int(r.preemptions.sum()) for r in runs) == 0
    wide = sv.scenario("llama-3.1-8b", "bf16", "a100-40gb", max_num_seqs=512)
    assert sv.accel_online(wide, 25, out)[1] < p99_25 / 3
    # the output model reproduces the measured mean it was set from
    x = out.sample(200_000, np.random.default_rng(1))
    assert abs(x.mean() - sv.ACCEL_OUTPUT_MEAN) < 5 and x.max() == 512
