"""How much a pseudo-gradient of age τ (in outer rounds) still counts.

    γ(τ) = ½·(1 + cos(π·τ/τ_c))  for 0 ≤ τ < τ_c,   γ(τ) = 0 for τ ≥ τ_c
    σ(τ) = γ(τ)·exp(−α·τ)

The exponential models information decay; the raised-cosine gate reaches zero smoothly at the
cutoff τ_c, so contributions past it are dropped rather than merely shrunk.
"""

from __future__ import annotations

import math

__all__ = ["check_age", "cosine_gate", "staleness_weight"]


def check_age(tau: float) -> float:
    """Return τ as a float, or raise ValueError if it is not a finite non-negative number."""
    if isinstance(tau, bool) or not isinstance(tau, int | float):
        raise ValueError(f"age must be a number of outer rounds, got {tau!r}")
    if not math.isfinite(tau) or tau < 0:
        raise ValueError(f"age must be finite and >= 0, got {tau}")
    return float(tau)


def _check_cutoff(cutoff: float) -> None:
    if isinstance(cutoff, bool) or not isinstance(cutoff, int | float) or math.isnan(cutoff) or cutoff <= 0:
        raise ValueError(f"cutoff must be > 0 (math.inf for no gate), got {cutoff!r}")


def _check_alpha(alpha: float) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"alpha must be finite and >= 0, got {alpha!r}")


def cosine_gate(tau: float, cutoff: float) -> float:
    """γ(τ): 1 at τ = 0, non-increasing, exactly 0 at and past the cutoff."""
    tau = check_age(tau)
    _check_cutoff(cutoff)
    if tau >= cutoff:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * tau / cutoff))


def staleness_weight(tau: float, alpha: float, cutoff: float = math.inf) -> float:
    """σ(τ) = γ(τ)·e^(−α·τ); with cutoff = math.inf the gate is 1 everywhere (Adam-Decay)."""
    _check_alpha(alpha)
    return cosine_gate(tau, cutoff) * math.exp(-alpha * float(tau))
