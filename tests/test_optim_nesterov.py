"""Outer Nesterov, Delayed Nesterov and NoLoCo against torch and float64 references."""

import copy

import pytest
import torch

from cgad.optim import DelayedNesterov, OuterNesterov, noloco_update


def grads_sequence(n, shape=(6, 4), seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=dtype) * 0.05 for _ in range(n)]


def run(opt, p, grads):
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


@pytest.mark.parametrize("momentum", [0.9, 0.5])
def test_outer_nesterov_equals_torch_sgd(momentum):
    phi0 = torch.randn(6, 4)
    grads = grads_sequence(30, dtype=torch.float32)
    ours = torch.nn.Parameter(phi0.clone())
    theirs = torch.nn.Parameter(phi0.clone())
    run(OuterNesterov([ours], lr=0.7, momentum=momentum), ours, grads)
    run(torch.optim.SGD([theirs], lr=0.7, momentum=momentum, nesterov=True, foreach=True), theirs, grads)
    assert torch.equal(ours, theirs)


def test_zero_momentum_is_plain_outer_sgd():
    phi0 = torch.randn(6, 4, dtype=torch.float64)
    grads = grads_sequence(5)
    p = torch.nn.Parameter(phi0.clone())
    opt = OuterNesterov([p], lr=0.5, momentum=0.0)
    got = run(opt, p, grads)
    torch.testing.assert_close(got, phi0 - 0.5 * sum(grads))
    assert "momentum_buffer" not in opt.state[p]


def reference_delayed_nesterov(phi0, grads, *, lr, momentum, period, restart_every=0):
    phi = phi0.clone()
    m = torch.zeros_like(phi)
    buf = torch.zeros_like(phi)
    for k, g in enumerate(grads, start=1):
        if restart_every and k > 1 and (k - 1) % restart_every == 0:
            m = torch.zeros_like(phi)
        buf = buf + g
        if k % period:
            phi = phi - lr * g / period
        else:
            m = momentum * m + buf / period
            phi = phi - lr * (g / period + momentum * m)
            buf = torch.zeros_like(phi)
    return phi


@pytest.mark.parametrize("period", [1, 2, 3])
def test_delayed_nesterov_matches_reference(period):
    phi0 = torch.randn(6, 4, dtype=torch.float64)
    grads = grads_sequence(13)
    p = torch.nn.Parameter(phi0.clone())
    got = run(DelayedNesterov([p], lr=0.7, momentum=0.9, period=period), p, grads)
    want = reference_delayed_nesterov(phi0, grads, lr=0.7, momentum=0.9, period=period)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_delayed_nesterov_period_one_equals_outer_nesterov():
    phi0 = torch.randn(6, 4)
    grads = grads_sequence(20, dtype=torch.float32)
    a, b = torch.nn.Parameter(phi0.clone()), torch.nn.Parameter(phi0.clone())
    run(DelayedNesterov([a], period=1), a, grads)
    run(OuterNesterov([b]), b, grads)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_momentum_restart():
    phi0 = torch.randn(6, 4, dtype=torch.float64)
    grads = grads_sequence(11)
    want = reference_delayed_nesterov(phi0, grads, lr=0.7, momentum=0.9, period=1, restart_every=4)
    p = torch.nn.Parameter(phi0.clone())
    torch.testing.assert_close(
        run(OuterNesterov([p], restart_every=4), p, grads), want, rtol=1e-12, atol=1e-12
    )
    q = torch.nn.Parameter(phi0.clone())
    got = run(DelayedNesterov([q], period=1, restart_every=4), q, grads)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(want, reference_delayed_nesterov(phi0, grads, lr=0.7, momentum=0.9, period=1))


@pytest.mark.parametrize(
    "make", [lambda ps: OuterNesterov(ps, restart_every=3), lambda ps: DelayedNesterov(ps, period=2)]
)
def test_state_dict_round_trip(make):
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = make(params)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = make(twins)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    for _ in range(3):
        for p, q in zip(params, twins, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        fresh.step()
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda ps: OuterNesterov(ps, lr=0), "lr"),
        (lambda ps: OuterNesterov(ps, momentum=1.0), "momentum"),
        (lambda ps: OuterNesterov(ps, restart_every=-2), "restart_every"),
        (lambda ps: DelayedNesterov(ps, period=0), "period"),
        (lambda ps: DelayedNesterov(ps, momentum=-0.1), "momentum"),
    ],
)
def test_bad_arguments(make, match):
    with pytest.raises(ValueError, match=match):
        make([torch.nn.Parameter(torch.zeros(2))])


def test_noloco_matches_reference():
    gen = torch.Generator().manual_seed(3)
    shapes = [(4, 3), (5,)]

    def rand():
        return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]

    phi, delta, mean_phi, mean_delta, mom = rand(), rand(), rand(), rand(), rand()
    want_mom = [
        0.5 * d - 0.7 * md - 0.7 * (p - mp)
        for d, md, p, mp in zip(mom, mean_delta, phi, mean_phi, strict=True)
    ]
    want_phi = [p + d for p, d in zip(phi, want_mom, strict=True)]
    new_phi, new_mom = noloco_update(
        [p.clone() for p in phi], delta, mean_phi, mean_delta, [m.clone() for m in mom], lr=0.7, beta=0.5
    )
    for got, want in zip(new_phi + new_mom, want_phi + want_mom, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_noloco_without_group_is_a_local_momentum_step():
    phi, delta, mom = (
        [torch.ones(3, dtype=torch.float64)],
        [torch.full((3,), 0.2, dtype=torch.float64)],
        [torch.full((3,), 0.1, dtype=torch.float64)],
    )
    new_phi, new_mom = noloco_update(phi, delta, None, None, mom, lr=0.5, beta=0.5)
    torch.testing.assert_close(new_mom[0], torch.full((3,), 0.05 - 0.1, dtype=torch.float64))
    torch.testing.assert_close(new_phi[0], torch.full((3,), 1 - 0.05, dtype=torch.float64))
    assert new_phi[0] is phi[0]  # in place


def test_noloco_bad_arguments():
    t = [torch.zeros(2)]
    with pytest.raises(ValueError, match="lr"):
        noloco_update(t, t, None, None, [torch.zeros(2)], lr=0)
    with pytest.raises(ValueError, match="beta"):
        noloco_update(t, t, None, None, [torch.zeros(2)], beta=1.5)
    with pytest.raises(ValueError, match="as many tensors"):
        noloco_update(t, t, [torch.zeros(2), torch.zeros(2)], None, [torch.zeros(2)])
