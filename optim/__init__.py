"""Outer optimizers: pure tensor math over pseudo-gradients (no network, no files).

Every optimizer reads the pseudo-gradient Δ = φ_before − θ_after from ``p.grad``, so a descent
step moves the outer parameters φ toward the locally trained θ.

The defaults import without torch (a configuration reads them); everything else is loaded on
first use, so ``from cgad.optim import CGAD`` works as usual.
"""

from importlib import import_module
from typing import Any

from .defaults import AUTO_LR_SCALE, DEFAULT_ALPHA, DEFAULT_CUTOFF, DEFAULT_LR

_HOME = {
    "CGA": "cga",
    "CGAD": "cgad",
    "PACGAD": "cgad",
    "AdamDecay": "cgad",
    "cgad_update": "cgad",
    "DelayedNesterov": "nesterov",
    "OuterNesterov": "nesterov",
    "delayed_nesterov_update": "nesterov",
    "nesterov_update": "nesterov",
    "NoLoCo": "noloco",
    "noloco_update": "noloco",
    "merge": "merging",
    "AroundOwn": "robust",
    "FLOAT64_CHUNK": "robust",
    "SpreadBound": "robust",
    "Verdict": "robust",
    "chunk_dots": "robust",
    "near_copies": "robust",
    "verdict": "robust",
    "cosine_gate": "staleness",
    "effective_count": "averaging",
    "inner_lr_scale": "averaging",
    "running_count": "averaging",
    "staleness_weight": "staleness",
}

__all__ = ["AUTO_LR_SCALE", "DEFAULT_ALPHA", "DEFAULT_CUTOFF", "DEFAULT_LR", *_HOME]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_HOME[name]}", __name__), name)
