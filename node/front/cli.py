"""The `cgad-node` command line: one parser, one subcommand per job.

Argparse errors name what was wrong and, where a known option or subcommand is close, suggest it;
every error exits with status 2 before anything runs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cgad.node import __version__
from cgad.node.front.flags import HelpAll, add_config_flags, config_from, file_only_keys


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors suggest the closest known flag or subcommand. Prefixes of flags
    are not accepted: `--inner-step` is a typo to report, not a guess to act on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        hint = self._suggestion(message)
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")

    def _suggestion(self, message: str) -> str:
        if message.startswith("unrecognized arguments:"):
            known = _option_strings(self)
            hints = []
            for word in message.split(":", 1)[1].split():
                flag = word.split("=", 1)[0]
                if flag.startswith("-"):
                    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                    if close:
                        hints.append(f"{flag} -> {close[0]}")
            return f" (did you mean: {', '.join(hints)}?)" if hints else ""
        if "invalid choice:" in message:
            chosen = message.split("invalid choice:", 1)[1].split("(", 1)[0].strip().strip("'\"")
            choices = [c for action in self._actions if action.choices is not None for c in action.choices]
            close = difflib.get_close_matches(chosen, [str(c) for c in choices], n=1, cutoff=0.6)
            return f" (did you mean {close[0]!r}?)" if close else ""
        return ""


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of a parser and of its subcommands (unknown flags are reported by the top parser)."""
    found = []
    for action in parser._actions:
        found.extend(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_option_strings(sub))
    return found


def _cmd_info(args: argparse.Namespace) -> int:
    """Print what this installation has: versions, accelerator, the outer optimizers."""
    import hivemind
    import torch
    import transformers

    from cgad.node.member.methods import METHODS

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"cgad-node     {__version__}")
    print(f"python        {platform.python_version()}")
    print(f"torch         {torch.__version__}")
    print(f"transformers  {transformers.__version__}")
    print(f"hivemind      {hivemind.__version__}")
    print(f"cuda device   {cuda}")
    print(f"optimizers    {', '.join(f'{m.name} ({type(m).__name__})' for m in METHODS.values())}")
    return 0


# what `join --help` shows: what a volunteer sets; `join --help-all` shows every option by part
JOIN_HELP_SHOWS = (
    "peers", "run_id", "swarm_key", "identity", "announce_maddrs", "host_maddrs", "checkpoint_dir",
    "device", "model", "data", "batch_size", "upload_limit", "dashboard_port", "admin_port", "max_rounds",
)  # fmt: skip


# ---------------------------------------------------------------- join


def _join_parser(parser: argparse.ArgumentParser, shown: Sequence[str] | None) -> argparse.ArgumentParser:
    """``join``'s options on ``parser``; the help lists ``shown`` of them (None: every one)."""
    from cgad.node.config import JoinConfig

    if shown is not None:
        internal = ", ".join(file_only_keys(JoinConfig))
        epilog = f"Internals, keys of the --config file only (not flags): {internal}."
        full = _join_parser(argparse.ArgumentParser(description=parser.description, epilog=epilog), None)
        parser.add_argument("--help-all", action=HelpAll, full=lambda prog: _with_prog(full, prog),
                            help="show every option, grouped by part, and exit")  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", default=False,
                        help="validate the whole configuration, print it, and exit")  # fmt: skip
    parser.add_argument("--log-level", choices=("debug", "info", "warning"), default="info",
                        help="how much this node logs (debug: every failed fetch and why)")  # fmt: skip
    add_config_flags(parser, JoinConfig, shown=shown)
    return parser


def _with_prog(parser: argparse.ArgumentParser, prog: str) -> argparse.ArgumentParser:
    parser.prog = prog
    return parser


def _add_join(subparsers: argparse._SubParsersAction) -> None:
    join = subparsers.add_parser(
        "join",
        help="run a node: join a swarm (or start one) and train",
        description="Train locally and exchange age-weighted pseudo-gradient fragments with the swarm. "
        "Options can also come from a YAML file (--config); flags win. This help lists what a "
        "volunteer sets; --help-all lists every option.",
        argument_default=argparse.SUPPRESS,
    )
    _join_parser(join, JOIN_HELP_SHOWS)
    join.set_defaults(handler=_cmd_join)


def _cmd_join(args: argparse.Namespace) -> int:
    import logging

    from cgad.node.config import JoinConfig

    config = config_from(JoinConfig, args)
    if args.dry_run:
        print(json.dumps(config.model_dump(), indent=1))
        return 0
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # this package's loggers only: debug from hivemind and gRPC would drown what says why
    logging.getLogger("cgad").setLevel(args.log_level.upper())
    from cgad.node.daemon.node import Node

    node = Node(config)
    try:
        return node.run()
    finally:
        node.close()


# ---------------------------------------------------------------- talking to a running node


