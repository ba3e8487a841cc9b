"""The simulator's configuration: ``SimConfig`` is the daemon's training, outer and round parts
(``cgad.node.config``) with the exchange part and the virtual swarm's own (``SimOptions``), so a
key the two share is declared once and has one default.

Nothing here imports torch at import time (the command line builds this parser for every
command); the delay's and the attack's own parsers are read when a value is checked.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from cgad.node.config import (
    OuterOptions,
    Part,
    Positive,
    PositiveFloat,
    RoundOptions,
    ScheduleChecks,
    TrainingOptions,
)
from cgad.protocol.config import ExchangeOptions

__all__ = ["SimConfig", "SimOptions", "parse_stragglers"]


def parse_stragglers(text: str, workers: int) -> list[float]:
    """'1,1,2,4': one factor per worker; 'K:F': the last K workers are F times slower."""
    if not text:
        return []
    try:
        if ":" in text:
            count, factor = text.split(":", 1)
            k, f = int(count), float(factor)
            if not 0 <= k <= workers:
                raise ValueError
            return [1.0] * (workers - k) + [f] * k
        factors = [float(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"stragglers must be 'F1,F2,...' or 'K:F' with K <= workers, got {text!r}") from None
    if len(factors) != workers:
        raise ValueError(f"stragglers lists {len(factors)} factors for {workers} workers")
    return factors


class SimOptions(Part):
    """The virtual swarm: how many workers, for how long, and what the network does to them."""

    workers: Positive = Field(4, description="simulated workers")
    rounds: Positive = Field(20, description="outer rounds")
    delay: str = Field("0", description="delay in outer rounds: N, or random:MAX (uniform 0..MAX)")
    drop: float = Field(0.0, ge=0, lt=1, description="probability a delivery is lost")
    bandwidth: PositiveFloat | None = Field(None, description="uplink bytes per virtual second")
    stragglers: list[float] = Field(default_factory=list, description="per-worker slow-down factors")
    churn: float = Field(0.0, ge=0, lt=1, description="chance per round a worker leaves for 1-4 rounds")
    step_time: PositiveFloat = Field(1.0, description="virtual seconds per inner step at speed factor 1")
    data_split: Literal["disjoint", "shared"] = Field(
        "disjoint",
        description="disjoint: each worker its own contiguous shard of the corpus (a volunteer's own "
        "data); shared: every worker draws from the whole corpus with its own stream, as daemons do",
    )
    attackers: int = Field(0, ge=0, description="workers (the last ones) that forge what they publish")
    attack: str | None = Field(
        None,
        description="what attackers send: scale:F, signflip, noise:F, nan, inf, tokens:N, future:N, mirror:S"
        " (several attackers push one direction together)",
    )

    @model_validator(mode="before")
    @classmethod
    def _straggler_text(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("stragglers"), str):
            workers = data.get("workers", cls.model_fields["workers"].default)
            if isinstance(workers, bool) or not isinstance(workers, int):
                raise ValueError(f"workers must be a whole number, got {workers!r}")
            data = {**data, "stragglers": parse_stragglers(data["stragglers"], workers)}
        delay = data.get("delay") if isinstance(data, dict) else None
        if isinstance(delay, int) and not isinstance(delay, bool):
            data = {**data, "delay": str(delay)}  # `delay: 2` in a YAML file
        return data

    @field_validator("delay")
    @classmethod
    def _delay(cls, value: str) -> str:
        from cgad.node.sim.memory import Delay  # the simulator's own parser (imports torch)

        Delay.parse(value)
        return value

    @field_validator("attack")
    @classmethod
    def _attack(cls, value: str | None) -> str | None:
        from cgad.node.sim.attacks import Attack  # imports torch

        return None if value is None else str(Attack.parse(value))

    @field_validator("stragglers")
    @classmethod
    def _stragglers(cls, value: list[float]) -> list[float]:
        if any(not (f > 0 and math.isfinite(f)) for f in value):
            raise ValueError(f"straggler factors must be finite and > 0, got {value}")
        return value


class SimConfig(ScheduleChecks, TrainingOptions, OuterOptions, RoundOptions, ExchangeOptions, SimOptions):
    """One simulated swarm: one optimizer, one seed."""

    @model_validator(mode="after")
    def _one_factor_per_worker(self) -> SimConfig:
        if self.stragglers and len(self.stragglers) != self.workers:
            raise ValueError(f"{len(self.stragglers)} straggler factors for {self.workers} workers")
        if self.attackers >= self.workers:
            raise ValueError(
                f"{self.attackers} attackers among {self.workers} workers: at least one must be honest"
            )
        if self.attackers and self.attack is None:
            raise ValueError("--attackers needs --attack (what they send)")
        return self
