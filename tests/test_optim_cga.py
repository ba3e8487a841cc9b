"""CGA (cosine-gated averaging) against an independent float64 reference of docs/DESIGN.md §1."""

import math
import random

import pytest
import torch

from cgad.optim import CGA


def sigma(age, alpha, cutoff):
    gate = 0.0 if age >= cutoff else 0.5 * (1 + math.cos(math.pi * age / cutoff))
    return gate * math.exp(-alpha * age)


def reference(phi0, rounds, lr, momentum, alpha, cutoff, restart_every=0, shares=None, freshness=1.0):
    """Float64, written out: the weighted mean, then Nesterov (or plain) SGD; with ``shares`` (one
    per round) the momentum is scaled by the running freshness."""
    phi = [p.double().clone() for p in phi0]
    buf = [torch.zeros_like(p) for p in phi]
    steps, started = 0, False
    for n, deliveries in enumerate(rounds):
        scales = [w * sigma(a, alpha, cutoff) for _, a, w in deliveries]
        if sum(scales) == 0:
            continue
        if shares is not None:
            freshness = 0.5 * freshness + 0.5 * shares[n]
        mu = momentum * freshness
        if restart_every and steps and steps % restart_every == 0:
            buf = [torch.zeros_like(p) for p in phi]
        started = started or mu != 0  # the buffer starts (from zero) with the momentum
        for i in range(len(phi)):
            weighted = [s * d[i].double() for (d, _, _), s in zip(deliveries, scales, strict=True)]
            mean = sum(weighted) / sum(scales)
            if momentum and started:
                buf[i] = mu * buf[i] + mean
                phi[i] = phi[i] - lr * (mean + mu * buf[i])
            else:
                phi[i] = phi[i] - lr * mean
        steps += 1
    return phi


def drive_accumulating(phi0, rounds, shares=None, **hyper):
    """Each round's deliveries through ``accumulate``, then ``step``: the parameters and the optimizer."""
    params = [torch.nn.Parameter(p.clone()) for p in phi0]
    opt = CGA(params, **hyper)
    for n, deliveries in enumerate(rounds):
        for delta, age, weight in deliveries:
            for p, d in zip(params, delta, strict=True):
                p.grad = d.clone()
            opt.accumulate(age=age, weight=weight)
        opt.step(fresh_share=None if shares is None else shares[n])
    return params, opt


def drive(phi0, rounds, shares=None, **hyper):
    return drive_accumulating(phi0, rounds, shares, **hyper)[0]


def drive_deliveries(phi0, rounds, shares=None, **hyper):
    """``drive`` through ``step_deliveries``: each round's deliveries in one call, no sum held."""
    params = [torch.nn.Parameter(p.clone()) for p in phi0]
    opt = CGA(params, **hyper)
    for n, deliveries in enumerate(rounds):
        opt.step_deliveries(
            params,
            [delta for delta, _, _ in deliveries],
            ages=[age for _, age, _ in deliveries],
            weights=[weight for _, _, weight in deliveries],
            fresh_share=None if shares is None else shares[n],
        )
        assert all("sum" not in opt.state[p] for p in params)
    return params, opt


def random_rounds(seed, count=20):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    return [
        [([torch.randn(7, 3) * 0.1, torch.randn(11) * 0.1], rng.choice([0, 1, 2, 3, 5]), rng.randint(1, 500))
         for _ in range(rng.randint(1, 4))]
        for _ in range(count)
    ]  # fmt: skip


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("restart_every", [0, 3])
def test_matches_the_float64_reference_over_mixed_ages(momentum, restart_every):
    phi0 = [torch.randn(7, 3), torch.randn(11)]
    rounds = random_rounds(5)
    hyper = dict(lr=0.8, momentum=momentum, alpha=0.4, cutoff=4.0, restart_every=restart_every)
    got = drive(phi0, rounds, **hyper)
    want = reference(phi0, rounds, **hyper)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach().double(), w, rtol=1e-5, atol=1e-6)


