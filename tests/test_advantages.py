"Property tests for nanorl.advantages beyond the notebook's examples."

import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanorl.advantages import (
    ADVANTAGE_METHODS,
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
