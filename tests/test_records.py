"""DHT records: schema, signatures, and the tie between a signing key and a peer id."""

from __future__ import annotations

import dataclasses

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import CompositeValidator, DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hypothesis import given, settings
from hypothesis import strategies as st

from cgad.protocol import FragmentError
from cgad.protocol.records import (
    MAX_CREDITS,
    MAX_OFFERS,
    MAX_RECORD_TTL,
    Holdings,
    Identity,
    Offer,
    ParseCache,
    Progress,
    RememberingValidator,
    fragment_key,
    parse_holdings,
    parse_progress,
    peer_id_of_owner,
    progress_key,
    run_validator,
    schema_validator,
    state_key,
    top_credits,
)

pytestmark = pytest.mark.timeout(60)
serializer = DHTProtocol.serializer


@pytest.fixture(scope="module")
def alice() -> Identity:
    return Identity()


@pytest.fixture(scope="module")
def bob() -> Identity:
    return Identity()


def _offer(publisher: str, base: int = 3) -> Offer:
    return Offer(
        publisher=publisher,
        base_version=base,
        kind="delta",
        tokens=2048,
        codec="4bit",
        numel=1 << 20,
        content_hash=bytes(range(32)),
        byte_length=590_000,
    )


def _record(key: str, owner: bytes, value: object) -> DHTRecord:
    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=serializer.dumps(owner),
        value=serializer.dumps(value),
        expiration_time=get_dht_time() + 30,
    )


def _validator(identity: Identity, num_fragments: int = 4) -> CompositeValidator:
    return run_validator("run", num_fragments, identity)


def test_peer_id_follows_from_the_signing_key(alice: Identity, bob: Identity) -> None:
    assert peer_id_of_owner(alice.owner_subkey) == alice.peer_id
    assert PeerID.from_base58(alice.peer_id).to_base58() == alice.peer_id
    assert alice.peer_id != bob.peer_id
    with pytest.raises(FragmentError) as info:
        peer_id_of_owner(b"no key here")
    assert info.value.reason == "forged"


def test_signed_holdings_pass_schema_and_signature(alice: Identity, bob: Identity) -> None:
    holdings = Holdings(
        peer_id=alice.peer_id, grpc="127.0.0.1:4000", offers=[_offer(alice.peer_id)],
        maddrs=["/ip4/203.0.113.7/tcp/31337", "/ip4/198.51.100.1/tcp/4001/p2p/QmRelay/p2p-circuit"],
    )  # fmt: skip
    record = _record(fragment_key("run", 2), alice.owner_subkey, holdings.dict())
    signed = dataclasses.replace(record, value=_validator(alice).sign_value(record))
    # any other node (bob) checks it on store and on every read
    assert _validator(bob).validate(signed)
    assert parse_holdings(alice.owner_subkey, holdings.dict()) == holdings


def test_another_peers_subkey_cannot_be_written(alice: Identity, bob: Identity) -> None:
    forged = Holdings(peer_id=alice.peer_id, grpc="10.0.0.66:1", offers=[_offer(alice.peer_id)])
    record = _record(fragment_key("run", 2), alice.owner_subkey, forged.dict())
    # bob's signer leaves a record under alice's key unsigned, and nobody accepts it
    value = _validator(bob).sign_value(record)
    assert not _validator(alice).validate(dataclasses.replace(record, value=value))
    assert not _validator(bob).validate(dataclasses.replace(record, value=value))


def test_own_subkey_claiming_another_peer_is_forged(alice: Identity, bob: Identity) -> None:
    # validly signed by bob, but it claims to be alice's holdings
    claims_alice = Holdings(peer_id=alice.peer_id, grpc=None, offers=[_offer(alice.peer_id)])
    record = _record(fragment_key("run", 1), bob.owner_subkey, claims_alice.dict())
    assert _validator(bob).validate(dataclasses.replace(record, value=_validator(bob).sign_value(record)))
    with pytest.raises(FragmentError) as info:
        parse_holdings(bob.owner_subkey, claims_alice.dict())
    assert info.value.reason == "forged"