def test_momentum_follows_the_running_freshness():
    phi0 = [torch.randn(7, 3), torch.randn(11)]
    rounds = random_rounds(6)
    shares = [random.Random(n).choice([0.0, 1 / 3, 2 / 3, 1.0]) for n in range(len(rounds))]
    hyper = dict(lr=1.0, momentum=0.5, alpha=0.4, cutoff=4.0, freshness=0.0)
    got = drive(phi0, rounds, shares=shares, **hyper)
    want = reference(phi0, rounds, shares=shares, **hyper)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach().double(), w, rtol=1e-5, atol=1e-6)
    # and the scaling matters: the same rounds with fixed momentum end elsewhere
    fixed = reference(phi0, rounds, lr=1.0, momentum=0.5, alpha=0.4, cutoff=4.0)
    assert not torch.allclose(got[0].detach().double(), fixed[0], atol=1e-4)


def test_a_node_never_seeing_a_fresh_peer_takes_no_momentum():
    """Shares of 0 from the start (alone, or every delivery late): exactly μ = 0's steps."""
    phi0 = [torch.randn(7, 3), torch.randn(11)]
    rounds = random_rounds(7)
    got = drive(phi0, rounds, shares=[0.0] * len(rounds), lr=1.0, momentum=0.9, freshness=0.0)
    want = drive(phi0, rounds, lr=1.0, momentum=0.0)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_the_momentum_buffer_is_made_only_when_the_momentum_starts():
    """A peer alone holds no buffer (4 bytes a parameter); the first fresh share makes one."""
    phi0 = [torch.randn(7, 3), torch.randn(11)]
    rounds = random_rounds(5)
    alone = [0.0] * len(rounds)
    params, opt = drive_accumulating(phi0, rounds, shares=alone, lr=1.0, momentum=0.9, freshness=0.0)
    assert all("momentum" not in opt.state[p] for p in params)
    assert "momentum" not in {k for s in opt.state_dict()["state"].values() for k in s}
    for p, d in zip(params, rounds[0][0][0], strict=True):
        p.grad = d.clone()
    opt.accumulate(age=0, weight=1.0)
    opt.step(fresh_share=1.0)
    assert all(opt.state[p]["momentum"].abs().sum() > 0 for p in params)


def test_freshness_moves_only_in_the_groups_that_step_and_survives_a_state_dict():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = CGA([{"params": [a]}, {"params": [b]}], momentum=0.5, freshness=0.0)
    a.grad = torch.ones(3)
    opt.accumulate()
    opt.step(fresh_share=1.0)
    assert [g["freshness"] for g in opt.param_groups] == [0.5, 0.0]
    again = CGA([{"params": [a]}, {"params": [b]}], momentum=0.5, freshness=0.0)
    again.load_state_dict(opt.state_dict())
    assert [g["freshness"] for g in again.param_groups] == [0.5, 0.0]
    assert again.momentum_now() == 0.5 * (0.5 + 0.0) / 2
    # a state saved before the freshness existed: the loading optimizer's own start (0), not 1
    old = opt.state_dict()
    for group in old["param_groups"]:
        del group["freshness"]
    again.load_state_dict(old)
    assert again.momentum_now() == 0.0
    with pytest.raises(ValueError, match="fresh_share"):
        opt.step(fresh_share=1.5)
    with pytest.raises(ValueError, match="freshness"):
        CGA([a], freshness=-0.1)


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


