"""A configuration model as command-line flags: one flag per field, grouped by the part of the
configuration it belongs to, its help saying the default; the YAML file and the flags given merged
over the defaults (``build_config``); and the short help that lists only some of them, with
``--help-all`` for the rest.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from typing import Any

__all__ = ["HelpAll", "add_config_flags", "config_from", "file_only_keys", "flag"]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap_optional(annotation: Any) -> Any:
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else str
    return annotation


def _add_field(group: argparse._ArgumentGroup, name: str, field: Any, **override: Any) -> None:
    """One flag for one config field: its type, choices, and help with the default."""
    annotation = _unwrap_optional(field.annotation)
    default = field.get_default(call_default_factory=True)
    shown = " ".join(map(str, default)) if isinstance(default, list) else default
    suffix = "" if default is None else f" (default: {shown})"
    kwargs: dict[str, Any] = {"help": f"{field.description or ''}{suffix}"}
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if annotation is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        kwargs["nargs"] = "*"
        if typing.get_origin(item) is typing.Literal:
            kwargs["choices"] = typing.get_args(item)
        else:
            text = "PEER_ID" if name == "allow" else "MULTIADDR"  # the list fields of text
            kwargs["metavar"] = text if item is str else item.__name__.upper()
    elif typing.get_origin(annotation) is typing.Literal:
        kwargs["choices"] = typing.get_args(annotation)
    else:
        kwargs["type"] = annotation if annotation in (int, float) else str
    kwargs.update(override)
    group.add_argument(flag(name), **kwargs)


class HelpAll(argparse.Action):
    """``--help-all``: the help with every option, grouped by part, then exit."""

    def __init__(self, option_strings: list[str], dest: str, full: Any = None, **kwargs: Any) -> None:
        kwargs.pop("default", None)
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.full = full

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        self.full(parser.prog).print_help()
        parser.exit()


def add_config_flags(
    parser: argparse.ArgumentParser,
    model: type,
    overrides: dict[str, dict[str, Any]] | None = None,
    shown: Sequence[str] | None = None,
) -> None:
    """Every field of ``model`` as a flag, grouped by the part of the configuration it belongs to,
    but the internals marked file-only (``file_only_keys``: keys of the config file alone). Flags
    not given stay absent (argument_default=SUPPRESS): a YAML file's values then stand.
    ``shown``: the only fields the help lists (every flag is still taken); None: all of them."""
    overrides = dict(overrides or {})
    internal = set(file_only_keys(model))
    if shown is not None:
        for name in set(model.model_fields) - set(shown):
            overrides[name] = {**overrides.get(name, {}), "help": argparse.SUPPRESS}
    parser.add_argument("--config", help="YAML file of these options (flags given on the command line win)")
    done: set[str] = set()
    from pydantic import BaseModel

    for part in [m for m in model.__mro__ if issubclass(m, BaseModel) and m is not BaseModel]:
        own = [
            n for n in getattr(part, "__annotations__", {})
            if n in model.model_fields and n not in done and n not in internal
        ]  # fmt: skip
        if not own:
            continue
        title = (part.__doc__ or part.__name__).strip().splitlines()[0].rstrip(".")
        if shown is not None and not set(own) & set(shown):
            title = None  # a part the short help lists nothing of: no empty heading
        group = parser.add_argument_group(title)
        for name in own:
            _add_field(group, name, model.model_fields[name], **overrides.get(name, {}))
            done.add(name)


def file_only_keys(model: type) -> list[str]:
    """The fields of ``model`` that are keys of the config file only, not flags (internals)."""
    return [
        name for name, field in model.model_fields.items()
        if isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("file_only")
    ]  # fmt: skip


def config_from(
    model: type, args: argparse.Namespace, skip: Sequence[str] = (), extra: dict[str, Any] | None = None
) -> Any:
    """The configuration: defaults < the YAML file (``--config``) < flags given < ``extra``."""
    from cgad.node.config import build_config, load_yaml

    flags = {k: v for k, v in vars(args).items() if k in model.model_fields and k not in skip}
    path = getattr(args, "config", None)
    file_values = load_yaml(path, model) if path else {}
    return build_config(model, (f"config file {path}", file_values), ("", flags), ("", extra or {}))
