"""DiLoCo's outer SGD with Nesterov momentum, and its delayed form for asynchronous arrivals.

OuterNesterov (Douillard et al. 2023; lr 0.7, momentum 0.9), on a pseudo-gradient g:

    b ← μ·b + g   (b = g on the first step)      φ ← φ − lr·(g + μ·b)

With momentum 0 it is the momentum-free outer step φ ← φ − lr·g.

DelayedNesterov (Liu et al. 2024): each arrival g is buffered and applied as lr·g/N at once; on
every N-th arrival the momentum takes the buffered mean, m ← μ·m + Σg/N, and the step is
lr·(g/N + μ·m). N = 1 is OuterNesterov.

Both take ``restart_every`` = K > 0: the momentum is reset every K outer steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

__all__ = ["DelayedNesterov", "OuterNesterov", "delayed_nesterov_update", "nesterov_update"]


def nesterov_update(
    params: list[Tensor], grads: list[Tensor], bufs: list[Tensor], *, lr: float, momentum: float
) -> None:
    """In place: b ← μ·b + g, φ ← φ − lr·(g + μ·b). A fresh buffer is zeros: μ·0 + g is exactly g."""
    if not params:
        return
    if momentum == 0.0:
        torch._foreach_add_(params, grads, alpha=-lr)
        return
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    update = torch._foreach_add(grads, bufs, alpha=momentum)
    torch._foreach_add_(params, update, alpha=-lr)


def delayed_nesterov_update(
    params: list[Tensor],
    grads: list[Tensor],
    momentum_bufs: list[Tensor],
    grad_bufs: list[Tensor],
    *,
    lr: float,
    momentum: float,
    period: int,
    momentum_turn: bool,
) -> None:
    """In place: one arrival of Delayed Nesterov; ``momentum_turn`` is True on every N-th arrival."""
    if not params:
        return
    torch._foreach_add_(grad_bufs, grads)
    if not momentum_turn:
        torch._foreach_add_(params, grads, alpha=-lr / period)
        return
    torch._foreach_mul_(momentum_bufs, momentum)
    torch._foreach_add_(momentum_bufs, grad_bufs, alpha=1.0 / period)
    update = torch._foreach_mul(grads, 1.0 / period) if period > 1 else list(grads)
    torch._foreach_add_(update, momentum_bufs, alpha=momentum)
    torch._foreach_add_(params, update, alpha=-lr)
    torch._foreach_zero_(grad_bufs)


def _check_common(lr: float, momentum: float, restart_every: int) -> None:
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not isinstance(restart_every, int) or restart_every < 0:
        raise ValueError(f"restart_every must be an integer >= 0 (0 = never), got {restart_every!r}")


class OuterNesterov(Optimizer):
    """SGD with Nesterov momentum on pseudo-gradients; equals torch.optim.SGD(nesterov=True)."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.7,
        momentum: float = 0.9,
        restart_every: int = 0,
    ) -> None:
        _check_common(lr, momentum, restart_every)
        super().__init__(params, dict(lr=lr, momentum=momentum, restart_every=restart_every))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    if group["momentum"] != 0.0:
                        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                restart = group["restart_every"]
                if (
                    restart
                    and state["step"] > 0
                    and state["step"] % restart == 0
                    and "momentum_buffer" in state
                ):
                    state["momentum_buffer"].zero_()
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                if "momentum_buffer" in state:
                    bufs.append(state["momentum_buffer"])
            nesterov_update(params, grads, bufs, lr=group["lr"], momentum=group["momentum"])
        return loss


class DelayedNesterov(Optimizer):
    """Nesterov whose momentum absorbs the mean of every ``period`` (N) arrivals at once."""

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 0.7,
        momentum: float = 0.9,
        period: int = 1,
        restart_every: int = 0,
    ) -> None:
        _check_common(lr, momentum, restart_every)
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"period (N) must be an integer >= 1, got {period!r}")
        super().__init__(params, dict(lr=lr, momentum=momentum, period=period, restart_every=restart_every))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lists: tuple[list[Tensor], ...] = ([], [], [], [])
            turn = False
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["arrivals"] = 0
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["grad_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                restart = group["restart_every"]
                arrivals = state["arrivals"]
                if restart and arrivals > 0 and arrivals % restart == 0:
                    state["momentum_buffer"].zero_()
                state["arrivals"] = arrivals + 1
                turn = state["arrivals"] % group["period"] == 0
                for lst, t in zip(
                    lists, (p, p.grad, state["momentum_buffer"], state["grad_buffer"]), strict=True
                ):
                    lst.append(t)
            delayed_nesterov_update(
                *lists,
                lr=group["lr"],
                momentum=group["momentum"],
                period=group["period"],
                momentum_turn=turn,
            )
        return loss
