from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sco.contract.bundle import Bundle, Succession, subset_payload, successor
from sco.contract.compiler import compile_repo
from sco.contract.signing import (
    Keyring,
    PrivateKey,
    generate,
    load_private,
    load_public,
    sign,
    verify,
    write_keypair,
)
from sco.errors import BundleError, KeyFileError, RollbackError, SignatureError, UntrustedKeyError
from tests.conftest import SAMPLE

PAYLOAD = compile_repo(SAMPLE)
KEY_A = generate()
KEY_B = generate()
SIGNED = sign(PAYLOAD, [KEY_A])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=20))
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=20,
)


@given(payload=st.dictionaries(st.text(max_size=10), json_values, max_size=6))
def test_round_trip_any_payload(payload: dict[str, object]) -> None:
    raw = sign(payload, [KEY_A])
    v = verify(raw, Keyring([KEY_A.public]))
    assert v.payload == payload
    assert v.keyid == KEY_A.keyid
    assert sign(payload, [KEY_A]) == raw  # deterministic: same input, same bytes


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(pos=st.integers(min_value=0, max_value=len(SIGNED) - 1), delta=st.integers(min_value=1, max_value=255))
def test_any_byte_change_fails_verification(pos: int, delta: int) -> None:
    tampered = bytearray(SIGNED)
    tampered[pos] = (tampered[pos] + delta) % 256
    with pytest.raises(BundleError):
        verify(bytes(tampered), Keyring([KEY_A.public]))


def test_every_single_byte_position_is_covered() -> None:
    # Exhaustive over positions with one flip each, beyond hypothesis' sample.
    ring = Keyring([KEY_A.public])
    for pos in range(len(SIGNED)):
        tampered = bytearray(SIGNED)
        tampered[pos] ^= 0x01
        with pytest.raises(BundleError):
            verify(bytes(tampered), ring)
    with pytest.raises(BundleError):
        verify(SIGNED + b" ", ring)
    with pytest.raises(BundleError):
        verify(SIGNED[:-1], ring)


def test_untrusted_key_refused() -> None:
    with pytest.raises(UntrustedKeyError, match=f"signed by {KEY_A.keyid}, none of which is trusted"):
        verify(SIGNED, Keyring([KEY_B.public]))


@given(serials=st.lists(st.integers(min_value=1, max_value=10_000), min_size=2, max_size=8))
def test_serial_rollback_always_refused(serials: list[int]) -> None:
    ring = Keyring([KEY_A.public])
    cached: Bundle | None = None
    for s in serials:
        new = Bundle(verify(sign({**PAYLOAD, "serial": s}, [KEY_A]), ring))
        if cached is not None and s < cached.serial:
            with pytest.raises(RollbackError):
                successor(cached, new)
            continue
        successor(cached, new)
        cached = new
    assert cached is not None
    assert cached.serial == max(serials[: serials.index(cached.serial) + 1])


def test_same_serial_different_content_refused_and_same_content_unchanged() -> None:
    ring = Keyring([KEY_A.public])
    a = Bundle(verify(SIGNED, ring))
    assert successor(a, Bundle(verify(sign(PAYLOAD, [KEY_A]), ring))) is Succession.UNCHANGED
    other = {**PAYLOAD, "contentDigest": "0" * 64}
    with pytest.raises(RollbackError, match="reused with different content"):
        successor(a, Bundle(verify(sign(other, [KEY_A]), ring)))
    with pytest.raises(BundleError, match="hall 'elsewhere'"):
        successor(a, Bundle(verify(sign({**PAYLOAD, "hall": "elsewhere", "serial": 9}, [KEY_A]), ring)))


@given(st.data())
@settings(max_examples=30)
def test_key_rotation(data: st.DataObject) -> None:
    """Sign with old and new while nodes trust either; then drop the old key."""
    old, new = KEY_A, KEY_B
    serial = data.draw(st.integers(min_value=1, max_value=1000))
    both = sign({**PAYLOAD, "serial": serial}, [old, new])
    for ring in (Keyring([old.public]), Keyring([new.public]), Keyring([old.public, new.public])):
        assert verify(both, ring).payload["serial"] == serial
    only_new = sign({**PAYLOAD, "serial": serial + 1}, [new])
    with pytest.raises(UntrustedKeyError):
        verify(only_new, Keyring([old.public]))
    assert verify(only_new, Keyring([old.public, new.public])).keyid == new.keyid


