"""CGAD, Adam-Decay and PA-CGAD against an independent float64 reference of docs/DESIGN.md §1."""

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cgad.optim import CGAD, PACGAD, AdamDecay


def reference_sigma(tau, alpha, cutoff):
    gate = 0.5 * (1 + math.cos(math.pi * tau / cutoff)) if tau < cutoff else 0.0
    return gate * math.exp(-alpha * tau)


def reference_cgad(phi0, steps, *, lr, betas, eps, alpha, cutoff, restart_every=0):
    """Float64 CGAD written straight from the formula; ``steps`` is a list of (delta, age)."""
    b1, b2 = betas
    phi = phi0.double().clone()
    m = torch.zeros_like(phi)
    v = torch.zeros_like(phi)
    t = 0
    for delta, age in steps:
        s = reference_sigma(age, alpha, cutoff)
        if s == 0:
            continue
        if restart_every and t > 0 and t % restart_every == 0:
            m.zero_()
            v.zero_()
            t = 0
        g = s * delta.double()
        t += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        phi = phi - lr * (m / (1 - b1**t)) / (torch.sqrt(v / (1 - b2**t)) + eps)
    return phi


def run_cgad(opt_cls, phi0, steps, dtype=torch.float64, **kwargs):
    p = torch.nn.Parameter(phi0.clone().to(dtype))
    opt = opt_cls([p], **kwargs)
    for delta, age in steps:
        p.grad = delta.to(dtype)
        opt.step(age=age)
    return p.detach(), opt


def make_steps(ages, shape=(7, 5), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen, dtype=torch.float64) * 0.05, a) for a in ages]


HP = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, alpha=0.3, cutoff=4.0)
MIXED_AGES = [0, 1, 3, 0, 2, 5, 4, 1, 0, 3.5, 2, 0, 6, 1]  # includes ages at and past the cutoff


def test_cgad_matches_reference_float64():
    phi0 = torch.randn(7, 5, dtype=torch.float64)
    steps = make_steps(MIXED_AGES)
    got, _ = run_cgad(CGAD, phi0, steps, **HP)
    torch.testing.assert_close(got, reference_cgad(phi0, steps, **HP), rtol=1e-12, atol=1e-12)


def test_cgad_matches_reference_float32():
    phi0 = torch.randn(7, 5, dtype=torch.float64)
    steps = make_steps(MIXED_AGES)
    got, _ = run_cgad(CGAD, phi0, steps, dtype=torch.float32, **HP)
    torch.testing.assert_close(got.double(), reference_cgad(phi0, steps, **HP), rtol=1e-5, atol=1e-6)


def test_age_zero_equals_torch_adam_over_many_steps():
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (5, 3, 2)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    cgad = CGAD(ours, lr=0.01, betas=(0.9, 0.99), eps=1e-8)
    adam = torch.optim.Adam(theirs, lr=0.01, betas=(0.9, 0.99), eps=1e-8, foreach=True)
    for _ in range(200):
        for a, b in zip(ours, theirs, strict=True):
            g = torch.randn_like(a) * 0.1
            a.grad, b.grad = g.clone(), g.clone()
        cgad.step(age=0)
        adam.step()
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_zero_weight_changes_nothing():
    phi0 = torch.randn(7, 5, dtype=torch.float64)
    _, opt = run_cgad(CGAD, phi0, make_steps([0, 1, 2]), **HP)
    p = opt.param_groups[0]["params"][0]
    before_param = p.detach().clone()
    before_state = copy.deepcopy(opt.state[p])
    p.grad = torch.randn_like(p)
    for age in (4, 4.0, 9, 100):  # at and past the cutoff: σ = 0
        opt.step(age=age)
    assert torch.equal(p, before_param)
    for key in ("exp_avg", "exp_avg_sq", "step"):
        assert torch.equal(opt.state[p][key], before_state[key]), key


def test_decay_without_gate_is_adam_decay():
    phi0 = torch.randn(7, 5, dtype=torch.float64)
    steps = make_steps([0, 2, 9, 20, 1, 0, 12])  # far past any cutoff: Adam-Decay still applies them
    hp = {k: v for k, v in HP.items() if k != "cutoff"}
    got, _ = run_cgad(AdamDecay, phi0, steps, **hp)
    torch.testing.assert_close(
        got, reference_cgad(phi0, steps, cutoff=math.inf, **hp), rtol=1e-12, atol=1e-12
    )
    gated, _ = run_cgad(CGAD, phi0, steps, **HP)
    assert not torch.allclose(got, gated)


def test_restart_resets_moments_and_step_count():
    phi0 = torch.randn(7, 5, dtype=torch.float64)
    steps = make_steps([0, 1, 0, 2, 0, 1, 0, 3, 1, 0])
    got, _ = run_cgad(CGAD, phi0, steps, restart_every=3, **HP)
    want = reference_cgad(phi0, steps, restart_every=3, **HP)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(want, reference_cgad(phi0, steps, **HP))


