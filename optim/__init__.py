"""Outer optimizers: pure tensor math over pseudo-gradients (no network, no files).

Every optimizer reads the pseudo-gradient Δ = φ_before − θ_after from ``p.grad``, so a descent
step moves the outer parameters φ toward the locally trained θ.
"""

from .cgad import CGAD, DEFAULT_ALPHA, DEFAULT_CUTOFF, DEFAULT_LR, PACGAD, AdamDecay, cgad_update
from .nesterov import DelayedNesterov, OuterNesterov, delayed_nesterov_update, nesterov_update
from .noloco import noloco_update
from .staleness import cosine_gate, staleness_weight

__all__ = [
    "CGAD",
    "DEFAULT_ALPHA",
    "DEFAULT_CUTOFF",
    "DEFAULT_LR",
    "PACGAD",
    "AdamDecay",
    "DelayedNesterov",
    "OuterNesterov",
    "cgad_update",
    "cosine_gate",
    "delayed_nesterov_update",
    "nesterov_update",
    "noloco_update",
    "staleness_weight",
]
