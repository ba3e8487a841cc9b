"""A `cgad-node join` (or tests/_hostile_node.py's hostile one) started before the nodes it joins
are up, for the daemon tests: it imports what a daemon runs first (torch, hivemind: seconds on a
busy machine, spent while those nodes start), then waits until every multiaddrs file named has
been written (a node writes it once it has joined, just before it prints its admin address),
and joins with the first one's multiaddrs as --peers, as `cgad-node join --peers ...` would.

    python tests/_join_after.py MADDRS_FILE[,MADDRS_FILE...] join|ATTACK [join flags...]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

import cgad.node.daemon.node  # noqa: F401  (the daemon's imports, before the wait)
from cgad.node.front.cli import main as cli_main

WAIT_SECONDS = 300.0  # the test gives up on a node that never came up well before this


def main(argv: Sequence[str]) -> int:
    files = [Path(name) for name in argv[0].split(",")]
    deadline = time.monotonic() + WAIT_SECONDS
    while not all(f.exists() and f.read_text().strip() for f in files):  # written atomically, once
        if time.monotonic() > deadline:
            print(f"gave up waiting for {', '.join(map(str, files))}", file=sys.stderr)
            return 1
        time.sleep(0.05)
    peers = files[0].read_text().split()
    if argv[1] == "join":
        return cli_main(["join", *argv[2:], "--peers", *peers])
    import _hostile_node  # tests/ is on sys.path: this script lives there

    return _hostile_node.main([argv[1], *argv[2:], "--peers", *peers])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
