"""The `cgad-node` command line: one parser, one subcommand per job.

Argparse errors name what was wrong and, where a known option or subcommand is close, suggest it;
every error exits with status 2 before anything runs.
"""

from __future__ import annotations

import argparse
import difflib
import platform
import sys
from collections.abc import Callable, Sequence

from cgad.node import __version__


class _Parser(argparse.ArgumentParser):
    """ArgumentParser whose errors suggest the closest known flag or subcommand."""

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
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
