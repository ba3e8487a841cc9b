"""Blocking DiLoCo (`--sync allreduce`): hivemind's all-reduce of the group's pseudo-gradients,
with real averagers on 127.0.0.1 and real daemons; the group's mean is what the outer step
takes; a round without a group steps on the own update; a swarm of the other mode is refused."""

from __future__ import annotations

import subprocess
import threading

import pytest
import torch
from _daemons import CLI, FRESH_LOSS, SETTINGS, NodeProcess  # tests/ is on sys.path under pytest

from cgad.node.config import JoinConfig
from cgad.node.daemon.joining import IncompatibleSwarm, check_compatible
from cgad.node.sim.memory import VirtualNetwork
from cgad.protocol.allreduce import (
    GROUP_PUBLISHER,
    AllReduceExchange,
    AveragerSettings,
    averager_bootstrap,
    listen_anywhere,
)
from cgad.protocol.transport import Fragment, FragmentKey

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def _exchange(net: VirtualNetwork, name: str, group: int, wait: float, timeout: float) -> AllReduceExchange:
    return AllReduceExchange(net.join(name), 4096, AveragerSettings("t", group, wait, timeout))


def _publish_together(exchanges: list[AllReduceExchange], deltas: list[torch.Tensor]) -> None:
    threads = [
        threading.Thread(target=ex.publish, args=(Fragment(FragmentKey("r", 0, 0, ex.peer_id), d, 64),))
        for ex, d in zip(exchanges, deltas, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)


def test_the_group_mean_arrives_as_the_other_members_share_and_a_lone_round_gets_nothing() -> None:
    network = VirtualNetwork()
    exchanges = [_exchange(network, f"p{i}", group=3, wait=2.0, timeout=20) for i in range(3)]
    try:
        exchanges[0].start([], LOOPBACK)
        for ex in exchanges[1:]:
            ex.start(exchanges[0].maddrs(), LOOPBACK)
        deltas = [torch.randn(4096, generator=torch.Generator().manual_seed(i)) for i in range(3)]
        _publish_together(exchanges, deltas)
        mean = torch.stack(deltas).mean(0)
        for ex, own in zip(exchanges, deltas, strict=True):
            got = ex.receive(0)
            assert ex.groups == {3: 1}
            assert sorted(f.key.publisher for f in got) == [f"{GROUP_PUBLISHER}/1", f"{GROUP_PUBLISHER}/2"]
            assert all(f.key.base_version == 0 and f.tokens == 64 for f in got)
            # what the outer step's token-weighted mean makes of the own Δ and the deliveries
            taken = (own + sum(f.tensor for f in got)) / 3
            assert torch.allclose(taken, mean, atol=2e-3), (taken - mean).abs().max()  # fp16 on the wire
            assert ex.receive(0) == []
        for ex in exchanges[1:]:
            ex.close()
        # alone: no group within the timeout, and the outer step gets the own Δ only
        lone = _exchange(network, "q", group=2, wait=1.0, timeout=3)
        exchanges.append(lone)
        lone.start(exchanges[0].maddrs(), LOOPBACK)
        lone.publish(Fragment(FragmentKey("r", 0, 1, "q"), deltas[0], 64))
        assert lone.receive(0) == [] and lone.groups == {1: 1} and lone.stats.skipped["no_group"] == 1
    finally:
        for ex in exchanges:
            ex.close()


def test_averager_addresses_a_peer_states_are_checked() -> None:
    assert averager_bootstrap({"averager": "/ip4/1.2.3.4/tcp/5"}) == []  # not a list
    peer = "/ip4/1.2.3.4/tcp/5/p2p/QmTScAcEuTE53wQ9fNh3pX6vC1s3XXo4tN2y6FQqg7Wq3h"
    broken = ["/ip4/1.2.3.4/tcp/5/p2p/Qm", "/ip4/999.1.1.1/tcp/5", 7, "http://x", "/" + "a" * 600]
    stated = [peer, *broken, *(["/ip4/5.6.7.8/tcp/9"] * 40)]
    taken = averager_bootstrap({"averager": stated})
    assert taken[0] == peer and len(taken) <= 16
    assert all(isinstance(a, str) and a.startswith("/ip4/") for a in taken)
    assert not set(taken) & {a for a in broken if isinstance(a, str)}  # checked as every multiaddr is
    assert listen_anywhere(["/ip4/10.0.0.2/tcp/31337", "/ip4/0.0.0.0/udp/7/quic"]) == [
        "/ip4/10.0.0.2/tcp/0",
        "/ip4/0.0.0.0/udp/0/quic",
    ]


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ({"fragments": 2, "inner_steps": 10}, "--fragments 1"),
        ({"mixing": "gossip"}, "no --mixing"),
        ({"optimizer": "noloco"}, "no noloco"),
    ],
)
def test_allreduce_refuses_what_it_cannot_average(flags: dict, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        JoinConfig(sync="allreduce", **flags)


def test_a_description_from_before_sync_existed_means_the_exchange() -> None:
    ours = {"run_id": "r", "model": "m", "tokenizer": "t", "optimizer": "nesterov", "fragments": 1}
    older = dict(ours)  # a checkpoint or peer of the release before --sync: it exchanged
    check_compatible({**ours, "sync": "exchange"}, older, "checkpoint")
    with pytest.raises(
        IncompatibleSwarm, match=r"different exchange \(--sync\) \('exchange', this node: 'allreduce'\)"
    ):
        check_compatible({**ours, "sync": "allreduce"}, older, "checkpoint")


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_two_blocking_daemons_average_every_block_and_an_exchange_node_is_refused(daemons) -> None:
    workdir, started = daemons
    mode = ["--sync", "allreduce", "--allreduce-group", "2", "--allreduce-matchmaking", "3"]
    mode += ["--optimizer", "nesterov"]
    first = NodeProcess("first", workdir, [], mode)
    started.append(first)
    second = NodeProcess("second", workdir, first.maddrs(), mode)
    started.append(second)

    def averaged_twice(status: dict) -> bool:  # the group's mean taken by two outer steps
        return status["applied_by_peer"].get(f"{GROUP_PUBLISHER}/1", 0) >= 2

    statuses = [node.wait(averaged_twice, "two all-reduced rounds", timeout=400) for node in (first, second)]
    for status in statuses:
        assert status["allreduce_groups"].get("2", 0) >= 2, status["allreduce_groups"]
        assert "opposed" not in status["rejected"], status["rejected"]
        assert status["eval_loss"] < FRESH_LOSS - 0.5, status["eval_history"]
    # a node of the non-blocking exchange is refused at once, saying why
    refused = subprocess.run(
        [CLI, "join", *SETTINGS, "--peers", *first.maddrs(), "--optimizer", "nesterov"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert refused.returncode != 0
    assert "exchange (--sync)" in refused.stderr and "'allreduce'" in refused.stderr, refused.stderr[-2000:]
