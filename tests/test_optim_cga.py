"""CGA (cosine-gated averaging) against an independent float64 reference of docs/DESIGN.md §1."""

import math
import random

import pytest
import torch

from cgad.optim import CGA


def sigma(age, alpha, cutoff):
    gate = 0.0 if age >= cutoff else 0.5 * (1 + math.cos(math.pi * age / cutoff))
    return gate * math.exp(-alpha * age)


def reference(phi0, rounds, lr, momentum, alpha, cutoff, restart_every=0):
    """Float64, written out: the weighted mean, then Nesterov (or plain) SGD."""
    phi = [p.double().clone() for p in phi0]
    buf = [torch.zeros_like(p) for p in phi]
    steps = 0
    for deliveries in rounds:
        scales = [w * sigma(a, alpha, cutoff) for _, a, w in deliveries]
        if sum(scales) == 0:
            continue
        if restart_every and steps and steps % restart_every == 0:
            buf = [torch.zeros_like(p) for p in phi]
        for i in range(len(phi)):
            weighted = [s * d[i].double() for (d, _, _), s in zip(deliveries, scales, strict=True)]
            mean = sum(weighted) / sum(scales)
            if momentum:
                buf[i] = momentum * buf[i] + mean
                phi[i] = phi[i] - lr * (mean + momentum * buf[i])
            else:
                phi[i] = phi[i] - lr * mean
        steps += 1
    return phi


def drive(phi0, rounds, **hyper):
    params = [torch.nn.Parameter(p.clone()) for p in phi0]
    opt = CGA(params, **hyper)
    for deliveries in rounds:
        for delta, age, weight in deliveries:
            for p, d in zip(params, delta, strict=True):
                p.grad = d.clone()
            opt.accumulate(age=age, weight=weight)
        opt.step()
    return params


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("restart_every", [0, 3])
def test_matches_the_float64_reference_over_mixed_ages(momentum, restart_every):
    rng = random.Random(5)
    torch.manual_seed(5)
    phi0 = [torch.randn(7, 3), torch.randn(11)]
    rounds = [
        [([torch.randn(7, 3) * 0.1, torch.randn(11) * 0.1], rng.choice([0, 1, 2, 3, 5]), rng.randint(1, 500))
         for _ in range(rng.randint(1, 4))]
        for _ in range(20)
    ]  # fmt: skip
    hyper = dict(lr=0.8, momentum=momentum, alpha=0.4, cutoff=4.0, restart_every=restart_every)
    got = drive(phi0, rounds, **hyper)
    want = reference(phi0, rounds, **hyper)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach().double(), w, rtol=1e-5, atol=1e-6)


def test_lr_one_on_fresh_deliveries_is_plain_averaging():
    phi = torch.nn.Parameter(torch.zeros(3))
    opt = CGA([phi], lr=1.0)
    for delta, weight in ((torch.tensor([1.0, 2.0, 3.0]), 1), (torch.tensor([3.0, 2.0, 1.0]), 1)):
        phi.grad = delta
        opt.accumulate(age=0, weight=weight)
    opt.step()
    torch.testing.assert_close(phi.detach(), -torch.tensor([2.0, 2.0, 2.0]))


def test_a_lone_delivery_steps_in_full_whatever_its_age_and_a_gated_one_changes_nothing():
    phi = torch.nn.Parameter(torch.zeros(2))
    opt = CGA([phi], lr=1.0, alpha=0.6, cutoff=4.0)
    phi.grad = torch.tensor([1.0, -1.0])
    assert opt.accumulate(age=2, weight=10)
    opt.step()
    torch.testing.assert_close(phi.detach(), torch.tensor([-1.0, 1.0]))  # renormalised by σ itself
    phi.grad = torch.tensor([5.0, 5.0])
    assert not opt.accumulate(age=4, weight=10)  # at the cutoff: dropped
    opt.step()
    torch.testing.assert_close(phi.detach(), torch.tensor([-1.0, 1.0]))


def test_a_stale_delivery_loses_its_share_to_the_fresh_one():
    phi = torch.nn.Parameter(torch.zeros(1))
    opt = CGA([phi], lr=1.0, alpha=0.0, cutoff=4.0)
    phi.grad = torch.tensor([1.0])
    opt.accumulate(age=0, weight=1)
    phi.grad = torch.tensor([0.0])
    opt.accumulate(age=2, weight=1)  # σ(2) = ½ with α = 0
    opt.step()
    torch.testing.assert_close(phi.detach(), torch.tensor([-1.0 / 1.5]))


def test_bad_settings_are_named():
    p = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ValueError, match="lr"):
        CGA(p, lr=0)
    with pytest.raises(ValueError, match="momentum"):
        CGA(p, momentum=1.0)
    with pytest.raises(ValueError, match="weight"):
        CGA(p).accumulate(weight=0)
