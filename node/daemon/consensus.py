"""A daemon's side of factored mixing's blocking step, and the averager DHT both all-reduces use.

Every K rounds (``--consensus-every``) the member engine asks for its group (``group_due``); the
daemon then averages its whole φ with a group of up to ``--consensus-group`` peers through
hivemind's all-reduce (``protocol.allreduce.GroupAverager``), blocking the trainer, and hands the
mean to the engine. A new group gathers for a third of ``--consensus-timeout`` or a round, the
longer (the timeout at most); a member looks for a group for that and two thirds of the timeout,
and a group's all-reduce may take the timeout; past either the member goes on without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from cgad.node.config import JoinConfig
from cgad.node.member.consensus import GroupMean, matchmaking
from cgad.node.member.engine import Member
from cgad.protocol.allreduce import (
    AllReduceExchange,
    AveragerSettings,
    GroupAverager,
    averager_bootstrap,
    listen_anywhere,
)
from cgad.protocol.auth import SwarmKey
from cgad.protocol.records import Identity, run_prefix

__all__ = ["consensus_averager", "consensus_status", "join_group", "start_averaging"]

logger = logging.getLogger(__name__)


def consensus_averager(
    config: JoinConfig, numel: int, swarm_key: SwarmKey | None = None, identity: Identity | None = None
) -> GroupAverager | None:
    """The averager of the blocking step, or None when it is off.

    Args:
        config: the node's configuration (``consensus_*``, ``allow``).
        numel: the values of the whole φ.
        swarm_key: a private swarm's key: the averager's DHT takes it.
        identity: the node's: its averager runs under the node's peer id, so that with ``--allow``
            a group with a member outside the list is known and its mean not taken.
    """
    if not config.consensus_every:
        return None
    return GroupAverager(
        numel,
        AveragerSettings(
            prefix=f"{run_prefix(config.run_id)}_consensus",
            group_size=config.consensus_group,
            matchmaking_time=config.consensus_timeout / 3,
            timeout=config.consensus_timeout,
            swarm_key=swarm_key,
            # with an allowlist, under the node's peer id (a fresh one otherwise)
            identity=identity if config.allow else None,
            allowed=frozenset(config.allow) if config.allow and identity is not None else None,
        ),
    )


def join_group(member: Member, averager: GroupAverager) -> None:
    """The blocking step of the round ``member`` awaits: its φ averaged with the group's, or left
    as it is when no group formed in time. A new group gathers for a round at least
    (``matchmaking``), a round's length taken from the time since the last step over the rounds
    between."""
    started = time.monotonic()
    since, rounds = averager.finished_at, member.consensus.rounds_since
    round_seconds = (started - since) / rounds if since is not None and rounds else None
    window, search = matchmaking(averager.timeout, round_seconds)
    averaged = averager.average(member.group_phi(), window, search)
    group = GroupMean(*averaged) if averaged is not None else None
    if group is None:
        logger.info("round %s: no consensus group formed in time; going on alone", member.awaiting_group)
    member.join_group(group, time.monotonic() - started)


def consensus_status(member: Member, averager: GroupAverager | None) -> dict[str, Any] | None:
    """What the status document says of the blocking step (None: off): the engine's record, and
    the groups whose mean was refused for a member outside ``--allow``."""
    if averager is None:
        return None
    return {**member.consensus.summary(), "outsiders": averager.outsiders}


def start_averaging(
    averaging: AllReduceExchange | GroupAverager, described: list[dict[str, Any]], config: JoinConfig
) -> Sequence[str]:
    """Join the averager's DHT through the addresses the peers at --peers state (their claim);
    the addresses this node states in turn when asked who it is."""
    bootstrap = [addr for description in described for addr in averager_bootstrap(description)]
    if config.peers and not bootstrap:
        raise ConnectionError("no peer at --peers stated where its averager listens (--sync allreduce or"
                              " --consensus-every: every member of a swarm runs the same)")  # fmt: skip
    averaging.start(bootstrap, listen_anywhere(config.host_maddrs))
    return averaging.maddrs()
