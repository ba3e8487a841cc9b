"""Codec round trips with an error bound per codec, and hostile bytes for ``decode``."""

from __future__ import annotations

import math
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cgad.protocol import FragmentError
from cgad.protocol import codec as codec_module
from cgad.protocol.codec import (
    LOSSY,
    MAX_NUMEL,
    SCRATCH_BYTES,
    Codec,
    all_finite,
    decode,
    encode,
    encoded_size,
    join_slices,
    kept_in,
)
from cgad.protocol.feedback import ErrorFeedback, to_bfloat16_stochastic

pytestmark = pytest.mark.timeout(120)

BFLOAT16_ROUNDING = 2.0**-7  # a bfloat16 step, relative: stochastic rounding moves a value by less
_FIXED = struct.Struct("<4sBBBBIQQ")  # the documented header layout, restated independently
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _payload_offset(data: bytes) -> int:
    ndim = data[7]
    return _FIXED.size + 8 * ndim + 4


def _with_valid_crc(data: bytes | bytearray) -> bytes:
    """Recompute the crc32 after a deliberate edit, so the edit itself is what gets judged."""
    data = bytearray(data)
    offset = _payload_offset(bytes(data))
    crc = zlib.crc32(bytes(data[offset:]), zlib.crc32(bytes(data[: offset - 4])))
    data[offset - 4 : offset] = struct.pack("<I", crc)
    return bytes(data)


def _blockwise_absmax(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1).float()
    pad = (-flat.numel()) % block
    flat = torch.cat([flat, flat.new_zeros(pad)])
    amax = flat.view(-1, block).abs().amax(1)
    return amax.repeat_interleave(block)[: x.numel()]


@pytest.fixture(scope="module")
def sample() -> torch.Tensor:
    torch.manual_seed(0)
    # Heavy-ish tails and a few blocks of very different magnitude, like real pseudo-gradients.
    x = torch.randn(10_007) * torch.logspace(-6, 0, 10_007)
    x[500:700] = 0.0
    return x


def test_fp32_is_exact(sample: torch.Tensor) -> None:
    assert torch.equal(decode(encode(sample, "fp32")), sample)


def test_fp16_error_is_half_precision(sample: torch.Tensor) -> None:
    y = decode(encode(sample, Codec.FP16))
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, sample, rtol=2**-11, atol=2**-24)


def test_int8_error_within_half_a_step_of_its_block(sample: torch.Tensor) -> None:
    y = decode(encode(sample, "int8"))
    bound = _blockwise_absmax(sample, 256) / 254 * (1 + 1e-5) + 1e-12
    assert bool(((y - sample).abs() <= bound).all())
    assert not torch.equal(y, sample)  # lossy, so the bound above is what is being tested


def test_4bit_values_are_e2m1_levels_within_bound(sample: torch.Tensor) -> None:
    y = decode(encode(sample, "4bit"))
    absmax = _blockwise_absmax(sample, 64)
    # The widest gap between E2M1 neighbours is 2 units (4 to 6); a unit is absmax / 6.
    assert bool(((y - sample).abs() <= absmax / 6 * (1 + 1e-5)).all())
    units = torch.where(absmax > 0, y.abs() / absmax * 6, torch.zeros_like(y))
    nearest = (units[:, None] - E2M1[None, :]).abs().min(1).values
    assert float(nearest.max()) < 1e-4
    # signs survive
    assert bool((torch.sign(y) * torch.sign(sample) >= 0).all())


def test_4bit_rounds_to_nearest_level() -> None:
    # One block with absmax 6 so units equal values: each value lands on its nearest E2M1 level.
    x = torch.tensor([6.0, 0.2, 0.3, 0.74, 0.76, 1.2, 1.3, 1.8, 2.4, 2.6, 3.4, 3.6, 4.9, 5.1, -5.1, -0.3])
    x = torch.cat([x, torch.zeros(64 - x.numel())])
    expected = torch.tensor([6, 0, 0.5, 0.5, 1, 1, 1.5, 2, 2, 3, 3, 4, 4, 6, -6, -0.5])
    assert torch.equal(decode(encode(x, "4bit"))[:16], expected)


