"""Group-relative advantage estimators: worked example, constant groups, group-id layout, properties."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from moe_gspo.losses import ADVANTAGE_ESTIMATORS, get_advantage_estimator


def test_registered_names():
    assert {"grpo", "grpo_no_std"} <= set(ADVANTAGE_ESTIMATORS)


def test_unknown_name_lists_valid():
    with pytest.raises(ValueError, match="grpo.*grpo_no_std"):
        get_advantage_estimator("nope")


def test_worked_example_population_std():
    # docs/guide/method.md: rewards [1, 0, 1, 0] -> mean 0.5, population std 0.5 -> A = [+1, -1, +1, -1]
    adv = get_advantage_estimator("grpo")(torch.tensor([[1.0, 0.0, 1.0, 0.0]], dtype=torch.float64), eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=torch.float64), rtol=0, atol=1e-15)
    adv = get_advantage_estimator("grpo")(torch.tensor([[1.0, 0.0, 1.0, 0.0]]))  # default eps 1e-6
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0, 1.0, -1.0]]), rtol=0, atol=1e-5)
    no_std = get_advantage_estimator("grpo_no_std")(torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    torch.testing.assert_close(no_std, torch.tensor([[0.5, -0.5, 0.5, -0.5]]))


@pytest.mark.parametrize("name", ["grpo", "grpo_no_std"])
def test_constant_groups_are_exactly_zero(name):
    rewards = torch.tensor([[0.1, 0.1, 0.1], [0.7, 0.7, 0.7], [1.0, 0.0, 0.5]], dtype=torch.float64)
    adv = get_advantage_estimator(name)(rewards)
    assert torch.isfinite(adv).all()
    assert (adv[:2] == 0).all()
    assert (adv[2] != 0).any()
    # a group of one, via group ids
    adv = get_advantage_estimator(name)(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([5, 9, 9]))
    assert adv[0] == 0 and torch.isfinite(adv).all()


def test_nonfinite_rewards_raise():
    with pytest.raises(ValueError, match="rewards"):
        get_advantage_estimator("grpo")(torch.tensor([[1.0, float("nan")]]))


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="num_groups"):
        get_advantage_estimator("grpo")(torch.ones(4))
    with pytest.raises(ValueError, match="group_ids"):
        get_advantage_estimator("grpo")(torch.ones(4), torch.zeros(3, dtype=torch.long))


@settings(max_examples=25, deadline=None)
@given(
    num_groups=st.integers(1, 5),
    group_size=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    name=st.sampled_from(["grpo", "grpo_no_std"]),
)
def test_group_ids_layout_matches_2d_and_properties(num_groups, group_size, seed, name):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (num_groups, group_size), generator=g).double() / 2  # ties are common
    fn = get_advantage_estimator(name)
    adv_2d = fn(rewards)
    # shuffled flat layout with arbitrary, non-contiguous group ids
    perm = torch.randperm(num_groups * group_size, generator=g)
    ids = (torch.arange(num_groups) * 7 + 3).repeat_interleave(group_size)
    adv_flat = fn(rewards.flatten()[perm], ids[perm])
    torch.testing.assert_close(adv_flat, adv_2d.flatten()[perm], rtol=0, atol=1e-12)
    # independent reference: population std, all-equal -> 0
    for k in range(num_groups):
        r = rewards[k]
        if (r == r[0]).all():
            assert (adv_2d[k] == 0).all()
            continue
        expected = r - r.mean()
        if name == "grpo":
            expected = expected / (r.std(unbiased=False) + 1e-6)
        torch.testing.assert_close(adv_2d[k], expected, rtol=0, atol=1e-12)
        assert abs(adv_2d[k].sum()) < 1e-12
