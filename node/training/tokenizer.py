"""Tokenizers: a byte-level BPE trained on the bundled corpus, or a user's Hugging Face tokenizer.

Both are wrapped in one `Tokenizer` so the trainer, the data pipeline and the exporter never care
which kind they hold. Training happens once per (corpus, vocab size) and is cached on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from cgad.node.training.corpus import bundled_corpus_files, cache_root
from cgad.protocol.files import atomic_write

DEFAULT_VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
# Bumped whenever the training recipe below changes, so old cache entries are not reused.
_RECIPE = "bytelevel-bpe-v1"
# Text whose ids enter the fingerprint: exercises merges, whitespace runs, digits, non-ASCII.
_PROBE = "To be, or not to be: that is the question.\n\n  Whether 'tis nobler 1603 — ñ 漢字 🙂\t<end>"


class TokenizerError(ValueError):
    """A tokenizer could not be built or loaded; the message names the path involved."""


class Tokenizer:
    """A uniform face over any Hugging Face tokenizer: ids in and out, a fingerprint, export."""

    def __init__(self, hf: PreTrainedTokenizerBase, source: str) -> None:
        self.hf = hf
        self.source = source
        self.fingerprint = _fingerprint(hf)

    @property
    def vocab_size(self) -> int:
        """Number of ids the model's embedding must hold (added tokens included)."""
        return len(self.hf)

    @property
    def eos_id(self) -> int | None:
        """Id placed between documents; None when the tokenizer defines no end-of-text token."""
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False, verbose=False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        batch = self.hf(list(texts), add_special_tokens=False, verbose=False)
        return [list(ids) for ids in batch["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))

    def save_pretrained(self, directory: str | os.PathLike[str]) -> None:
        """Write the tokenizer files into an (exported) Hugging Face model directory."""
        self.hf.save_pretrained(str(directory))

    def __repr__(self) -> str:
        fingerprint = self.fingerprint[:12]
        return f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, fingerprint={fingerprint})"


def load_tokenizer(
    path: str | os.PathLike[str] | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """The bundled-corpus BPE (path None) or the Hugging Face tokenizer saved in directory `path`.

    `vocab_size` and `cache_dir` only concern the bundled BPE.
    """
    if path is None:
        return train_bpe(bundled_corpus_files(), vocab_size=vocab_size, cache_dir=cache_dir)
    return load_hf_tokenizer(path)


def load_hf_tokenizer(directory: str | os.PathLike[str]) -> Tokenizer:
    """A user's tokenizer directory (as written by `save_pretrained`), read from disk only."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TokenizerError(f"tokenizer directory {directory} does not exist or is not a directory")
    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"cannot load a Hugging Face tokenizer from {directory}: {exc}") from exc
    return Tokenizer(hf, source=str(directory))


def train_bpe(
    files: Sequence[Path],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Tokenizer:
    """Train (or load from the cache) a byte-level BPE on the given text files.

    The cache entry is keyed by the files' contents, the vocab size and the recipe, so a changed
    corpus or setting retrains, and an unchanged one never does.
    """
    if vocab_size < 257:  # 256 byte symbols plus the end-of-text token
        raise TokenizerError(f"vocab_size must be at least 257 for a byte-level BPE, got {vocab_size}")
    if not files:
        raise TokenizerError("no files to train the tokenizer on")
    digest = hashlib.sha256(f"{_RECIPE}\0{vocab_size}\0".encode())
    texts = []
    for file in files:
        raw = Path(file).read_bytes()
        digest.update(hashlib.sha256(raw).digest())
        texts.append(raw.decode("utf-8"))
    target = cache_root(cache_dir) / "tokenizers" / f"bpe-{vocab_size}-{digest.hexdigest()[:20]}.json"
    if not target.exists():
        raw_tok = _train_raw(texts, vocab_size)
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, raw_tok.to_str().encode())
    hf = PreTrainedTokenizerFast(tokenizer_file=str(target), eos_token=EOS_TOKEN, bos_token=EOS_TOKEN)
    return Tokenizer(hf, source=f"bpe:{target.name}")


def _train_raw(texts: list[str], vocab_size: int) -> _RawTokenizer:
    tok = _RawTokenizer(models.BPE())
    # GPT-2 style: split on the regex, map bytes to printable symbols, no prefix space, so that
    # decode(encode(x)) == x for any text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _fingerprint(hf: PreTrainedTokenizerBase) -> str:
    """A hash of what decides the ids: the vocabulary and the ids of a probe text.

    Hashing the serialized tokenizer.json instead would make peers on different `tokenizers`
    versions (which add fields to the JSON) refuse each other although they tokenize alike.
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(sorted(hf.get_vocab().items()), ensure_ascii=False).encode())
    digest.update(json.dumps(hf.encode(_PROBE, add_special_tokens=False)).encode())
    digest.update(json.dumps([hf.eos_token_id, hf.bos_token_id]).encode())
    return digest.hexdigest()
