import itertools
import json
import re

import numpy as np
import pytest
import torch

from cgad.node.training.data import (
    BUNDLED_SOURCE,
    DataError,
    TokenDataset,
    bundled_corpus_files,
    cache_root,
    load_dataset,
)
from cgad.node.training.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    TokenizerError,
    load_hf_tokenizer,
    load_tokenizer,
    train_bpe,
)

SAMPLE = "To be, or not to be:  that is\n\tthe question. Ñandú 漢字 🙂 1603"


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Nothing a test does may land in the user's real cache."""
    monkeypatch.setenv("CGAD_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="session")
def bpe_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bpe-cache")


@pytest.fixture(scope="session")
def tokenizer(bpe_cache):
    """The bundled BPE, trained once for the whole session."""
    return load_tokenizer(cache_dir=bpe_cache)


# ---------------------------------------------------------------- tokenizer


def test_bundled_bpe_basics(tokenizer):
    assert tokenizer.vocab_size == DEFAULT_VOCAB_SIZE
    assert tokenizer.decode(tokenizer.encode(SAMPLE)) == SAMPLE  # byte-level: every text round-trips
    assert tokenizer.eos_id is not None
    assert tokenizer.encode_batch([SAMPLE, "x"]) == [tokenizer.encode(SAMPLE), tokenizer.encode("x")]
    # Trained on Shakespeare, common words are single tokens.
    assert len(tokenizer.encode(" the king")) == 2


@pytest.mark.slow
def test_training_is_deterministic(tokenizer, bpe_cache, tmp_path):
    again = load_tokenizer(cache_dir=tmp_path / "other")
    (first,) = (bpe_cache / "tokenizers").glob("*.json")
    (second,) = (tmp_path / "other" / "tokenizers").glob("*.json")
    assert first.name == second.name
    assert first.read_bytes() == second.read_bytes()
    assert again.encode(SAMPLE) == tokenizer.encode(SAMPLE)
    assert again.fingerprint == tokenizer.fingerprint


def test_second_load_reuses_the_cache(tokenizer, bpe_cache):
    (cached,) = (bpe_cache / "tokenizers").glob("*.json")
    before = cached.stat()
    again = load_tokenizer(cache_dir=bpe_cache)
    after = cached.stat()
    # A retrain would have renamed a fresh file into place: new inode, new mtime.
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert again.fingerprint == tokenizer.fingerprint
    assert [p.name for p in (bpe_cache / "tokenizers").iterdir()] == [cached.name]  # no temp files left


def test_cache_dir_comes_from_the_environment(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 50)
    train_bpe([corpus], vocab_size=300)
    assert len(list((tmp_path / "cache" / "tokenizers").glob("bpe-300-*.json"))) == 1

    monkeypatch.delenv("CGAD_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "cgad-node"
    assert cache_root(tmp_path / "explicit") == tmp_path / "explicit"


def test_fingerprint_tells_tokenizers_apart(tokenizer, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat. " * 50)
    small = train_bpe([corpus], vocab_size=300)
    assert small.vocab_size <= 300
    assert small.fingerprint != tokenizer.fingerprint
    corpus.write_text("the dog lay on the rug. " * 50)
    assert train_bpe([corpus], vocab_size=300).fingerprint != small.fingerprint


def test_saved_tokenizer_loads_as_a_user_tokenizer(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path / "export")
    user = load_tokenizer(tmp_path / "export")
    assert user.encode(SAMPLE) == tokenizer.encode(SAMPLE)
    assert user.decode(user.encode(SAMPLE)) == SAMPLE
    assert user.eos_id == tokenizer.eos_id
    assert user.vocab_size == tokenizer.vocab_size
    # Peers that saved and reloaded the same tokenizer must still agree.
    assert user.fingerprint == tokenizer.fingerprint


def test_bad_tokenizer_paths(tmp_path):
    with pytest.raises(TokenizerError, match="does not exist") as info:
        load_hf_tokenizer(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="cannot load") as info:
        load_hf_tokenizer(tmp_path / "empty")
    assert str(tmp_path / "empty") in str(info.value)
    with pytest.raises(TokenizerError, match="at least 257"):
        load_tokenizer(vocab_size=100)


# ---------------------------------------------------------------- reading and caching data


def _expected(tokenizer, docs):
    return [i for doc in docs for i in [*tokenizer.encode(doc), tokenizer.eos_id]]


def test_text_file(tokenizer, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(SAMPLE)
    ds = load_dataset(tokenizer, path)
    assert ds.tokens.tolist() == _expected(tokenizer, [SAMPLE])
    assert ds.source == str(path)


def test_folder_is_read_recursively_in_sorted_order(tokenizer, tmp_path):
    root = tmp_path / "corpus"
    (root / "b" / "deeper").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b" / "deeper" / "z.md").write_text("zeta")
    (root / "b" / "a.txt").write_text("alpha")
    (root / "c.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n" + json.dumps({"text": "delta"}) + "\n")
    (root / "a.md").write_text("first")
    (root / "skipped.csv").write_text("not, text")
    (root / ".git" / "HEAD.txt").write_text("hidden")
    ds = load_dataset(tokenizer, root)
    assert ds.tokens.tolist() == _expected(tokenizer, ["first", "alpha", "zeta", "gamma", "delta"])


def test_jsonl_skips_blank_lines(tokenizer, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "one", "id": 1}\n\n{"text": "two"}\n')
    assert load_dataset(tokenizer, path).tokens.tolist() == _expected(tokenizer, ["one", "two"])


def test_token_cache_is_reused_and_keyed_by_content(tokenizer, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(SAMPLE)
    first = load_dataset(tokenizer, path)
    (cached,) = (tmp_path / "cache" / "tokens").glob("*.npy")
    assert np.load(cached).dtype == np.uint16  # a 4096-token vocabulary fits 16 bits
    before = cached.stat()
    again = load_dataset(tokenizer, path)
    after = cached.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert np.array_equal(again.tokens, first.tokens)
    path.write_text(SAMPLE + " more")
    changed = load_dataset(tokenizer, path)
    assert len(list((tmp_path / "cache" / "tokens").glob("*.npy"))) == 2
    assert len(changed) > len(first)


@pytest.mark.slow
def test_bundled_corpus(tokenizer):
    files = bundled_corpus_files()
    assert len(files) == 38
    ds = load_dataset(tokenizer)
    assert ds.source == BUNDLED_SOURCE
    assert len(ds) > 1_000_000
    assert int((np.asarray(ds.tokens) == tokenizer.eos_id).sum()) == len(files)  # one per play
    assert 0.04 < len(ds.eval_tokens) / len(ds) < 0.06
    (batch,) = ds.eval_batches(1, 2, 256)
    assert batch.shape == (2, 256) and batch.dtype == torch.int64


# ---------------------------------------------------------------- splits, shards and batches

N = 20_000


@pytest.fixture
def positions():
    """A corpus whose token at position i is i, so every window shows where it was cut from."""
    return TokenDataset(np.arange(N, dtype=np.int32), source="positions")


def _starts(batch):
    assert torch.equal(batch - batch[:, :1], torch.arange(batch.shape[1]).expand_as(batch))  # contiguous
    return batch[:, 0].tolist()


def test_split_keeps_the_tail_for_evaluation(positions):
    assert positions.split == N - N // 20
    assert positions.train_tokens[-1] + 1 == positions.eval_tokens[0]


@pytest.mark.parametrize("workers", [1, 3, 7])
def test_shards_are_disjoint_and_cover_the_training_tokens(positions, workers):
    seq_len = 32
    shards = [positions.shard(i, workers) for i in range(workers)]
    assert shards[0].start == 0 and shards[-1].stop == positions.split
    for left, right in itertools.pairwise(shards):
        assert left.stop == right.start
    for shard in shards:
        batches = shard.batches(batch_size=16, seq_len=seq_len, seed=0)
        for _ in range(20):
            for start in _starts(next(batches)):
                assert shard.start <= start and start + seq_len <= shard.stop


def test_eval_batches_are_held_out_and_fixed(positions):
    batches = positions.eval_batches(n=3, batch_size=4, seq_len=50)
    assert len(batches) == 3 and all(b.shape == (4, 50) for b in batches)
    starts = [s for b in batches for s in _starts(b)]
    assert min(starts) == positions.split and max(starts) + 50 == N  # spread over the whole tail
    again = positions.eval_batches(n=3, batch_size=4, seq_len=50)
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))


def test_batches_are_seeded(positions):
    def draw(worker, seed, count=5):
        it = positions.shard(worker, 2).batches(batch_size=8, seq_len=16, seed=seed)
        return torch.stack([next(it) for _ in range(count)])

    assert torch.equal(draw(0, seed=1), draw(0, seed=1))
    assert not torch.equal(draw(0, seed=1), draw(0, seed=2))
    # Same seed, other worker: its own shard, and not the same offsets within it.
    offsets0 = draw(0, seed=1) - positions.shard(0, 2).start
    offsets1 = draw(1, seed=1) - positions.shard(1, 2).start
    assert not torch.equal(offsets0, offsets1)


def test_batch_stream_resumes_from_its_state(positions):
    it = positions.shard(0, 1).batches(batch_size=4, seq_len=8, seed=5)
    next(it)
    state = json.loads(json.dumps(it.state_dict()))  # it must survive a JSON checkpoint
    expected = [next(it) for _ in range(3)]
    resumed = positions.shard(0, 1).batches(batch_size=4, seq_len=8, seed=999)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, next(resumed)) for a in expected)


# ---------------------------------------------------------------- errors


def test_missing_path(tokenizer, tmp_path):
    with pytest.raises(DataError, match="does not exist") as info:
        load_dataset(tokenizer, tmp_path / "nope.txt")
    assert str(tmp_path / "nope.txt") in str(info.value)


def test_folder_without_text_files(tokenizer, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "table.csv").write_text("a,b")
    with pytest.raises(DataError, match=re.escape("holds no .txt, .md or .jsonl files")) as info:
        load_dataset(tokenizer, tmp_path / "data")
    assert str(tmp_path / "data") in str(info.value)


def test_only_blank_text(tokenizer, tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text("  \n\n")
    (tmp_path / "data" / "b.md").write_text("")
    with pytest.raises(DataError, match="holds no text"):
        load_dataset(tokenizer, tmp_path / "data")


def test_unsupported_file_type(tokenizer, tmp_path):
    path = tmp_path / "table.csv"
    path.write_text("a,b")
    with pytest.raises(DataError, match=re.escape("is not a .txt, .md or .jsonl file")):
        load_dataset(tokenizer, path)


def test_non_utf8_file(tokenizer, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8") as info:
        load_dataset(tokenizer, path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"text": "ok"}', "{broken"], "line 2 is not valid JSON"),
        (['{"text": "ok"}', "", '{"body": "no text"}'], 'line 3 has no string field "text"'),
        (['{"text": 5}'], 'line 1 has no string field "text"'),
        (['["text"]'], 'line 1 has no string field "text"'),
    ],
)
def test_bad_jsonl_names_the_line(tokenizer, tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message) as info:
        load_dataset(tokenizer, path)
    assert str(path) in str(info.value)


def test_corpus_too_small_for_a_window(tokenizer, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("Exeunt. " * 40)
    ds = load_dataset(tokenizer, path)
    with pytest.raises(DataError, match="too small") as info:
        ds.shard(0, 1).batches(batch_size=2, seq_len=256, seed=0)
    assert str(path) in str(info.value)
    with pytest.raises(DataError, match="held-out part"):
        ds.eval_batches(1, 2, seq_len=256)
    # More workers leave each one less: a window that fits one worker may not fit eight.
    ds.shard(0, 1).batches(batch_size=2, seq_len=32, seed=0)
    with pytest.raises(DataError, match="worker 0 of 8"):
        ds.shard(0, 8).batches(batch_size=2, seq_len=32, seed=0)


def test_bad_arguments(positions):
    with pytest.raises(ValueError, match="worker_index"):
        positions.shard(2, 2)
    with pytest.raises(ValueError, match="eval_fraction"):
        TokenDataset(np.arange(10), "x", eval_fraction=1.0)
    with pytest.raises(ValueError, match="positive"):
        positions.eval_batches(0, 1, 1)
