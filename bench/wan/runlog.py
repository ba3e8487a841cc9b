"""A WAN run's record on disk: compressed JSON Lines holding, per status sample, what changed.

``run.py`` polls every node's status every few seconds, and a status repeats most of the previous
one (its whole evaluation history, its counters): stored whole, a 10-minute run of 4 nodes took
1-2.5 MB. A run is stored instead as ``<name>.jsonl.gz`` (gzip, one JSON document a line):

- line 1, the header: ``{"format": "cgad-wan-run", "version": 1, "run": {...}}``, the run's
  record (scenario, commit, testbed, final statuses, checks, ...) with ``"samples"`` holding the
  number of samples that follow, in its place among the keys;
- then one line per sample, in order: ``{"s": sample}``, the sample whole (an event, or a node's
  first sample), or ``{"n": node, "d": delta}``, what changed since node ``n``'s previous sample.

A delta of dict ``old`` into dict ``new`` has up to four parts, applied in this order:
``"del"`` (keys removed), ``"sub"`` (key -> delta of a dict value), ``"add"`` (key -> the items
appended to a list value that only grew, e.g. ``eval_history``), ``"set"`` (key -> new value,
whole; keys new to the dict are appended in this order). Every line is checked as it is written:
it decodes to the sample exactly (same keys in the same order, same values and types), else the
sample is stored whole. ``read_run`` returns the record as the runner made it, samples and all.

Records written before this format (``<name>.json``, the record as one JSON document) are read too.

    python bench/wan/runlog.py convert bench/results/wan/NAME.json ...   # writes NAME.jsonl.gz beside
    python bench/wan/runlog.py show bench/results/wan/NAME.jsonl.gz      # the record as one JSON
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "SUFFIX", "VERSION", "find_run", "read_run", "run_names", "same", "write_run"]

FORMAT = "cgad-wan-run"
VERSION = 1
SUFFIX = ".jsonl.gz"
LEGACY_SUFFIX = ".json"


# -- deltas --------------------------------------------------------------------------------------


def same(a: Any, b: Any) -> bool:
    """Equal as JSON documents are: same types (1 is not 1.0 nor True), same keys in the same
    order, floats with the same repr (-0.0 is not 0.0; NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return repr(a) == repr(b) or (math.isnan(a) and math.isnan(b))
    return a == b


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")))


def diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The delta that ``patch`` turns ``old`` into ``new`` with (key order aside: see ``encode``)."""
    delta: dict[str, dict | list] = {"del": [k for k in old if k not in new], "sub": {}, "add": {}, "set": {}}
    for key, value in new.items():
        if key not in old:
            delta["set"][key] = value
            continue
        before = old[key]
        if same(before, value):
            continue
        if isinstance(before, list) and isinstance(value, list) and len(value) > len(before):
            if same(value[: len(before)], before):
                delta["add"][key] = value[len(before) :]
                continue
        if isinstance(before, dict) and isinstance(value, dict):
            nested = diff(before, value)
            if _size(nested) < _size(value):
                delta["sub"][key] = nested
                continue
        delta["set"][key] = value
    return {part: content for part, content in delta.items() if content}


def patch(old: dict[str, Any], delta: dict[str, Any]) -> dict[str, Any]:
    """``old`` with ``delta`` applied (``old`` itself is left as it was)."""
    new = dict(old)
    for key in delta.get("del", []):
        del new[key]
    for key, nested in delta.get("sub", {}).items():
        new[key] = patch(old[key], nested)
    for key, tail in delta.get("add", {}).items():
        new[key] = [*old[key], *tail]
    for key, value in delta.get("set", {}).items():
        new[key] = value
    return new


def encode(samples: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """One line per sample: a node's sample as a delta from that node's previous one, whole where
    it is the first, where it is not a node's sample, or where the delta would not decode to it
    exactly (a key moved, say)."""
    previous: dict[Any, dict[str, Any]] = {}
    for sample in samples:
        node = sample.get("node") if isinstance(sample, dict) else None
        line: dict[str, Any] = {"s": sample}
        if node is not None and node in previous:
            delta = diff(previous[node], sample)
            if same(patch(previous[node], delta), sample):
                line = {"n": node, "d": delta}
        if node is not None:
            previous[node] = sample
        yield line


def decode(lines: Iterator[dict[str, Any]] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples back from ``encode``'s lines."""
    samples: list[dict[str, Any]] = []
    previous: dict[Any, dict[str, Any]] = {}
    for line in lines:
        if "s" in line:
            sample = line["s"]
        else:
            sample = patch(previous[line["n"]], line["d"])
        node = sample.get("node") if isinstance(sample, dict) else None
        if node is not None:
            previous[node] = sample
        samples.append(sample)
    return samples


# -- files ---------------------------------------------------------------------------------------


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def write_run(path: str | Path, result: dict[str, Any]) -> Path:
    """Write ``result`` (a run's record, with its ``samples``) to ``path`` (``*.jsonl.gz``), so
    that ``read_run`` gives it back exactly; the bytes depend on the record alone (no timestamp or
    file name in the gzip header)."""
    path = Path(path)
    if not path.name.endswith(SUFFIX):
        raise ValueError(f"{path}: a run is written as *{SUFFIX}")
    samples = result.get("samples", [])
    header = {"format": FORMAT, "version": VERSION, "run": {**result, "samples": len(samples)}}
    text = io.StringIO()
    text.write(_dumps(header) + "\n")
    for line in encode(samples):
        text.write(_dumps(line) + "\n")
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as out:
        out.write(text.getvalue().encode())
    tmp.replace(path)
    return path


def read_run(path: str | Path) -> dict[str, Any]:
    """A run's record, from ``*.jsonl.gz`` or from a record written whole (``*.json``)."""
    path = Path(path)
    if not path.name.endswith(SUFFIX):
        return json.loads(path.read_text())
    with gzip.open(path, "rt") as lines:
        header = json.loads(next(lines))
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise ValueError(f"{path}: not a {FORMAT} version {VERSION} file")
        run = header["run"]
        samples = decode(json.loads(line) for line in lines)
    if len(samples) != run["samples"]:
        raise ValueError(f"{path}: {len(samples)} samples, the header says {run['samples']} (cut short?)")
    run["samples"] = samples  # in its place among the keys
    return run


def find_run(directory: str | Path, name: str) -> Path:
    """The file of run ``name`` in ``directory``: ``name.jsonl.gz``, else ``name.json``."""
    for suffix in (SUFFIX, LEGACY_SUFFIX):
        path = Path(directory) / f"{name}{suffix}"
        if path.exists():
            return path
    raise FileNotFoundError(f"no run {name!r} in {directory} (no {name}{SUFFIX}, no {name}{LEGACY_SUFFIX})")


def run_names(directory: str | Path) -> list[str]:
    """The names of the runs in ``directory``, in either format (summaries are not runs)."""
    names = set()
    for path in Path(directory).iterdir():
        for suffix in (SUFFIX, LEGACY_SUFFIX):
            if path.name.endswith(suffix) and not path.name.startswith("summary"):
                names.add(path.name[: -len(suffix)])
                break
    return sorted(names)


# -- the command line ----------------------------------------------------------------------------


def convert(path: Path) -> Path:
    """``NAME.json`` to ``NAME.jsonl.gz`` beside it, checked to read back as the same record."""
    result = json.loads(path.read_text())
    out = write_run(path.with_name(path.name[: -len(LEGACY_SUFFIX)] + SUFFIX), result)
    if not same(read_run(out), result):
        out.unlink()
        raise RuntimeError(f"{out} does not read back as {path}: left {path} alone")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    converting = commands.add_parser("convert", help=f"write NAME{SUFFIX} beside each NAME.json (kept)")
    converting.add_argument("files", nargs="+", type=Path)
    showing = commands.add_parser("show", help="print a run's record as one JSON document")
    showing.add_argument("file", type=Path)
    args = parser.parse_args()
    if args.command == "show":
        json.dump(read_run(args.file), sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    for path in args.files:
        out = convert(path)
        print(f"{path} ({path.stat().st_size} bytes) -> {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
