import json
import math

import pytest
import torch

from cgad.node.training.model import PRESETS, ModelConfigError, build_model, model_config, parameter_count

VOCAB = 4096
# What each preset is advertised as, at the bundled tokenizer's vocabulary.
ADVERTISED = {"tiny": 2e6, "small": 25e6, "base": 150e6, "1b": 1e9}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_preset_sizes_match_their_names(preset):
    config = model_config(preset, VOCAB)
    count = parameter_count(config)
    assert 0.8 * ADVERTISED[preset] <= count <= 1.2 * ADVERTISED[preset]
    # On the meta device the weights take no memory, so even 1b is free to check against the formula.
    model = build_model(preset, VOCAB, seed=0, device="meta")
    assert parameter_count(model) == count
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config.max_position_embeddings == PRESETS[preset]["max_position_embeddings"]


def test_tiny_is_tied_fp32_sdpa_and_counts_the_embedding_once():
    model = build_model("tiny", VOCAB, seed=0)
    assert model.config._attn_implementation == "sdpa"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    stored = sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    assert parameter_count(model) == stored - VOCAB * model.config.hidden_size
    assert parameter_count(model) == parameter_count(model.config)


def test_untied_config_counts_both_embeddings():
    tied = model_config("tiny", VOCAB)
    untied = model_config("tiny", VOCAB, tie_word_embeddings=False)
    assert parameter_count(untied) - parameter_count(tied) == VOCAB * tied.hidden_size
    assert parameter_count(build_model("tiny", VOCAB, seed=0, tie_word_embeddings=False)) == parameter_count(
        untied
    )


def test_init_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = build_model("tiny", VOCAB, seed=7)
    assert torch.equal(torch.rand(3), expected)
    # Initialisation runs on the CPU whatever the target device, so the weights never depend on it.
    b = build_model("tiny", VOCAB, seed=7, device="cpu")
    c = build_model("tiny", VOCAB, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if "norm" not in name:  # RMSNorm weights start at one whatever the seed
            assert not torch.equal(pa, pc), name


def test_forward_backward_on_tiny():
    vocab = 512
    model = build_model("tiny", vocab, seed=0)
    ids = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    # A fresh model predicts close to uniformly.
    assert abs(loss.item() - math.log(vocab)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 64, vocab)


def test_full_length_sequence_fits_tiny():
    seq_len = PRESETS["tiny"]["max_position_embeddings"]
    model = build_model("tiny", 300, seed=0)
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, seq_len, 300)


def _user_config(**extra):
    fields = dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        vocab_size=32000,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    fields.update(extra)
    return fields


def test_user_config_file_and_folder(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_user_config()))
    for spec in (str(path), tmp_path):
        model = build_model(spec, 1000, seed=0)
        # The tokenizer's vocabulary wins over the file's; the rest is the user's.
        assert model.config.vocab_size == 1000
        assert model.config.num_key_value_heads == 2
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        assert parameter_count(model) == parameter_count(model.config)


def test_exported_model_folder_builds_the_same_architecture(tmp_path):
    model = build_model("tiny", 700, seed=3)
    model.save_pretrained(tmp_path)
    rebuilt = build_model(tmp_path, 700, seed=3)
    for (name, a), b in zip(model.named_parameters(), rebuilt.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "neither a preset"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps(_user_config(model_type="gpt2")), "only 'llama'"),
        (json.dumps({"hidden_size": 64, "num_hidden_layers": 2}), "intermediate_size, num_attention_heads"),
        (json.dumps(_user_config(hidden_size=66)), "hidden_size 66 is not divisible"),
        (json.dumps(_user_config(num_key_value_heads=3)), "num_key_value_heads"),
    ],
)
def test_bad_user_config_gives_a_clear_error(tmp_path, content, message):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ModelConfigError, match=message) as info:
        build_model(str(path), 100, seed=0)
    assert str(path) in str(info.value)


def test_unknown_preset_lists_the_presets():
    with pytest.raises(ModelConfigError, match="tiny, small, base, 1b"):
        model_config("huge", VOCAB)
    with pytest.raises(ModelConfigError, match="vocab_size"):
        model_config("tiny", 0)


def test_the_fingerprint_tells_apart_configs_that_compute_differently() -> None:
    """Peers compare fingerprints before exchanging anything: a config with an attention bias or
    another rotary base has the same shapes (or nearly) but trains another function."""
    from cgad.node.training.model import model_fingerprint

    base = model_config("tiny", 4096)
    assert model_fingerprint(base) == model_fingerprint(model_config("tiny", 4096))
    assert model_fingerprint(model_config("tiny", 4097)) != model_fingerprint(base)
    for change in ({"attention_bias": True}, {"rope_theta": 500000.0}, {"rms_norm_eps": 1e-5},
                   {"hidden_act": "gelu"}):  # fmt: skip
        assert model_fingerprint(model_config("tiny", 4096, **change)) != model_fingerprint(base), change
