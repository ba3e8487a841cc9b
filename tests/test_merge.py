"""The merge of a round's deliveries, Σ w·σ(τ)·Δ / Σ w, and the registry of outer methods."""

import math

import pytest
import torch

from cgad.node.config import OPTIMIZERS, OuterOptions
from cgad.node.member.methods import METHODS, method
from cgad.node.sim.config import SimConfig
from cgad.optim import AUTO_LR_SCALE, merge, staleness_weight


def test_merge_by_hand_with_mixed_ages_tokens_and_a_gated_delivery():
    own = torch.tensor([1.0, 2.0])  # age 0, 100 tokens
    late = torch.tensor([3.0, 0.0])  # age 2, 300 tokens
    gated = torch.tensor([1e6, -1e6])  # age 4 = cutoff: σ = 0, in neither sum
    scales = [staleness_weight(age, alpha=0.6, cutoff=4.0) for age in (0, 2, 4)]
    # σ(2) = ½(1 + cos(π·2/4))·e^(−1.2) = 0.5·0.3011942 ; σ(4) = 0
    assert scales == pytest.approx([1.0, 0.5 * math.exp(-1.2), 0.0])
    mean = merge([own, late, gated], [100, 300, 50], scales)
    s = 0.5 * math.exp(-1.2)
    expected = [(100 * 1.0 + 300 * s * 3.0) / 400, (100 * 2.0) / 400]
    torch.testing.assert_close(mean, torch.tensor(expected))


def test_merge_counts_a_tokenless_delivery_once_and_returns_none_when_all_are_gated():
    a, b = torch.tensor([2.0]), torch.tensor([4.0])
    torch.testing.assert_close(merge([a, b], [0, 1], [1.0, 1.0]), torch.tensor([3.0]))
    assert merge([a, b], [10, 10], [0.0, 0.0]) is None
    assert merge([], [], []) is None


def test_merge_refuses_mismatched_or_negative_input():
    with pytest.raises(ValueError, match="deltas"):
        merge([torch.zeros(1)], [1, 2], [1.0])
    with pytest.raises(ValueError, match="scales"):
        merge([torch.zeros(1)], [1], [-0.5])
    with pytest.raises(ValueError, match="scales"):
        merge([torch.zeros(1)], [1], [float("nan")])


def test_one_method_per_name_each_knowing_its_lr_and_whether_it_ages():
    assert tuple(METHODS) == OPTIMIZERS
    options = OuterOptions()
    assert {n for n, m in METHODS.items() if m.age_aware} == {"cga", "cgad", "pa-cgad", "adam-decay", "adam"}
    assert method("nesterov").lr(options) == 0.7
    assert method("cga").lr(options) == 1.0
    run = SimConfig(inner_steps=10, inner_lr=1e-3)
    assert method("cgad").lr(run) == pytest.approx(AUTO_LR_SCALE * 10 * 1e-3)  # follows H × inner lr
    assert method("cgad").lr(run.model_copy(update={"inner_steps": 50})) == pytest.approx(
        AUTO_LR_SCALE * 5e-2
    )
    assert method("cgad").lr(OuterOptions(outer_lr=0.3)) == 0.3
    with pytest.raises(ValueError, match="needs inner_steps"):
        method("cgad").lr(options)
    assert method("cgad").scale(4, options) == 0.0  # gated at the cutoff
    assert method("adam-decay").scale(4, options) == pytest.approx(math.exp(-0.6 * 4))  # no gate
    assert method("adam").scale(50, options) == 1.0
    assert method("noloco").mixes_params and not method("sgd").mixes_params
    with pytest.raises(ValueError, match="unknown optimizer 'adamw'"):
        method("adamw")


def test_cgad_and_pa_cgad_are_one_family_and_local_shares_nothing():
    assert method("pa-cgad").family == method("cgad").family == "cgad"
    assert method("sgd").family == "sgd"
    assert not method("local").shares and method("cgad").shares