def _add_admin_commands(subparsers: argparse._SubParsersAction) -> None:
    from cgad.node.config import ADMIN_PORT

    status = subparsers.add_parser("status", help="show a running node's status")
    status.add_argument("--admin", default=f"127.0.0.1:{ADMIN_PORT}", help="the node's admin API (HOST:PORT)")
    status.add_argument("--json", action="store_true", help="print the whole status document as JSON")
    status.set_defaults(handler=_cmd_status)
    leave = subparsers.add_parser("leave", help="ask a node to finish its step, publish, checkpoint and exit")
    leave.add_argument("--admin", default=f"127.0.0.1:{ADMIN_PORT}", help="the node's admin API (HOST:PORT)")
    leave.set_defaults(handler=_cmd_leave)
    keygen = subparsers.add_parser(
        "keygen", help="create (or read) an identity key file and print its peer id; create a swarm key"
    )
    keygen.add_argument("--out", help="identity key file; an existing one is read, not replaced")
    keygen.add_argument(
        "--swarm-key", help="create a private swarm's shared secret in this file (never overwritten)"
    )
    keygen.set_defaults(handler=_cmd_keygen)
    from cgad.protocol.config import NetworkOptions

    swarm = subparsers.add_parser(
        "swarm", help="list every live peer of a run (joins the DHT read-only: trains and publishes nothing)"
    )
    swarm.add_argument("--peers", nargs="+", required=True, help="multiaddr(s) of any peer of the swarm")
    swarm.add_argument(
        "--run-id", default=NetworkOptions.model_fields["run_id"].default, help="the run to list"
    )
    swarm.add_argument("--swarm-key", help="the swarm key file, for a private swarm")
    swarm.add_argument("--json", action="store_true", help="print the peers as JSON")
    swarm.add_argument(
        "--watch",
        type=float,
        nargs="?",
        const=5.0,
        metavar="SECONDS",
        help="refresh every SECONDS (5) until Ctrl-C",
    )
    swarm.set_defaults(handler=_cmd_swarm)
    export = subparsers.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("--checkpoint-dir", required=True)
    export.add_argument("--out", required=True, help="directory for config.json, weights and tokenizer")
    export.set_defaults(handler=_cmd_export)


def _cmd_keygen(args: argparse.Namespace) -> int:
    if not args.out and not args.swarm_key:
        raise ValueError("give --out (an identity key file), --swarm-key (a new swarm key file), or both")
    if args.out:
        from cgad.protocol.records import Identity

        print(Identity.load_or_create(args.out).peer_id)
    if args.swarm_key:
        from cgad.protocol.auth import SwarmKey

        key = SwarmKey.create(args.swarm_key)
        print(f"swarm key {key.fingerprint} written to {args.swarm_key}: give it to every member, privately")
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from cgad.node.daemon.admin import call_admin
    from cgad.node.daemon.status import status_report

    status = call_admin(args.admin, "Status")
    print(json.dumps(status, indent=1) if args.json else status_report(status))
    return 0


def _cmd_swarm(args: argparse.Namespace) -> int:
    import signal
    import threading

    from cgad.node.daemon.monitor import as_json, open_monitor, render, swarm_rows
    from cgad.protocol.config import NetworkOptions

    options = NetworkOptions(run_id=args.run_id, peers=args.peers, swarm_key=args.swarm_key)
    with open_monitor(options) as monitor:
        # Ctrl-C (or SIGTERM) ends --watch between two tables: an interrupt in the middle of a
        # DHT read or of libp2p's shutdown left the monitor hanging (hivemind also ignores SIGINT)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        while True:
            rows = swarm_rows(monitor)
            text = as_json(args.run_id, rows) if args.json else render(args.run_id, rows)
            if args.watch and sys.stdout.isatty():
                print("\033[H\033[J", end="")  # redraw in place
            print(text, flush=True)
            if not args.watch or stop.wait(args.watch):
                return 0


def _cmd_leave(args: argparse.Namespace) -> int:
    from cgad.node.daemon.admin import call_admin

    call_admin(args.admin, "Leave")
    print(f"asked the node at {args.admin} to leave")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from cgad.node.front.export import export_checkpoint

    out = export_checkpoint(args.checkpoint_dir, args.out)
    print(f"wrote a Hugging Face model directory to {out}")
    return 0


# ---------------------------------------------------------------- demo and simulate


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    from cgad.node.config import DemoConfig

    demo = subparsers.add_parser(
        "demo",
        help="run a small real swarm on this machine and show it train",
        description="Start N nodes on 127.0.0.1 as separate processes (bundled corpus, tiny model), "
        "show their progress, and end with a summary table and a PNG of their loss curves.",
        argument_default=argparse.SUPPRESS,
    )
    add_config_flags(demo, DemoConfig)
    demo.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from cgad.node.config import DemoConfig
    from cgad.node.front.demo import run_demo

    png, interrupted = run_demo(config_from(DemoConfig, args))
    print(f"loss curves: {png.resolve()}")
    return 130 if interrupted else 0  # the shell's code for "stopped by Ctrl-C"