@settings(max_examples=40, deadline=None)
@given(
    ages=st.lists(st.integers(min_value=0, max_value=10), min_size=1, max_size=12),
    alpha=st.floats(min_value=0, max_value=2),
    cutoff=st.floats(min_value=0.5, max_value=12),
    shape=st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=3),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_cgad_property_matches_reference(ages, alpha, cutoff, shape, seed):
    hp = dict(lr=0.05, betas=(0.8, 0.9), eps=1e-6, alpha=alpha, cutoff=cutoff)
    phi0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    steps = make_steps(ages, shape=tuple(shape), seed=seed)
    got, opt = run_cgad(CGAD, phi0, steps, **hp)
    torch.testing.assert_close(got, reference_cgad(phi0, steps, **hp), rtol=1e-10, atol=1e-12)
    applied = sum(reference_sigma(a, alpha, cutoff) > 0 for _, a in steps)
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert int(state.get("step", 0)) == applied


def test_pacgad_fragments_have_own_ages_and_step_counts():
    torch.manual_seed(1)
    phi_a, phi_b = torch.randn(6, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    a, b = torch.nn.Parameter(phi_a.clone()), torch.nn.Parameter(phi_b.clone())
    opt = PACGAD([{"params": [a]}, {"params": [b]}], **HP)
    ages = [(0, None), (1, 0), (None, 2), (3, 5), (0, 1), (2, None), (4, 0)]
    steps_a, steps_b = [], []
    for age_a, age_b in ages:
        da, db = torch.randn(6, dtype=torch.float64) * 0.05, torch.randn(3, 4, dtype=torch.float64) * 0.05
        a.grad, b.grad = da, db
        opt.step(ages=[age_a, age_b])
        if age_a is not None:
            steps_a.append((da, age_a))
        if age_b is not None:
            steps_b.append((db, age_b))
    torch.testing.assert_close(a.detach(), reference_cgad(phi_a, steps_a, **HP), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.detach(), reference_cgad(phi_b, steps_b, **HP), rtol=1e-12, atol=1e-12)
    # fragment a applied ages 0,1,3,0,2 (4 is the cutoff: dropped); fragment b applied 0,2,0,1,0
    assert int(opt.state[a]["step"]) == 5
    assert int(opt.state[b]["step"]) == 4


def test_pacgad_none_leaves_fragment_untouched():
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(4))
    opt = PACGAD([{"params": [a]}, {"params": [b]}])
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    before = b.detach().clone()
    opt.step(ages=[0, None])
    assert torch.equal(b, before)
    assert b not in opt.state or not opt.state[b]
    assert not torch.equal(a, torch.zeros(4))


def _state_dict_round_trip(make_opt, step_kwargs):
    torch.manual_seed(2)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    opt = make_opt([{"params": [params[0]]}, {"params": [params[1]]}])
    for i in range(4):
        for p in params:
            p.grad = torch.randn_like(p) * 0.1
        opt.step(**step_kwargs(i))
    saved = copy.deepcopy(opt.state_dict())
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = make_opt([{"params": [twins[0]]}, {"params": [twins[1]]}])
    fresh.load_state_dict(saved)
    for p, q in zip(params, twins, strict=True):
        p.grad = torch.randn_like(p) * 0.1
        q.grad = p.grad.clone()
    opt.step(**step_kwargs(5))
    fresh.step(**step_kwargs(5))
    for p, q in zip(params, twins, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("cls", [CGAD, AdamDecay])
def test_state_dict_round_trip(cls):
    _state_dict_round_trip(lambda groups: cls(groups, lr=0.02), lambda i: {"age": i % 3})


def test_pacgad_state_dict_round_trip():
    _state_dict_round_trip(lambda groups: PACGAD(groups, lr=0.02), lambda i: {"ages": [i % 3, (i + 1) % 2]})


def test_bf16_params_keep_float32_moments():
    phi0 = torch.randn(64, dtype=torch.float64)
    steps = make_steps([0, 1, 2, 0, 1, 3, 0], shape=(64,))
    got, opt = run_cgad(CGAD, phi0, steps, dtype=torch.bfloat16, **HP)
    assert got.dtype == torch.bfloat16
    state = opt.state[opt.param_groups[0]["params"][0]]
    assert state["exp_avg"].dtype == torch.float32
    want = reference_cgad(phi0, steps, **HP)
    # bf16 holds ~3 significant digits; the update itself (~lr per step) must show through
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    assert (got.double() - phi0.to(torch.bfloat16).double()).abs().max() > 0.02


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"lr": 0}, "lr"),
        ({"lr": -1}, "lr"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"eps": -1}, "eps"),
        ({"alpha": -0.1}, "alpha"),
        ({"cutoff": 0}, "cutoff"),
        ({"cutoff": -3}, "cutoff"),
        ({"restart_every": -1}, "restart_every"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CGAD([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_bad_step_arguments():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError, match="age"):
        CGAD([p]).step(age=-1)
    pa = PACGAD([{"params": [p]}, {"params": [torch.nn.Parameter(torch.zeros(2))]}])
    with pytest.raises(ValueError, match="2 fragments"):
        pa.step(ages=[0])
    with pytest.raises(ValueError, match="2 fragments"):
        pa.step(ages=[0, 1, 2])
    with pytest.raises(ValueError, match="age"):
        pa.step(ages=[0, -2])