def _blockwise_rms(x: torch.Tensor, block: int) -> torch.Tensor:
    flat = x.reshape(-1).double()
    flat = torch.cat([flat, flat.new_zeros((-flat.numel()) % block)])
    return flat.view(-1, block).square().mean(1).sqrt().repeat_interleave(block)[: x.numel()].float()


def test_2bit_values_are_the_gaussian_levels_of_their_block(sample: torch.Tensor) -> None:
    y = decode(encode(sample, "2bit"))
    rms = _blockwise_rms(sample, 64)
    units = torch.where(rms > 0, y / rms, torch.zeros_like(y))
    levels = torch.tensor([-1.5104, -0.4528, 0.4528, 1.5104])
    live = rms > 0
    assert float((units[live, None] - levels).abs().min(1).values.max()) < 1e-4
    assert bool((y[~live] == 0).all())
    # the magnitude bit splits at 0.9816 RMS and the sign survives (zeros may take either)
    big = sample.abs() > 0.9816 * rms * (1 + 1e-4)
    small = sample.abs() < 0.9816 * rms * (1 - 1e-4)
    assert bool((units[big].abs() > 1).all()) and bool((units[small & live].abs() < 1).all())
    assert bool((torch.sign(y) * torch.sign(sample) >= 0).all())


def test_2bit_error_on_gaussian_values_is_lloyd_max() -> None:
    torch.manual_seed(3)
    x = torch.randn(64 * 4096)
    y = decode(encode(x, "2bit"))
    # 0.1175 for a unit Gaussian; each block's own RMS stands in for sigma here
    assert 0.10 < float((y - x).square().mean()) < 0.13
    assert len(encode(x, "2bit")) < 0.57 * len(encode(x, "4bit"))  # 2.5 against 4.5 bits per value


@pytest.mark.parametrize("kept", [8, 16, 64])
def test_sparse_sends_the_largest_k_of_each_block_within_half_a_step(sample: torch.Tensor, kept: int) -> None:
    y = decode(encode(sample, "sparse", kept))
    full = sample.numel() // 256 * 256
    blocks, sent = sample[:full].view(-1, 256), y[:full].view(-1, 256)
    for b, k in zip(blocks, sent, strict=True):
        top = b.abs().topk(kept).indices
        assert set(k.nonzero().flatten().tolist()) <= set(top.tolist())  # zeros among the top stay 0
        step = float(b[top].abs().max()) / 127
        assert float((k[top] - b[top]).abs().max()) <= step / 2 * (1 + 1e-5) + 1e-30
    assert int((y[full:] != 0).sum()) <= kept  # the short last block, padded with zeros
    data = encode(sample, "sparse", kept)
    assert len(data) == encoded_size(sample.numel(), "sparse", kept=kept)
    assert codec_module.sparse_kept(sample.numel(), len(data) - encoded_size(0, "sparse")) == kept
    # 1.125 bits per value at the default 16 against 4bit's 4.5
    x = torch.randn(256 * 4096)
    assert len(encode(x, "sparse")) < 0.26 * len(encode(x, "4bit"))
    with pytest.raises(ValueError, match="sparse keeps 1 to 64"):
        encode(sample, "sparse", 65)


def test_sparse_re_encodes_what_it_sent_byte_for_byte(sample: torch.Tensor) -> None:
    """A node picks its top-k itself (OuterLoop with ``sparse_keep``) and the transport encodes
    the result again, with no error feedback of its own: that second pass must send the same
    values, which error feedback over it would confirm by leaving no residual."""
    data = encode(sample, "sparse")
    assert encode(decode(data), "sparse") == data
    feedback = ErrorFeedback("sparse")
    feedback.encode(decode(data))
    assert feedback.residual is not None and not bool(feedback.residual.any())