def test_the_functional_core_is_the_optimizers_step():
    """``cga_update`` on plain tensors moves φ as ``CGA.step`` does (momentum and freshness too)."""
    from cgad.optim.cga import cga_update, running_freshness

    torch.manual_seed(0)
    phi = [torch.randn(5), torch.randn(2, 3)]
    deltas = [[torch.randn_like(p) for p in phi] for _ in range(3)]
    params = [p.clone() for p in phi]
    optimizer = CGA(params, lr=0.8, momentum=0.5, freshness=0.0)
    plain, buffers, r = [p.clone() for p in phi], [torch.zeros_like(p) for p in phi], 0.0
    for round_ in deltas:
        for p, d in zip(params, round_, strict=True):
            p.grad = d
        optimizer.accumulate(age=0, weight=1.0)
        optimizer.step(fresh_share=1.0)
        r = running_freshness(r, 1.0)
        cga_update(plain, round_, buffers, lr=0.8, mu=0.5 * r)
    for a, b in zip(params, plain, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("restart_every", [0, 3])
def test_stepping_on_the_deliveries_is_accumulating_then_stepping(momentum, restart_every):
    """``step_deliveries`` (what the member's step takes: no model-sized sum) moves φ as the
    float64 reference and as ``accumulate`` + ``step`` do, with mixed ages, gated deliveries,
    restarts and a running freshness, and leaves the same state."""
    phi0 = [torch.randn(7, 3), torch.randn(11)]
    rounds = random_rounds(8)
    shares = [random.Random(n).choice([0.0, 0.5, 1.0]) for n in range(len(rounds))]
    hyper = dict(lr=0.8, momentum=momentum, alpha=0.4, cutoff=4.0, restart_every=restart_every, freshness=0.0)
    got, opt = drive_deliveries(phi0, rounds, shares=shares, **hyper)
    want = reference(phi0, rounds, shares=shares, **hyper)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.detach().double(), w, rtol=1e-5, atol=1e-6)
    _, accumulated = drive_accumulating(phi0, rounds, shares=shares, **hyper)
    ours, theirs = opt.state_dict(), accumulated.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    for i, state in theirs["state"].items():
        assert state.keys() == ours["state"][i].keys()
        if "momentum" in state:
            torch.testing.assert_close(ours["state"][i]["momentum"], state["momentum"], rtol=1e-5, atol=1e-6)


def test_stepping_on_deliveries_checks_what_it_is_given():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))
    opt = CGA([{"params": [a]}, {"params": [b]}], momentum=0.5)
    with pytest.raises(ValueError, match="one of this optimizer's param groups"):
        opt.step_deliveries([a, b], [[torch.ones(3), torch.ones(2)]], ages=[0], weights=[1])
    with pytest.raises(ValueError, match="one of this optimizer's param groups"):
        opt.step_deliveries([torch.nn.Parameter(torch.zeros(3))], [[torch.ones(3)]], ages=[0], weights=[1])
    with pytest.raises(ValueError, match="weight"):
        opt.step_deliveries([a], [[torch.ones(3)]], ages=[0], weights=[0])
    with pytest.raises(ValueError, match="tensors for 1 parameters"):
        opt.step_deliveries([a], [[torch.ones(3), torch.ones(3)]], ages=[0], weights=[1])
    with pytest.raises(ValueError, match="2 ages"):
        opt.step_deliveries([a], [[torch.ones(3)]], ages=[0, 1], weights=[1])
    # every delivery at the cutoff: nothing moves, the freshness neither
    assert not opt.step_deliveries([a], [[torch.ones(3)]], ages=[4], weights=[1], fresh_share=1.0)
    assert a.abs().sum() == 0 and opt.param_groups[0]["freshness"] == 1.0
    assert opt.step_deliveries([a], [[torch.ones(3)]], ages=[0], weights=[1], fresh_share=0.0)
    # μ' = 0.5 · 0.5: φ moves by Δ̄ + μ'·b = 1.25
    assert torch.allclose(a, torch.full((3,), -1.25)) and opt.param_groups[0]["freshness"] == 0.5


def test_low_precision_params_take_the_whole_update_at_once():
    """bfloat16 φ: eight deliveries of 0.006 move φ = 1 by their mean once (added one at a time,
    each would round away)."""
    phi = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = CGA([phi], lr=1.0, momentum=0.5)
    deliveries = [[torch.full((4,), 0.006)] for _ in range(8)]
    assert opt.step_deliveries([phi], deliveries, ages=[0] * 8, weights=[1] * 8)
    want = torch.ones(4) - 0.006 * 1.5  # μ' = 0.5 (freshness 1), b = Δ̄: Δ̄ + μ'·b
    torch.testing.assert_close(phi.float(), want.bfloat16().float())
    with pytest.raises(ValueError, match="param groups"):
        opt.step_deliveries([], [], ages=[], weights=[])
