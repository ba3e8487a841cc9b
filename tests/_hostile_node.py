"""A hostile `cgad-node join`, for the adversarial daemon tests: it trains like any node, then
forges every pseudo-gradient it publishes (node/attacks.py); with ``future:N`` its progress
records also claim to be N versions ahead, so that a careless peer would re-sync from it.

    python tests/_hostile_node.py ATTACK [join flags...]
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from cgad.node.attacks import Attack, ForgingTransport
from cgad.node.cli import _config_from, build_parser
from cgad.node.config import JoinConfig
from cgad.node.daemon import Node


def main(argv: Sequence[str]) -> int:
    attack = Attack.parse(argv[0])
    config = _config_from(JoinConfig, build_parser().parse_args(["join", *argv[1:]]))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    node = Node(config)
    node.loop.transport = ForgingTransport(node.transport, attack, seed=1)
    if attack.kind == "future":
        honest_report = node.transport.report_progress

        def report_progress(versions: Sequence[int], inner_step: int, tokens_per_second: float) -> None:
            honest_report([v + int(attack.amount) for v in versions], inner_step, tokens_per_second)

        node.transport.report_progress = report_progress  # type: ignore[method-assign]
    try:
        return node.run()
    finally:
        node.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