@pytest.mark.parametrize("indices", [[1, 0, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 7, 7]])
def test_sparse_refuses_indices_that_repeat_or_are_out_of_order(indices: list[int]) -> None:
    data = bytearray(encode(torch.arange(1.0, 257.0), "sparse", 8))
    offset = _payload_offset(bytes(data)) + 4  # past the one block's scale
    assert list(data[offset : offset + 8]) == list(range(248, 256))
    data[offset : offset + 8] = bytes(indices)
    with pytest.raises(FragmentError) as info:
        decode(_with_valid_crc(data))
    assert info.value.reason == "bad_indices"


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((3, 5, 7), torch.float32), ((), torch.float32), ((0,), torch.float32), ((129,), torch.bfloat16)],
)
def test_shape_dtype_and_length_survive(codec: Codec, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape).to(dtype)
    data = encode(x, codec)
    y = decode(data)
    assert y.shape == x.shape
    assert y.dtype == dtype
    assert len(data) == encoded_size(x.numel(), codec, ndim=x.dim())


@pytest.mark.parametrize("codec", list(Codec))
def test_zero_and_tiny_blocks_decode_to_zero_not_nan(codec: Codec) -> None:
    x = torch.zeros(300)
    x[10] = 1e-35
    y = decode(encode(x, codec))
    assert bool(torch.isfinite(y).all())
    assert float(y.abs().max()) <= float(x[10])


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_encode_refuses_non_finite(codec: Codec, bad: float) -> None:
    x = torch.ones(1000)
    x[777] = bad
    with pytest.raises(FragmentError) as info:
        encode(x, codec)
    assert info.value.reason == "non_finite"


def test_encode_refuses_what_fp16_cannot_hold() -> None:
    with pytest.raises(FragmentError) as info:
        encode(torch.tensor([1.0, 70000.0]), "fp16")
    assert info.value.reason == "non_finite"


def test_encode_refuses_integer_tensors() -> None:
    with pytest.raises(FragmentError) as info:
        encode(torch.arange(10), "fp32")
    assert info.value.reason == "bad_dtype"


@pytest.mark.parametrize("codec", list(Codec))
def test_every_truncation_and_single_byte_flip_is_rejected(codec: Codec) -> None:
    data = encode(torch.randn(2, 70), codec)
    for cut in range(len(data)):
        with pytest.raises(FragmentError):
            decode(data[:cut])
    for position in range(len(data)):
        mutated = bytearray(data)
        mutated[position] ^= 0x5A
        with pytest.raises(FragmentError):
            decode(bytes(mutated))
    with pytest.raises(FragmentError) as info:
        decode(data + b"\0")
    assert info.value.reason == "bad_length"


def test_reasons_for_header_damage() -> None:
    data = bytearray(encode(torch.randn(100), "int8"))
    cases = {
        "garbage": (0, b"XXXX"),
        "unsupported_version": (4, b"\x09"),
        "unknown_codec": (5, b"\x63"),
        "bad_dtype": (6, b"\x07"),
    }
    for reason, (offset, patch) in cases.items():
        mutated = bytearray(data)
        mutated[offset : offset + len(patch)] = patch
        with pytest.raises(FragmentError) as info:
            decode(bytes(mutated))
        assert info.value.reason == reason
    payload_byte = bytearray(data)
    payload_byte[-1] ^= 1
    with pytest.raises(FragmentError) as info:
        decode(bytes(payload_byte))
    assert info.value.reason == "bad_checksum"


def test_huge_declared_shape_is_refused_without_allocating() -> None:
    numel = MAX_NUMEL // 2
    header = _FIXED.pack(b"CGFR", 1, 0, 0, 1, 0, numel, numel * 4) + struct.pack("<Q", numel)
    with pytest.raises(FragmentError) as info:
        decode(_with_valid_crc(header + b"\0\0\0\0" + b"\0" * 64))
    assert info.value.reason == "truncated"
    header = _FIXED.pack(b"CGFR", 1, 0, 0, 1, 0, MAX_NUMEL + 1, 4) + struct.pack("<Q", MAX_NUMEL + 1)
    with pytest.raises(FragmentError) as info:
        decode(header + b"\0" * 8)
    assert info.value.reason == "oversized"
    header = _FIXED.pack(b"CGFR", 1, 0, 0, 2, 0, 12, 48) + struct.pack("<2Q", 3, 5)
    with pytest.raises(FragmentError) as info:
        decode(_with_valid_crc(header + b"\0\0\0\0" + b"\0" * 48))
    assert info.value.reason == "bad_shape"