def test_forged_signature_by_trusted_keyid_refused() -> None:
    forged = sign({**PAYLOAD, "serial": 99}, [KEY_B]).replace(KEY_B.keyid.encode(), KEY_A.keyid.encode())
    with pytest.raises(SignatureError, match="does not match"):
        verify(forged, Keyring([KEY_A.public]))


def test_subset_then_full_at_same_serial() -> None:
    ring = Keyring([KEY_A.public])
    full = Bundle(verify(SIGNED, ring))
    sub = Bundle(verify(sign(subset_payload(full, schedulers=["slurm"]), [KEY_A]), ring))
    assert set(sub.contracts) == {"genomics-align", "climate-ensemble"}
    assert sub.serial == full.serial
    assert successor(sub, full) is Succession.REPLACE
    assert successor(full, sub) is Succession.UNCHANGED
    with pytest.raises(BundleError, match="not in bundle"):
        subset_payload(full, names=["nope"])


def test_key_files(tmp_path: Path) -> None:
    k: PrivateKey = generate()
    write_keypair(k, tmp_path / "a.key", tmp_path / "a.pub")
    assert (os.stat(tmp_path / "a.key").st_mode & 0o777) == 0o600
    assert load_private(tmp_path / "a.key").keyid == k.keyid
    assert load_public(tmp_path / "a.pub").keyid == k.keyid
    with pytest.raises(KeyFileError, match="refusing to overwrite"):
        write_keypair(k, tmp_path / "a.key", tmp_path / "b.pub")
    os.chmod(tmp_path / "a.key", 0o644)
    with pytest.raises(KeyFileError, match="readable by group or others"):
        load_private(tmp_path / "a.key")
    (tmp_path / "c.pub").write_text('{"type": "ed25519-public", "keyid": "x", "public": "zz"}')
    with pytest.raises(KeyFileError, match="public: expected 64 hex digits"):
        load_public(tmp_path / "c.pub")


@pytest.mark.parametrize(
    ("change", "kind", "why"),
    [
        (lambda s: {**s, "sig": s["sig"].upper()}, "forged", "expected 128 lowercase hex digits"),
        (lambda s: {**s, "note": "x"}, "malformed", "expected exactly keyid and sig"),
        (lambda s: {"keyid": s["keyid"], "sig": 7}, "malformed", "keyid and sig must be strings"),
    ],
)
def test_bundles_and_notices_share_one_signature_check(change: Any, kind: str, why: str) -> None:
    """The check was written twice and the copies differed (only bundles required lowercase hex and
    exactly {keyid, sig}); now one function, the same refusal for both."""
    import json

    from sco.contract.notice import sign_notice, verify_notice
    from sco.errors import NoticeAuthError

    ring = Keyring([KEY_A.public])
    head, body = sign({"hall": "h", "serial": 1}, [KEY_A]).split(b"\n", 1)
    header = json.loads(head)
    header["signatures"] = [change(header["signatures"][0])]
    from sco.contract import canonical

    with pytest.raises(BundleError, match=why):
        verify(canonical.dumps(header) + b"\n" + body, ring)
    notice = json.loads(sign_notice({"id": "n", "hall": "h", "node": "x", "terminateAt": 1.0}, [KEY_A]))
    notice["signatures"] = [change(notice["signatures"][0])]
    with pytest.raises(NoticeAuthError, match=why) as refused:
        verify_notice(json.dumps(notice).encode(), ring)
    assert refused.value.kind == kind


_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
    | st.text(alphabet=':,[]{}0123456789.eE-+"\\'),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)


def _has_float(v: object) -> bool:
    if isinstance(v, float):
        return True
    if isinstance(v, list):
        return any(_has_float(x) for x in v)
    if isinstance(v, dict):
        return any(_has_float(x) for x in v.values())
    return False


@given(_JSON)
def test_canonical_json_refuses_a_float_wherever_it_is(value: object) -> None:
    """The compile's hot path: canonical JSON is parsed again only where a float may be (a value
    after ':', ',' or '[' with a '.' or an exponent); a float anywhere is still refused, and strings that look
    like one are not."""
    from sco.contract import canonical

    if _has_float(value):
        with pytest.raises(ValueError, match="floats are not allowed"):
            canonical.dumps(value)
    else:
        assert canonical.loads(canonical.dumps(value)) == value
