import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cgad.optim import cosine_gate, staleness_weight

ages = st.floats(min_value=0, max_value=1e4, allow_nan=False, allow_infinity=False)
cutoffs = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)
alphas = st.floats(min_value=0, max_value=10, allow_nan=False, allow_infinity=False)


def test_gate_known_values():
    assert cosine_gate(0, 4) == 1.0
    assert cosine_gate(2, 4) == pytest.approx(0.5)
    assert cosine_gate(1, 4) == pytest.approx(0.5 * (1 + math.cos(math.pi / 4)))
    assert cosine_gate(4, 4) == 0.0
    assert cosine_gate(5, 4) == 0.0
    assert staleness_weight(3, 0.5, 8) == pytest.approx(
        0.5 * (1 + math.cos(3 * math.pi / 8)) * math.exp(-1.5)
    )


@given(cutoff=cutoffs)
def test_gate_is_one_at_age_zero(cutoff):
    assert cosine_gate(0, cutoff) == 1.0


@given(a=ages, b=ages, cutoff=cutoffs)
def test_gate_is_non_increasing(a, b, cutoff):
    lo, hi = sorted((a, b))
    assert cosine_gate(lo, cutoff) >= cosine_gate(hi, cutoff)


@given(cutoff=cutoffs, extra=st.floats(min_value=0, max_value=1e3))
def test_gate_is_zero_at_and_past_cutoff(cutoff, extra):
    assert cosine_gate(cutoff, cutoff) == 0.0
    assert cosine_gate(cutoff + extra, cutoff) == 0.0


@given(tau=ages, cutoff=cutoffs)
def test_gate_positive_before_cutoff(tau, cutoff):
    if tau < cutoff * (1 - 1e-6):
        assert cosine_gate(tau, cutoff) > 0.0


@given(tau=ages, alpha=alphas, cutoff=cutoffs)
def test_weight_bounded_by_decay(tau, alpha, cutoff):
    sigma = staleness_weight(tau, alpha, cutoff)
    assert 0.0 <= sigma <= math.exp(-alpha * tau)


@given(tau=ages, alpha=alphas)
def test_no_cutoff_is_pure_decay(tau, alpha):
    assert staleness_weight(tau, alpha) == math.exp(-alpha * tau)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: cosine_gate(-1, 4), "age"),
        (lambda: cosine_gate(float("nan"), 4), "age"),
        (lambda: cosine_gate(float("inf"), 4), "age"),
        (lambda: cosine_gate("2", 4), "age"),
        (lambda: cosine_gate(1, 0), "cutoff"),
        (lambda: cosine_gate(1, -2), "cutoff"),
        (lambda: staleness_weight(1, -0.1, 4), "alpha"),
        (lambda: staleness_weight(1, float("inf"), 4), "alpha"),
    ],
)
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