@pytest.mark.parametrize("codec", [Codec.FP32, Codec.FP16])
def test_non_finite_payload_with_valid_checksum_is_rejected(codec: Codec) -> None:
    data = bytearray(encode(torch.ones(16), codec))
    nan = struct.pack("<f", float("nan")) if codec is Codec.FP32 else struct.pack("<e", float("nan"))
    data[-len(nan) :] = nan
    with pytest.raises(FragmentError) as info:
        decode(_with_valid_crc(data))
    assert info.value.reason == "non_finite"


@pytest.mark.parametrize("codec", LOSSY)
@pytest.mark.parametrize("bad_scale", [-1.0, float("inf"), float("nan"), 3e38])
def test_bad_block_scale_with_valid_checksum_is_rejected(codec: Codec, bad_scale: float) -> None:
    data = bytearray(encode(torch.ones(16), codec))
    offset = _payload_offset(bytes(data))
    data[offset : offset + 4] = struct.pack("<f", bad_scale)
    with pytest.raises(FragmentError) as info:
        decode(_with_valid_crc(data))
    assert info.value.reason == "non_finite"


def test_decode_refuses_non_bytes() -> None:
    with pytest.raises(FragmentError) as info:
        decode("CGFR")  # type: ignore[arg-type]
    assert info.value.reason == "garbage"


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_fuzz_arbitrary_bytes_only_raise_fragment_error(data: bytes) -> None:
    with pytest.raises(FragmentError):
        decode(data)


_SEEDS = {codec: encode(torch.randn(3, 50), codec) for codec in Codec}


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(list(Codec)),
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), min_size=1, max_size=4),
    st.integers(-20, 20),
    st.booleans(),
)
def test_fuzz_mutated_encodings_never_decode_silently(
    codec: Codec, edits: list[tuple[int, int]], resize: int, fix_crc: bool
) -> None:
    original = _SEEDS[codec]
    data = bytearray(original)
    for position, value in edits:
        data[position % len(data)] = value
    if resize > 0:
        data += bytes(resize)
    elif resize < 0:
        del data[resize:]
    if fix_crc and len(data) >= _FIXED.size and data[7] <= 8 and len(data) >= _payload_offset(bytes(data)):
        data = bytearray(_with_valid_crc(data))
    try:
        y = decode(bytes(data))
    except FragmentError:
        return
    # Only an edit that left the bytes as they were, or a re-checksummed payload edit that still
    # describes a well-formed finite tensor of the same layout, may decode.
    assert len(data) == len(original)
    assert bool(torch.isfinite(y).all())
    assert y.shape == (3, 50)
    if not fix_crc:
        assert bytes(data) == original


@pytest.mark.parametrize("codec", LOSSY)
def test_error_feedback_carries_the_residual(codec: Codec) -> None:
    torch.manual_seed(1)
    x = torch.randn(4096) * 0.01
    feedback = ErrorFeedback(codec)
    # sparse sends a value about once in 32 rounds, so its residual spreads over more of them
    rounds = 400 if codec is Codec.SPARSE else 40
    total, rounding = torch.zeros(4096), torch.zeros(4096)
    for _ in range(rounds):
        total += decode(feedback.encode(x))
        rounding += feedback.residual.float().abs() * BFLOAT16_ROUNDING
    plain_error = float((decode(encode(x, codec)) - x).abs().mean())
    fed_error = float((total / rounds - x).abs().mean())
    # Without feedback the mean of identical rounds keeps the whole rounding error; with it the
    # error left is one residual spread over all rounds.
    assert fed_error < plain_error / 5
    assert feedback.residual is not None and feedback.residual.dtype == torch.bfloat16
    # what went out plus what is owed is what was put in, up to the residual's own rounding to
    # bfloat16 in each round (the bound, per value); unbiased, that rounding loses under 0.2% of
    # what went in (rounding to nearest lost 0.58% under sparse)
    lost = (total - rounds * x + feedback.residual.float()).abs()
    assert bool((lost <= rounding + 1e-6).all())
    assert float(lost.mean()) < 2e-3 * rounds * float(x.abs().mean())
    with pytest.raises(FragmentError):
        feedback.encode(torch.randn(10))


