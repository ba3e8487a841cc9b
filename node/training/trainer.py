"""The inner phase: H local AdamW steps on the peer's own data shard, and held-out evaluation."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from torch import Tensor

from cgad.node.config import EVAL_SHARE

__all__ = ["EVAL_SHARE", "EvalSchedule", "InnerTrainer", "evaluate"]


class InnerTrainer:
    """Local AdamW on a causal LM (DiLoCo's inner defaults: lr 4e-4, weight decay 0.1, betas
    (0.9, 0.95), gradient clipping at 1.0), with a linear warm-up of the learning rate."""

    def __init__(
        self,
        model: torch.nn.Module,
        batches: Iterator[Tensor],
        *,
        lr: float = 4e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        clip_norm: float = 1.0,
        warmup_steps: int = 0,
        device: torch.device | str = "cpu",
        autocast_dtype: torch.dtype | None = None,
        lr_scale: Callable[[], float] | None = None,
    ) -> None:
        """``lr_scale``: read before every step, the factor on the lr (the swarm's √N,
        ``OuterLoop.inner_lr_scale``); the weight decay per step, lr × weight decay, stays the
        base lr's, so that a larger step does not also shrink the weights faster. None: 1."""
        if not lr > 0:
            raise ValueError(f"inner lr must be > 0, got {lr}")
        self.model = model
        self.batches = batches
        self.device = torch.device(device)
        self.autocast_dtype = autocast_dtype
        self.clip_norm = clip_norm
        self.base_lr = lr
        self.weight_decay = weight_decay
        self.lr_scale = lr_scale
        self.warmup_steps = warmup_steps
        self.steps = 0
        self.tokens = 0
        self.optimizer = torch.optim.AdamW(
            model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, foreach=True
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def step(self) -> float:
        """One inner step; returns its training loss."""
        if self.warmup_steps or self.lr_scale is not None:
            scale = 1.0 if self.lr_scale is None else self.lr_scale()
            warm = min(1.0, (self.steps + 1) / self.warmup_steps) if self.warmup_steps else 1.0
            for group in self.optimizer.param_groups:
                group["lr"] = self.base_lr * warm * scale
                group["weight_decay"] = self.weight_decay / scale
        input_ids = next(self.batches).to(self.device, non_blocking=True)
        self.model.train()
        with self._autocast():
            loss = self.model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if self.clip_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_norm, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.tokens += input_ids.numel()
        return float(loss.detach())


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[Tensor],
    device: torch.device | str = "cpu",
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """Mean held-out loss over fixed batches (inf when the model produces non-finite values)."""
    model.eval()
    device = torch.device(device)
    total = 0.0
    for input_ids in batches:
        input_ids = input_ids.to(device)
        ctx = (
            torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        )
        with ctx:
            total += float(model(input_ids=input_ids, labels=input_ids).loss)
    mean = total / len(batches)
    return mean if math.isfinite(mean) else math.inf


class EvalSchedule:
    """Which round ends evaluate: every ``every`` rounds, or (``"auto"``) whenever the time spent
    evaluating, this evaluation included, stays within ``EVAL_SHARE`` of the time since the
    schedule began. The first evaluation is always due (its cost is not known before).

    Args:
        every: rounds between evaluations, or "auto".
        clock: seconds, monotonic (a simulator may pass its own).
    """

    def __init__(self, every: int | Literal["auto"], clock: Callable[[], float] = time.monotonic) -> None:
        self.every, self.clock = every, clock
        self.started = clock()
        self.spent = 0.0  # seconds evaluating since ``started``
        self.last_cost: float | None = None  # seconds the latest evaluation took

    def due(self, round_: int) -> bool:
        if self.every != "auto":
            return round_ % self.every == 0
        if self.last_cost is None:
            return True
        return self.spent + self.last_cost <= EVAL_SHARE * (self.clock() - self.started)

    @contextlib.contextmanager
    def timed(self) -> Iterator[None]:
        """Around one evaluation: its time counts against the share."""
        started = self.clock()
        try:
            yield
        finally:
            self.last_cost = self.clock() - started
            self.spent += self.last_cost
