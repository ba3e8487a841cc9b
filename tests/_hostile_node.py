"""A hostile `cgad-node join`, for the adversarial daemon tests: it trains like any node, then
forges every pseudo-gradient it publishes (node/sim/attacks.py); with ``future:N`` its progress
records also claim to be N versions ahead, so that a careless peer would re-sync from it. With
``poison-state`` it publishes honest fragments but offers snapshots of its outer state whose
parameters are all NaN, claiming to be a version short of the cutoff past the median of the
swarm's reports: the newest on offer, and within what a joiner allows past the median even when
its view lags the poisoner's by a version, so that a joiner tries them first.

    python tests/_hostile_node.py ATTACK[+poison-state] [join flags...]
"""

from __future__ import annotations

import logging
import statistics
import sys
from collections.abc import Sequence

import torch

from cgad.node.config import JoinConfig
from cgad.node.daemon.checkpoint import pack
from cgad.node.daemon.node import Node
from cgad.node.front.cli import build_parser
from cgad.node.front.flags import config_from
from cgad.node.sim.attacks import Attack, ForgingTransport


def poison_state(node: Node) -> None:
    """Offer NaN parameters as this node's state, ahead of every honest snapshot and within a
    joiner's check (anchored on the swarm's median, not on this node's own versions, which may lag)."""

    def publish_state(wait: bool = False) -> None:
        with node._outer_lock:
            outer = node.loop.state_dict()
        # the joiner's ceiling: the low median of the reports past version 0, plus the cutoff
        progress = node.transport.swarm_progress().values()
        reports = [min(p.versions) for p in progress if p.versions and max(p.versions)]
        claim = statistics.median_low(reports) + int(node.config.cutoff) - 1 if reports else 0
        lead = max(1, claim - min(outer["versions"])) if reports else 3
        outer["phi"] = [torch.full_like(p, float("nan")) for p in outer["phi"]]
        outer["versions"] = [v + lead for v in outer["versions"]]
        blob = pack({"swarm": node.swarm, "outer": outer, "round": node.member.round + lead})
        node.transport.publish_state(blob, outer["versions"])

    node.publish_state = publish_state  # type: ignore[method-assign]


def main(argv: Sequence[str]) -> int:
    config = config_from(JoinConfig, build_parser().parse_args(["join", *argv[1:]]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = Node(config)
    modes = argv[0].split("+")  # e.g. scale:1e6+poison-state
    if "poison-state" in modes:
        modes.remove("poison-state")
        poison_state(node)
    for mode in modes:
        _forge(node, Attack.parse(mode))
    return _run(node)


def _forge(node: Node, attack: Attack) -> None:
    # on top of what forges already (kinds combine: tokens:N+mirror:S)
    node.loop.transport = ForgingTransport(node.loop.transport, attack, seed=1)
    if attack.kind == "future":
        honest_report = node.transport.report_progress

        def report_progress(versions: Sequence[int], inner_step: int, speed: float, *claims, **named) -> None:
            honest_report([v + int(attack.amount) for v in versions], inner_step, speed, *claims, **named)

        node.transport.report_progress = report_progress  # type: ignore[method-assign]


def _run(node: Node) -> int:
    try:
        return node.run()
    finally:
        node.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