def test_schema_refuses_bad_values(alice: Identity) -> None:
    good = Holdings(peer_id=alice.peer_id, grpc=None, offers=[_offer(alice.peer_id)]).dict()
    bad_values = [
        {**good, "extra": 1},
        {**good, "peer_id": 5},
        {**good, "offers": [{**good["offers"][0], "base_version": -1}]},
        {**good, "offers": [{**good["offers"][0], "base_version": 3.0}]},  # no silent conversions
        {**good, "offers": [{**good["offers"][0], "kind": "weights"}]},
        {**good, "offers": [{**good["offers"][0], "content_hash": b"short"}]},
        {**good, "offers": good["offers"] * (MAX_OFFERS + 1)},
        # an endpoint fetchers would dial is host:port, nothing else gRPC would take
        {**good, "grpc": "unix:/run/some.sock"},
        {**good, "grpc": "dns:///example.org:443"},
        {**good, "grpc": "127.0.0.1:80\n"},
        # the libp2p addresses a fetcher may dial: a few, short, multiaddr-shaped
        {**good, "maddrs": ["/ip4/10.0.0.1/tcp/1"] * 5},
        {**good, "maddrs": ["/ip4/10.0.0.1/tcp/" + "1" * 200]},
        {**good, "maddrs": ["http://10.0.0.1/"]},
        {**good, "maddrs": ["/ip4/10.0.0.1/tcp/1 /x"]},
        {**good, "maddrs": "/ip4/10.0.0.1/tcp/1"},
    ]
    validator = schema_validator("run", 4)
    for value in bad_values:
        assert not validator.validate(_record(fragment_key("run", 0), alice.owner_subkey, value))
        with pytest.raises(FragmentError) as info:
            parse_holdings(alice.owner_subkey, value)
        assert info.value.reason == "garbage"
    # a subkey without an owner key, and a fragment index the run does not have
    assert not validator.validate(_record(fragment_key("run", 0), b"anonymous", good))
    assert not validator.validate(_record(fragment_key("run", 4), alice.owner_subkey, good))


def test_progress_record_round_trips(alice: Identity, bob: Identity) -> None:
    progress = Progress(
        peer_id=alice.peer_id,
        versions=[4, 4, 3, 5],
        inner_step=812,
        tokens_per_second=5120.5,
        time=get_dht_time(),
    )
    record = _record(progress_key("run"), alice.owner_subkey, progress.dict())
    assert _validator(bob).validate(dataclasses.replace(record, value=_validator(alice).sign_value(record)))
    assert parse_progress(alice.owner_subkey, progress.dict()) == progress
    with pytest.raises(FragmentError):
        parse_progress(bob.owner_subkey, progress.dict())


def test_a_full_record_stays_small(alice: Identity) -> None:
    full = Holdings(
        peer_id=alice.peer_id,
        grpc="203.0.113.77:65535",
        offers=[_offer(alice.peer_id, b) for b in range(MAX_OFFERS)],
    )
    signed = _validator(alice).sign_value(_record(fragment_key("run", 0), alice.owner_subkey, full.dict()))
    # hivemind.DHT's pipe hangs on values of ~32 KB; ours stay far below
    assert len(signed) < 8192


def test_a_progress_record_signs_what_it_applied_from_whom_bounded(alice: Identity, bob: Identity) -> None:
    base58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    applied = {f"Qm{base58[i % 58]}{base58[i // 58]}": i for i in range(1, 3 * MAX_CREDITS)}
    credits = top_credits({**applied, bob.peer_id: 0})
    # the largest counts, never a zero one: a record credits at most MAX_CREDITS publishers
    assert len(credits) == MAX_CREDITS and min(credits.values()) == 3 * MAX_CREDITS - MAX_CREDITS
    assert bob.peer_id not in credits
    progress = Progress(peer_id=alice.peer_id, versions=[2] * 16, inner_step=40, tokens_per_second=1.0,
                        time=get_dht_time(), eval_loss=4.25, applied_from=credits)  # fmt: skip
    record = _record(progress_key("run"), alice.owner_subkey, progress.dict())
    signed = _validator(alice).sign_value(record)
    assert _validator(bob).validate(dataclasses.replace(record, value=signed)) and len(signed) < 8192
    assert parse_progress(alice.owner_subkey, progress.dict()).applied_from == credits
    # a record of the fields before credits (no eval_loss, no applied_from) still reads
    old = {k: v for k, v in progress.dict().items() if k not in ("eval_loss", "applied_from")}
    assert (
        parse_progress(alice.owner_subkey, old).applied_from == {}
        and parse_progress(alice.owner_subkey, old).eval_loss is None
    )
    good = progress.dict()
    bad_values = [
        {**good, "applied_from": {**credits, "QmZZ": 1}},  # one publisher too many
        {**good, "applied_from": {bob.peer_id: -1}},
        {**good, "applied_from": {bob.peer_id: 1.0}},  # no silent conversions
        {**good, "applied_from": {"not a peer id!": 1}},
        {**good, "applied_from": [[bob.peer_id, 1]]},
        {**good, "eval_loss": float("nan")},
        {**good, "eval_loss": float("inf")},
        {**good, "eval_loss": -1.0},
        {**good, "eval_loss": 4},
    ]
    validator = schema_validator("run", 16)
    for value in bad_values:
        assert not validator.validate(_record(progress_key("run"), alice.owner_subkey, value))
        with pytest.raises(FragmentError) as info:
            parse_progress(alice.owner_subkey, value)
        assert info.value.reason == "garbage"


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.integers() | st.binary(max_size=40) | st.text(max_size=20),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
        max_leaves=20,
    )
)
def test_fuzz_record_parsing_only_raises_fragment_error(alice: Identity, value: object) -> None:
    for parse in (parse_holdings, parse_progress):
        with pytest.raises(FragmentError):
            parse(alice.owner_subkey, value)


