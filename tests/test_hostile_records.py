"""Records a hostile peer shapes to bloat a DHT key, break lookups or poison the numbers a swarm
reads (issue 27, holes 1 and 8): refused where they enter, bounded where they are held.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import get_dht_time

from cgad.protocol import FragmentError
from cgad.protocol.records import (
    MAX_RECORD_BYTES,
    Identity,
    Progress,
    parse_progress,
    progress_key,
    run_validator,
    state_key,
)

pytestmark = pytest.mark.timeout(60)
serializer = DHTProtocol.serializer


@pytest.fixture(scope="module")
def mallory() -> Identity:
    return Identity()


def _signed(identity: Identity, key: str, subkey: bytes, value: object) -> DHTRecord:
    record = DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=serializer.dumps(subkey),
        value=serializer.dumps(value),
        expiration_time=get_dht_time() + 30,
    )
    return dataclasses.replace(record, value=run_validator("run", 4, identity).sign_value(record))


def _progress(identity: Identity, **fields: object) -> dict:
    # every field, as an honest peer's record has them (the schema compares what it parsed)
    record = Progress(
        peer_id=identity.peer_id,
        versions=[1, 2, 3, 4],
        inner_step=5,
        tokens_per_second=1.0,
        time=get_dht_time(),
    ).dict()
    record.update(fields)
    return record


def test_an_owner_writes_one_subkey_per_key_not_one_per_suffix(mallory: Identity) -> None:
    validator = run_validator("run", 4, mallory)
    own = _signed(mallory, progress_key("run"), mallory.owner_subkey, _progress(mallory))
    assert validator.validate(own)
    # "[owner:KEY]#1", "#2"... all hold the owner's key: each was a new subkey it could sign
    for suffix in (b"#1", b"#999", b" and more"):
        record = _signed(mallory, progress_key("run"), mallory.owner_subkey + suffix, _progress(mallory))
        assert not validator.validate(record), suffix
    prefixed = _signed(mallory, state_key("run"), b"x" + mallory.owner_subkey, _progress(mallory))
    assert not validator.validate(prefixed)


def test_a_record_over_the_size_cap_is_refused(mallory: Identity) -> None:
    validator = run_validator("run", 4, mallory)
    # 4096 versions near 2**63: the schema takes it, and it is ~37 KB
    big = _progress(mallory, versions=[(1 << 63) - 1] * 4096)
    record = _signed(mallory, progress_key("run"), mallory.owner_subkey, big)
    assert len(record.value) > MAX_RECORD_BYTES
    assert not validator.validate(record)


@pytest.mark.parametrize(
    "fields",
    [
        {"time": math.nan},
        {"time": math.inf},
        {"time": -math.inf},
        {"tokens_per_second": math.inf},
        {"tokens_per_second": math.nan},
        {"tokens_per_second": 1e300},
    ],
)
def test_progress_numbers_must_be_finite_and_in_range(mallory: Identity, fields: dict) -> None:
    with pytest.raises(FragmentError):
        parse_progress(mallory.owner_subkey, _progress(mallory, **fields))
    # the same record with sane numbers parses
    assert isinstance(parse_progress(mallory.owner_subkey, _progress(mallory)), Progress)
