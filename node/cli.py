"""The `cgad-node` command line: one parser, one subcommand per job.

Argparse errors name what was wrong and, where a known option or subcommand is close, suggest it;
every error exits with status 2 before anything runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cgad.node import __version__
from cgad.node.outer import OPTIMIZERS


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

    from cgad import optim

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"cgad-node     {__version__}")
    print(f"python        {platform.python_version()}")
    print(f"torch         {torch.__version__}")
    print(f"transformers  {transformers.__version__}")
    print(f"hivemind      {hivemind.__version__}")
    print(f"cuda device   {cuda}")
    classes = [name for name in optim.__all__ if name[0].isupper()]
    print(f"optimizers    {', '.join(classes)}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    """Run the virtual swarm once per (optimizer, seed); write the JSON and a PNG beside it."""
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from cgad.node.data import load_dataset
    from cgad.node.report import plot_records
    from cgad.node.simulate import SimConfig, parse_stragglers, simulate
    from cgad.node.tokenizer import load_tokenizer

    optimizers = args.optimizer or ["cgad"]
    # the flags share SimConfig's field names: take them all, then vary optimizer and seed
    shared = {k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(SimConfig)}}
    shared["stragglers"] = parse_stragglers(args.stragglers, args.workers)
    configs = [
        SimConfig(**{**shared, "optimizer": opt, "seed": seed})
        for opt in optimizers
        for seed in range(args.seeds)
    ]  # every configuration is validated before any work starts
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.tokenizer)
    dataset = load_dataset(tokenizer, args.data)
    total = sum(c.workers * c.inner_steps * c.rounds for c in configs)
    records = []
    with tqdm(total=total, unit="step", desc="simulate", dynamic_ncols=True) as bar:
        for config in configs:
            bar.set_postfix_str(f"{config.optimizer} seed {config.seed}")
            record = simulate(config, dataset, tokenizer.vocab_size, progress=bar.update)
            records.append(record)
            bar.write(
                f"{config.optimizer:>16} seed {config.seed}: loss {record['initial_loss']:.3f} -> "
                f"{record['final_loss']:.3f}  mean age {record['mean_age']:.2f}"
                + ("  DIVERGED" if record["diverged"] else "")
            )
    shared = {k: v for k, v in vars(args).items() if k not in ("handler", "command", "optimizer", "out")}
    out.write_text(json.dumps({"config": {**shared, "optimizers": optimizers}, "records": records}, indent=1))
    png = plot_records(records, out.with_suffix(".png"), title=f"{args.workers} workers, delay {args.delay}")
    print(f"wrote {out} and {png}")
    return 0


_JOIN_HELP = {
    "run_id": "name of the training run; peers of other runs are refused",
    "peers": "multiaddrs of peers already in the swarm (none: start a new swarm)",
    "host_maddrs": "multiaddrs to listen on, e.g. /ip4/0.0.0.0/tcp/31337",
    "announce_maddrs": "multiaddrs others should dial (a public IP behind port forwarding)",
    "identity": "key file for a stable peer id across restarts (created if missing)",
    "client_mode": "behind NAT: only dial out; be reached through relays",
    "use_relay": "use libp2p relays to reach and be reached by NATed peers",
    "grpc_host": "host for the direct gRPC data path ('none': libp2p only)",
    "maddrs_file": "write this node's multiaddrs here, one per line",
    "checkpoint_dir": "checkpoint here, and resume from it if it holds one",
    "data": ".txt/.md file, folder of them, or .jsonl with 'text' (default: bundled corpus)",
    "tokenizer": "a Hugging Face tokenizer directory (default: the bundled BPE)",
    "model": "preset (tiny, small, base, 1b) or a Llama config.json",
    "inner_steps": "H: inner steps per outer round",
    "fragments": "F: fragments synced in turn, one every H/F steps (Streaming DiLoCo)",
    "codec": "pseudo-gradient encoding on the wire",
    "fan_in": "at most this many peers' fragments fetched per fragment and round",
    "mixing": "gossip: also average outer parameters with a random peer",
    "device": "auto picks CUDA (with bf16 autocast) when present",
    "max_rounds": "stop after this many outer rounds (0: until told to leave)",
    "admin_port": "admin gRPC port on --admin-host, where `status` and `leave` look (0: any free port)",
    "metrics_port": "serve Prometheus metrics on this port",
    "dry_run": "validate the whole configuration, print it, and exit",
    "config": "YAML file of options (flags given on the command line win)",
}


def _add_join(subparsers: argparse._SubParsersAction) -> None:
    from cgad.node.config import CODECS, DEVICES, MIXING, NodeConfig

    join = subparsers.add_parser(
        "join",
        help="run a node: join a swarm (or start one) and train",
        description="Train locally and exchange age-weighted pseudo-gradient fragments with the swarm. "
        "Options can also come from a YAML file (--config); flags win.",
        argument_default=argparse.SUPPRESS,  # only flags actually given override the YAML file
    )
    join.add_argument("--config", help=_JOIN_HELP["config"])
    choices = {"optimizer": OPTIMIZERS, "codec": CODECS, "mixing": MIXING, "device": DEVICES}
    for name, spec in NodeConfig.fields().items():
        flag = "--" + name.replace("_", "-")
        kind = str(spec.type)
        default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
        helptext = _JOIN_HELP.get(name, "") + f" (default: {default})"
        if kind.startswith("bool"):
            join.add_argument(flag, action=argparse.BooleanOptionalAction, help=helptext)
        elif kind.startswith("list"):
            join.add_argument(flag, nargs="*", metavar="MULTIADDR", help=helptext)
        else:
            convert = int if kind.startswith("int") else float if kind.startswith("float") else str
            join.add_argument(flag, type=convert, choices=choices.get(name), help=helptext)
    join.set_defaults(handler=_cmd_join)


def _cmd_join(args: argparse.Namespace) -> int:
    import logging

    from cgad.node.config import NodeConfig, load_yaml

    flags = {k: v for k, v in vars(args).items() if k not in ("handler", "command", "config")}
    file_values = load_yaml(args.config) if getattr(args, "config", None) else {}
    config = NodeConfig.build(file_values, flags)
    if config.dry_run:
        print(json.dumps(dataclasses.asdict(config), indent=1))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from cgad.node.daemon import Node

    node = Node(config)
    try:
        return node.run()
    finally:
        node.close()


def _add_admin_commands(subparsers: argparse._SubParsersAction) -> None:
    from cgad.node.config import ADMIN_PORT

    status = subparsers.add_parser("status", help="show a running node's status")
    status.add_argument("--admin", default=f"127.0.0.1:{ADMIN_PORT}", help="the node's admin API (HOST:PORT)")
    status.add_argument("--json", action="store_true", help="print the raw status document")
    status.set_defaults(handler=_cmd_status)
    leave = subparsers.add_parser("leave", help="ask a node to finish its step, publish, checkpoint and exit")
    leave.add_argument("--admin", default=f"127.0.0.1:{ADMIN_PORT}", help="the node's admin API (HOST:PORT)")
    leave.set_defaults(handler=_cmd_leave)
    keygen = subparsers.add_parser(
        "keygen", help="create (or read) an identity key file and print its peer id"
    )
    keygen.add_argument("--out", required=True, help="key file; an existing one is read, not replaced")
    keygen.set_defaults(handler=_cmd_keygen)
    export = subparsers.add_parser("export", help="write a checkpoint as a Hugging Face model directory")
    export.add_argument("--checkpoint-dir", required=True)
    export.add_argument("--out", required=True, help="directory for config.json, weights and tokenizer")
    export.set_defaults(handler=_cmd_export)


def _cmd_keygen(args: argparse.Namespace) -> int:
    from cgad.protocol.records import Identity

    identity = Identity.load_or_create(args.out)
    print(identity.peer_id)
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from cgad.node.admin import call_admin

    status = call_admin(args.admin, "Status")
    if args.json:
        print(json.dumps(status, indent=1))
        return 0
    for key, value in status.items():
        if key not in ("eval_history", "applied_by_peer"):
            print(f"{key:<18} {value}")
    return 0


def _cmd_leave(args: argparse.Namespace) -> int:
    from cgad.node.admin import call_admin

    call_admin(args.admin, "Leave")
    print(f"asked the node at {args.admin} to leave")
    return 0


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="run a small real swarm on this machine and show it train",
        description="Start N nodes on 127.0.0.1 as separate processes (bundled corpus, tiny model), "
        "show their progress, and end with a summary table and a PNG of their loss curves.",
    )
    demo.add_argument("--nodes", type=int, default=3)
    demo.add_argument("--minutes", type=float, default=5.0)
    demo.add_argument("--out", default=".", help="folder for the PNG and the nodes' logs and checkpoints")
    demo.add_argument("--optimizer", default="cgad", choices=OPTIMIZERS)
    demo.add_argument("--model", default="tiny")
    demo.add_argument("--inner-steps", type=int, default=20)
    demo.add_argument("--batch-size", type=int, default=4)
    demo.add_argument("--seq-len", type=int, default=64)
    demo.add_argument("--inner-lr", type=float, default=1e-3)
    demo.set_defaults(handler=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cgad.node.demo import run_demo

    options = {
        "optimizer": args.optimizer,
        "model": args.model,
        "inner_steps": args.inner_steps,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "inner_lr": args.inner_lr,
        "codec": "fp16",
    }
    png = run_demo(args.nodes, args.minutes, Path(args.out), options)
    print(f"loss curves: {png.resolve()}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from cgad.node.export import export_checkpoint

    out = export_checkpoint(args.checkpoint_dir, args.out)
    print(f"wrote a Hugging Face model directory to {out}")
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


def _add_simulate(subparsers: argparse._SubParsersAction) -> None:
    from cgad.optim import DEFAULT_ALPHA, DEFAULT_CUTOFF

    sim = subparsers.add_parser(
        "simulate",
        help="run the outer loop over a virtual swarm with controlled delay and failure",
        description="W workers in one process, each a full replica with its own data shard, the "
        "daemon's outer loop over an in-memory network with injected delay, loss, bandwidth, "
        "stragglers and churn. Writes one JSON record per (optimizer, seed) and a PNG beside it.",
    )
    sim.add_argument("--workers", type=int, default=4)
    sim.add_argument("--inner-steps", type=int, default=10, help="H: inner steps per outer round")
    sim.add_argument("--rounds", type=int, default=20)
    sim.add_argument("--delay", default="0", help="delay in outer rounds: N, or random:MAX (uniform 0..MAX)")
    sim.add_argument("--drop", type=float, default=0.0, help="probability a delivery is lost")
    sim.add_argument("--bandwidth", type=float, default=None, help="uplink bytes per virtual second")
    sim.add_argument(
        "--stragglers", default="", help="slow-down factors: F1,F2,... or K:F (K workers F x slower)"
    )
    sim.add_argument(
        "--churn", type=float, default=0.0, help="chance per round a worker leaves for 1-4 rounds"
    )
    sim.add_argument("--optimizer", action="append", choices=OPTIMIZERS, help="repeatable; default cgad")
    sim.add_argument("--outer-lr", type=float, default=None, help="overrides each optimizer's default")
    sim.add_argument("--alpha", type=float, default=DEFAULT_ALPHA, help="CGAD decay per round of age")
    sim.add_argument("--cutoff", type=float, default=DEFAULT_CUTOFF, help="CGAD gate cutoff in rounds")
    sim.add_argument("--fragments", type=int, default=4, help="PA-CGAD's fragments (H must be a multiple)")
    sim.add_argument("--seeds", type=int, default=1)
    sim.add_argument("--data", default=None, help=".txt/.md file, folder of them, or .jsonl with 'text'")
    sim.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer directory")
    sim.add_argument("--model", default="tiny", help="preset (tiny, small, base, 1b) or a config.json")
    sim.add_argument("--batch-size", type=int, default=8)
    sim.add_argument("--seq-len", type=int, default=128)
    sim.add_argument("--inner-lr", type=float, default=4e-4)
    sim.add_argument("--warmup-steps", type=int, default=0)
    sim.add_argument("--eval-batches", type=int, default=4)
    sim.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    sim.add_argument("--out", default="results.json")
    sim.set_defaults(handler=_cmd_simulate)


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
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        # bad input (a data path, a model config, an option's value): say what, not where
        if os.environ.get("CGAD_DEBUG"):
            raise
        print(f"cgad-node {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
