"Two-process gloo run of the pass@k evaluation loop, and estimator properties beyond the notebook."

import json, os, subprocess, sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanorl.evaluate import PassAtK, pass_at_k, pass_at_k_first
from nanorl.rollout import problem_seed


def test_two_ranks_equal_one_process(tmp_path):
    "torchrun with 2 gloo processes gives the same per-sample outcomes and metrics as one process."
    out = tmp_path / "result.json"
    script = Path(__file__).parent / "dist_eval_script.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert result["distributed"] == result["single"]
    assert result["distributed_metrics"] == result["single_metrics"]
    outcomes = torch.tensor(result["single"])
    assert outcomes.shape == (37, 6) and 0 < outcomes.sum() < outcomes.numel()


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 60), st.data())
def test_vectorized_equals_scalar_and_is_monotone(n, data):
    "The tensor path equals the exact scalar product, and pass@k grows with k and with c."
    k = data.draw(st.integers(1, n))
    c = torch.arange(n + 1)
    vec = pass_at_k(n, c, k)
    scal = torch.tensor([pass_at_k(n, int(ci), k) for ci in c], dtype=torch.float64)
    torch.testing.assert_close(vec, scal, rtol=0, atol=1e-12)
    assert (vec.diff() >= -1e-12).all()
    if k < n:
        assert (pass_at_k(n, c, k + 1) >= vec - 1e-12).all()


def test_unbiased_matches_mean_of_first_k_over_orderings():
    "Averaging nanochat's first-k estimate over all orderings of the samples gives the unbiased estimator."
    import itertools

    samples = [1, 0, 0, 1, 0]
    for k in range(1, 6):
        perms = list(itertools.permutations(samples))
        mean_first = pass_at_k_first(torch.tensor(perms), k).mean().item()
        assert abs(mean_first - pass_at_k(5, 2, k)) < 1e-12


def test_numpy_ints_and_seeds():
    assert pass_at_k(10, np.int64(3), 2) == pytest.approx(1 - 21 / 45)
    seeds = {problem_seed(42, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**31 for s in seeds)
    assert problem_seed(42, 5) != problem_seed(43, 5) and problem_seed(42, 5) == problem_seed(42, 5)


def test_metrics_keys_and_counts():
    r = PassAtK(torch.tensor([[1, 0, 0], [0, 0, 0]]).bool())
    assert r.ks == (1, 2, 3) and r.counts.tolist() == [1, 0]
    m = r.metrics()
    assert m["pass@3"] == pytest.approx(0.5) and m["pass@1"] == pytest.approx(1 / 6)