def test_encoding_a_large_tensor_keeps_the_scratch_bounded() -> None:
    """The lossy codecs work in slices, so a thread's reused buffers stay under SCRATCH_BYTES
    however large the fragment (5 bytes per value would be 5 GB for a 1B-parameter fragment),
    and the slices change no byte: blocks are encoded independently."""
    numel = SCRATCH_BYTES // 2 + 1000  # about 2.5 slices of values, and a partial last block
    torch.manual_seed(2)
    x = torch.randn(numel) * torch.linspace(1e-3, 1.0, numel)
    split = (numel // 3) // 256 * 256  # a block boundary inside the first slice

    def in_a_fresh_thread(codec: Codec) -> tuple[bool, int]:
        whole = decode(encode(x, codec))
        halves = torch.cat([decode(encode(x[:split], codec)), decode(encode(x[split:], codec))])
        scratch = sum(buffer.nbytes for buffer in vars(codec_module._workspace).values())
        return torch.equal(whole, halves), scratch

    for codec in LOSSY:
        with ThreadPoolExecutor(1) as thread:
            same, scratch = thread.submit(in_a_fresh_thread, codec).result()
        assert same
        assert 0 < scratch <= SCRATCH_BYTES


def test_a_header_that_widens_finite_bytes_into_inf_is_refused_after_decoding():
    """fp32 bytes of 1e6 whose header claims float16: decode() casts them to Inf; the check on
    the final values refuses them (the hash and checksum of such bytes are perfectly valid)."""
    from cgad.protocol.receiving import decode_and_check

    data = bytearray(encode(torch.full((8,), 1e6), "fp32"))
    data[6] = 1  # the dtype byte: float16
    header = 4 + 1 + 1 + 1 + 1 + 4 + 8 + 8 + 8  # the fixed part and one dimension
    crc = zlib.crc32(bytes(data[header + 4 :]), zlib.crc32(bytes(data[:header])))
    data[header : header + 4] = struct.pack("<I", crc)
    with pytest.raises(FragmentError, match="non_finite"):
        decode(data)  # it refuses what overflows the dtype its header names
    with pytest.raises(FragmentError, match="non_finite"):
        decode_and_check(data, 8, None)


def test_error_feedback_switching_codecs_loses_nothing_and_sends_nothing_twice() -> None:
    """``--codec auto`` may send one round in 4bit and the next sparse at any k: what has gone
    out plus what is still owed is always what was put in, up to the residual's rounding to
    bfloat16 (less than 2⁻⁷ of each owed value per round)."""
    torch.manual_seed(0)
    feedback = ErrorFeedback(Codec.SPARSE)
    put_in, sent_out, rounding = torch.zeros(4096), torch.zeros(4096), torch.zeros(4096)
    rounds = [(Codec.FP4, 16), (Codec.SPARSE, 8), (Codec.SPARSE, 64), (Codec.FP4, 16), (Codec.SPARSE, 4)]
    for codec, kept in rounds:
        delta = torch.randn(4096)
        data = feedback.send(delta, codec, kept)
        assert kept_in(data) == (kept if codec is Codec.SPARSE else None)
        sent = decode(data)
        put_in += delta
        sent_out += sent
        rounding += feedback.residual.float().abs() * BFLOAT16_ROUNDING
        assert bool(((sent_out + feedback.residual - put_in).abs() <= rounding + 1e-5).all())
    # the next send approximates the new Δ plus what is owed
    assert torch.equal(feedback.target(torch.zeros(4096)), feedback.residual.float())


def test_the_residual_is_rounded_to_bfloat16_without_bias_and_repeatably() -> None:
    """Each value goes to one of its two bfloat16 neighbours, up with the probability of its
    distance from the lower one: over many draws the mean is the value; the draws are the
    feedback's own, so two runs send the same bytes."""
    # a quarter of the way from 1 to the next bfloat16; over two rounding slices and part of one
    value = torch.full((2 * (1 << 20) + 1000,), 1.0 + 2.0**-9)
    rounded = to_bfloat16_stochastic(value, torch.Generator().manual_seed(3)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2.0**-7}
    assert abs(float(rounded.mean()) - (1.0 + 2.0**-9)) < 2e-5  # to nearest: always 1.0
    negative = to_bfloat16_stochastic(-value, torch.Generator().manual_seed(3)).float()
    assert torch.equal(negative, -rounded)
    exact = torch.tensor([0.0, 1.5, -2.0, 2.0**100, -(2.0**-100)])  # bfloat16 holds these: kept
    assert torch.equal(to_bfloat16_stochastic(exact, torch.Generator()).float(), exact.bfloat16().float())
    torch.manual_seed(4)
    deltas = [torch.randn(4096) for _ in range(5)]
    runs = [[ErrorFeedback(Codec.SPARSE).encode(d) for d in deltas] for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("codec", [Codec.FP4, Codec.INT8, Codec.TWO_BIT, Codec.SPARSE, Codec.FP16])
def test_error_feedback_a_slice_at_a_time_sends_the_bytes_and_keeps_the_residual_of_the_whole(codec) -> None:
    """The feedback encodes Δ + residual a slice at a time (no float32 copy of a model-sized Δ):
    bytes and residual are those of encoding the whole tensor at once, draws included, over a
    few rounds, with a last slice that is no whole number of blocks."""
    torch.manual_seed(1)
    numel = 2 * (1 << 20) + 1000
    feedback, residual = ErrorFeedback(codec, kept=16), torch.zeros(numel, dtype=torch.bfloat16)
    rounding = torch.Generator().manual_seed(0)
    for _ in range(3):
        delta = torch.randn(numel)
        corrected = delta + residual.float()
        expected = encode(corrected, codec, 16)
        residual = to_bfloat16_stochastic(corrected - decode(expected), rounding)
        assert feedback.send(delta) == expected
        assert torch.equal(feedback.residual, residual)
    assert join_slices([encode(torch.ones(512), codec, 16)], (16, 32)) == encode(
        torch.ones(16, 32), codec, 16
    )


def test_joining_slices_refuses_a_slice_cut_inside_a_block() -> None:
    pieces = [encode(torch.ones(100), Codec.FP4), encode(torch.ones(28), Codec.FP4)]
    with pytest.raises(ValueError, match="whole blocks"):
        join_slices(pieces, (128,))


def test_a_send_that_raises_leaves_the_feedback_as_it_was() -> None:
    """fp16 cannot carry 1e6 (a later slice): nothing is sent, and neither the residual nor the
    rounding's draws move, so the next round repeats what a feedback that never tried gives."""
    torch.manual_seed(2)
    numel = (1 << 20) + 4096
    first, tried, fresh = torch.randn(numel), torch.randn(numel), ErrorFeedback(Codec.FP4)
    tried[-1] = 1e6
    feedback = ErrorFeedback(Codec.FP4)
    assert feedback.send(first) == fresh.send(first)
    with pytest.raises(FragmentError):
        feedback.send(tried, Codec.FP16)
    assert torch.equal(feedback.residual, fresh.residual)
    after = torch.randn(numel)
    assert feedback.send(after) == fresh.send(after)
    assert torch.equal(feedback.residual, fresh.residual)


def test_joining_slices_refuses_sparse_slices_of_different_sparsity_and_nothing() -> None:
    pieces = [encode(torch.randn(256), Codec.SPARSE, 8), encode(torch.randn(256), Codec.SPARSE, 16)]
    with pytest.raises(ValueError, match="as many values"):
        join_slices(pieces, (512,))
    with pytest.raises(ValueError, match="no slices"):
        join_slices([], (0,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_finds_one_bad_value_anywhere(dtype):
    t = torch.randn(10_001).to(dtype)
    assert all_finite(t) and all_finite(t[:0]) and all_finite(torch.arange(5))
    for bad in (math.nan, math.inf, -math.inf):
        for where in (0, 5_000, 10_000):
            u = t.clone()
            u[where] = bad
            assert not all_finite(u), (bad, where)
            assert not all_finite(u.view(1, -1))