def test_a_bare_value_at_a_run_key_is_refused(alice: Identity) -> None:
    """Unsigned and ownerless, it would replace every peer's subkey under the key."""
    for key in (fragment_key("run", 0), progress_key("run"), state_key("run")):
        bare = DHTRecord(
            key=DHTID.generate(source=key).to_bytes(),
            subkey=DHTProtocol.IS_REGULAR_VALUE,
            value=serializer.dumps(None),
            expiration_time=get_dht_time() + 30,
        )
        assert not _validator(alice).validate(bare), key


def test_a_record_may_not_outlive_its_writer_for_long(alice: Identity) -> None:
    holdings = Holdings(peer_id=alice.peer_id, grpc=None, offers=[_offer(alice.peer_id)])
    record = _record(fragment_key("run", 1), alice.owner_subkey, holdings.dict())
    for expiration, ok in ((get_dht_time() + MAX_RECORD_TTL - 60, True), (get_dht_time() + 1e9, False)):
        timed = dataclasses.replace(record, expiration_time=expiration)
        signed = dataclasses.replace(timed, value=_validator(alice).sign_value(timed))
        assert _validator(alice).validate(signed) is ok


def test_verdicts_are_remembered_per_exact_record(alice: Identity, bob: Identity) -> None:
    validator = _validator(alice)
    holdings = Holdings(peer_id=alice.peer_id, grpc=None, offers=[_offer(alice.peer_id)])
    record = _record(fragment_key("run", 1), alice.owner_subkey, holdings.dict())
    signed = dataclasses.replace(record, value=validator.sign_value(record))
    assert validator.validate(signed) and validator.validate(signed)
    assert len(validator._verdicts) == 1  # the second look cost nothing
    # one byte different is another record, judged afresh (a bad signature stays refused)
    tampered = dataclasses.replace(signed, value=signed.value[:-1] + bytes([signed.value[-1] ^ 1]))
    assert not validator.validate(tampered) and not validator.validate(tampered)
    assert len(validator._verdicts) == 2
    small = RememberingValidator([schema_validator("run", 4)], size=2)
    for base in range(3):
        value = Holdings(peer_id=bob.peer_id, grpc=None, offers=[_offer(bob.peer_id, base)]).dict()
        assert small.validate(_record(fragment_key("run", 0), bob.owner_subkey, value))
    assert len(small._verdicts) == 2  # bounded


@pytest.mark.parametrize("content", [b"", b"\x0a\xff\xff", b"not a key at all" * 10])
def test_a_corrupt_identity_file_is_a_clear_error_and_stays_as_it_was(tmp_path, content: bytes) -> None:
    path = tmp_path / "peer.key"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="is not a usable identity key file"):
        Identity.load_or_create(str(path))
    assert path.read_bytes() == content  # never replaced: it may be someone's only copy


def test_a_parse_cache_parses_a_standing_record_once_and_forgets_it_two_polls_after() -> None:
    calls: list[object] = []

    def parse(owner: bytes, value: object) -> dict:
        calls.append(value)
        if value == "bad":
            raise FragmentError("garbage", "not a record")
        return {"owner": owner, "value": value}

    cache = ParseCache(parse)
    first = cache(b"a", {"offers": [1, 2]})
    for _ in range(3):  # the same record at every poll: parsed once
        assert cache(b"a", {"offers": [1, 2]}) == first
        with pytest.raises(FragmentError, match="garbage"):
            cache(b"a", "bad")  # a faulty one is refused each time, and not parsed again
        cache.rotate()
    assert calls == [{"offers": [1, 2]}, "bad"]
    cache(b"a", {"offers": [1, 3]})  # new content from the same owner: parsed
    cache(b"b", {"offers": [1, 2]})  # the same content from another owner: parsed
    assert len(calls) == 4
    cache.rotate()
    cache.rotate()  # two polls without it: gone
    cache(b"a", {"offers": [1, 2]})
    assert len(calls) == 5