def _add_simulate(subparsers: argparse._SubParsersAction) -> None:
    from cgad.node.sim.config import SimConfig

    sim = subparsers.add_parser(
        "simulate",
        help="run the outer loop over a virtual swarm with controlled delay and failure",
        description="W workers in one process, each a full replica with its own data shard, the "
        "daemon's outer loop over an in-memory network with injected delay, loss, bandwidth, "
        "stragglers and churn. Writes one JSON record per (optimizer, seed) and a PNG beside it.",
        argument_default=argparse.SUPPRESS,
    )
    runs = sim.add_argument_group("runs")
    runs.add_argument(
        "--seeds", type=int, default=1, help="seeds per optimizer: --seed, --seed + 1, ... (default: 1)"
    )
    runs.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    runs.add_argument("--out", default="results.json", help="the JSON record; the PNG goes beside it")
    overrides = {
        "optimizer": {"action": "append", "help": "repeatable: one run per optimizer (default: cga)"},
        "stragglers": {
            "nargs": None,
            "type": str,
            "metavar": "F1,F2,...|K:F",
            "help": "slow-down factors, one per worker, or K:F (the last K workers F times slower)",
        },
    }
    add_config_flags(sim, SimConfig, overrides)
    sim.set_defaults(handler=_cmd_simulate)


def _cmd_simulate(args: argparse.Namespace) -> int:
    """Run the virtual swarm once per (optimizer, seed); write the JSON and a PNG beside it."""
    from pathlib import Path

    from cgad.node.sim.config import SimConfig

    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    base = config_from(SimConfig, args, skip=("optimizer",))
    optimizers = getattr(args, "optimizer", None) or [base.optimizer]
    # every configuration is validated before any work starts, each from what was given (the
    # defaults that follow the optimizer, as --mixing auto, follow each one)
    configs = [
        config_from(SimConfig, args, skip=("optimizer",), extra={"optimizer": opt, "seed": base.seed + k})
        for opt in optimizers
        for k in range(args.seeds)
    ]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    import torch

    from cgad.node.front.progress import progress_bar
    from cgad.node.front.report import plot_records
    from cgad.node.sim.simulate import simulate
    from cgad.node.training.data import load_dataset
    from cgad.node.training.tokenizer import load_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(base.tokenizer)
    dataset = load_dataset(tokenizer, base.data)
    total = sum(c.workers * c.inner_steps * c.rounds for c in configs)
    records = []
    with progress_bar(total, "simulate", "step") as bar:
        for config in configs:
            run = f"{config.optimizer} seed {config.seed}"
            bar.set_postfix_str(run)

            def show(round_: int, loss: float, run: str = run) -> None:
                bar.set_postfix_str(f"{run}, round {round_}, loss {loss:.3f}")

            record = simulate(config, dataset, tokenizer.vocab_size, progress=bar.update, on_round=show)
            records.append(record)
            bar.write(
                f"{config.optimizer:>16} seed {config.seed}: loss {record['initial_loss']:.3f} -> "
                f"{record['final_loss']:.3f}  mean age {record['mean_age']:.2f}"
                + ("  DIVERGED" if record["diverged"] else "")
            )
    # what follows the optimizer (mixing) is in each record's own config
    shared = {**base.model_dump(exclude={"optimizer", "mixing"}), "seeds": args.seeds}
    shared["optimizers"] = optimizers
    out.write_text(json.dumps({"config": shared, "records": records}, indent=1))
    png = plot_records(records, out.with_suffix(".png"), title=f"{base.workers} workers, delay {base.delay}")
    print(f"wrote {out} and {png}")
    return 0


Handler = Callable[[argparse.Namespace], int]


def build_parser() -> _Parser:
    parser = _Parser(
        prog="cgad-node",
        description="Train a language model across volunteers' machines with age-aware outer optimizers.",
    )
    parser.add_argument("--version", action="version", version=f"cgad-node {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    info = subparsers.add_parser("info", help="show versions, accelerator and available outer optimizers")
    info.set_defaults(handler=_cmd_info)
    _add_join(subparsers)
    _add_admin_commands(subparsers)
    _add_demo(subparsers)
    _add_simulate(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Unknown flags are reported before a missing command, so a typo is named even when it
    # stands alone (`cgad-node --verison`).
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        parser.error(f"a command is required (choose from {', '.join(commands)})")
    handler: Handler = args.handler
    try:
        return handler(args)
    except (ValueError, OSError) as exc:
        # bad input (a data path, a model config, an option's value) or an unreachable node
        # (ConnectionError is an OSError): say what, not where
        if os.environ.get("CGAD_DEBUG"):
            raise
        print(f"cgad-node {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
