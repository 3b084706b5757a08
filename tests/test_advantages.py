"Property tests for nanorl.advantages beyond the notebook's examples, and the policy gradient they feed."

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanorl.advantages import (
    ADVANTAGE_METHODS,
    as_groups,
    compute_advantages,
    mean_advantages,
    zero_signal_groups,
    zscore_advantages,
)

groups = st.integers(1, 5).flatmap(
    lambda g: st.integers(2, 6).flatmap(
        lambda n: st.tuples(st.just(n), st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=g * n, max_size=g * n))
    )
)


@settings(max_examples=60, deadline=None)
@given(groups)
def test_each_group_only_sees_itself(case):
    "Changing one group's rewards leaves every other group's advantages unchanged, for every method."
    n, flat = case
    r = torch.tensor(flat)
    for method in ADVANTAGE_METHODS:
        base = compute_advantages(r, n, method)
        other = r.clone()
        other[:n] = 1.0 - other[:n]  # flip the first group only
        changed = compute_advantages(other, n, method)
        torch.testing.assert_close(changed[n:], base[n:])


@settings(max_examples=60, deadline=None)
@given(groups)
def test_zero_signal_iff_all_advantages_zero(case):
    "A group is flagged exactly when all its advantages vanish."
    n, flat = case
    flags = zero_signal_groups(flat, n)
    for method in ADVANTAGE_METHODS:
        adv = compute_advantages(flat, n, method).view(-1, n)
        assert torch.equal(flags, (adv.abs() < 1e-6).all(dim=1))


def test_zscore_is_mean_over_std():
    "z-score = mean baseline / (sample std + eps), group by group."
    r = torch.tensor([[0.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    expected = mean_advantages(r) / (r.std(dim=1, keepdim=True) + 1e-4)
    torch.testing.assert_close(zscore_advantages(r), expected)


def test_population_std_option():
    r = torch.tensor([[0.0, 2.0]])
    torch.testing.assert_close(zscore_advantages(r, unbiased=False, eps=0.0), torch.tensor([[-1.0, 1.0]]))


def test_bad_method():
    with pytest.raises(ValueError, match="method must be one of"):
        compute_advantages([0.0, 1.0], 2, "max")


@pytest.mark.parametrize("G", [2, 4, 8])
def test_score_function_estimate_with_group_baselines(G):
    """On a one-step softmax policy, mean(A * grad log pi) with nanorl's advantages is grad J (rloo, none) or
    (G - 1)/G grad J (the group mean includes the sample), each within 4 standard errors of the per-group estimates."""
    gen = torch.Generator().manual_seed(G)
    theta = torch.tensor([0.5, -0.3, 1.0, 0.0, -1.0], dtype=torch.float64)
    r = torch.tensor([1.0, 0.0, 0.3, 1.0, 0.0], dtype=torch.float64)
    pi = torch.softmax(theta, -1)
    exact = torch.func.grad(lambda th: (torch.softmax(th, -1) * r).sum())(theta)  # (K,)
    groups = 100_000 // G
    y = torch.multinomial(pi.expand(groups, -1), G, replacement=True, generator=gen)  # (groups, G)
    score = torch.nn.functional.one_hot(y, 5).double() - pi  # (groups, G, K): grad log pi(y)
    variance = {}
    for method, scale in (("none", 1.0), ("rloo", 1.0), ("mean", (G - 1) / G)):
        A = r[y] if method == "none" else as_groups(compute_advantages(r[y].flatten(), G, method), G)
        per_group = (A[..., None] * score).mean(1)  # (groups, K), independent across groups
        est, se = per_group.mean(0), per_group.std(0) / groups**0.5
        assert ((est - scale * exact).abs() <= 4 * se).all(), method
        assert not ((-est - scale * exact).abs() <= 4 * se).all(), "a flipped sign must be caught"
        variance[method] = per_group.var(0).sum().item() * G  # per answer drawn
    assert variance["rloo"] < 0.8 * variance["none"]  # the baseline shrinks the variance
