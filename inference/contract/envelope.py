"""Messages as they travel between the control plane and boards: signed, and sealed where they
carry a tenant's words.

An envelope is a JSON object::

    {"v": 1, "kind": "run", "from": "control", "to": "zero", "ts": 1700000000.0, "exp": ...,
     "ns": "default", "gen": 3, "sealed": "<base64>", "signature": "<base64>"}

- ``signature``: Ed25519 over every other field (``cachebox.signing.sign_document``), by the
  control plane's key (run and encode requests, cancel flags) or by the sending board's own key
  (reports, progress, heartbeats, stream events). A receiver names the one signer it accepts.
- ``sealed``: the message itself, encrypted and authenticated under the namespace's data key
  (``KeyRing.seal_data``), with the envelope's other fields as associated data: prompts, answers
  and tokens are unreadable in the queues, in pub/sub and in a dump of the server, and cannot be
  moved into another envelope. Messages with nothing of a tenant's in them (heartbeats, cancel
  flags) travel as ``body`` instead, signed all the same.
- ``to`` binds the envelope to its receiver (a board's name, ``control``, or a run's request id for
  its stream events); ``exp`` ends its validity; ``id`` names the request it carries (a random
  UUID, nothing of a tenant's), so queues can be watched and swept without opening anything.

Pure: crypto from ``cachebox.signing``, no I/O.
"""

from __future__ import annotations

import base64
import json
import time
from enum import StrEnum
from typing import Callable

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cachebox.errors import EntryError
from cachebox.signing import SIGNATURE_FIELD, KeyRing, UnknownKey, canonical, sign_document, verify_document

VERSION = 1
CONTROL = "control"  # the control plane as a sender or receiver
CLOCK_SKEW_S = 300.0  # how far a sender's clock may run ahead of the receiver's


class Kind(StrEnum):
    RUN = "run"
    ENCODE = "encode"
    CANCEL = "cancel"
    REPORT = "report"
    ENCODED = "encoded"
    PROGRESS = "progress"
    HEARTBEAT = "heartbeat"
    STREAM = "stream"
    AUDIT = "audit"  # control plane -> board: recompute an entry (AuditRequest)
    AUDITED = "audited"  # board -> control plane: the verdict (AuditReport)


class EnvelopeRefused(ValueError):
    """An envelope that is not for this receiver, not signed by the one it trusts, expired, or
    altered; the text says which."""


def _aad(head: dict) -> bytes:
    return canonical({key: value for key, value in head.items() if key not in ("sealed", SIGNATURE_FIELD)})


def seal(
    message: dict,
    *,
    kind: Kind,
    sender: str,
    to: str,
    signer: Ed25519PrivateKey,
    ring: KeyRing | None = None,
    ttl: float | None = None,
    namespace: str = "",
    message_id: str = "",
) -> dict:
    """``message`` in an envelope from ``sender`` to ``to``, signed by ``signer``; sealed under
    ``ring``'s current data key when a ring is given (else in the clear, signed)."""
    now = time.time()
    head: dict = {"v": VERSION, "kind": str(kind), "from": sender, "to": to, "ts": now}
    if ttl is not None:
        head["exp"] = now + ttl
    if message_id:
        head["id"] = message_id
    plain = json.dumps(message, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()
    if ring is not None:
        head["ns"] = namespace or ring.namespace
        head["gen"] = ring.current
        _, sealed = ring.seal_data(plain, _aad(head))
        head["sealed"] = base64.b64encode(sealed).decode()
    else:
        head["body"] = message
    return sign_document(signer, head)


def peek(envelope) -> dict:
    """The unauthenticated routing fields of an envelope (who sent it, to whom, what kind), to find
    the key that checks it; EnvelopeRefused when it is not an envelope at all."""
    if not isinstance(envelope, dict) or envelope.get("v") != VERSION:
        raise EnvelopeRefused("not a signed EdgeCache envelope (unsigned, or of another version)")
    fields = {name: envelope.get(name) for name in ("kind", "from", "to", "ns", "gen", "ts")}
    if not all(isinstance(fields[name], str) for name in ("kind", "from", "to")):
        raise EnvelopeRefused("the envelope names no kind, sender or receiver")
    return fields


def open_envelope(
    envelope,
    *,
    kind: Kind,
    to: str,
    signer_public_key: str,
    ring_for: Callable[[str], KeyRing | None] | None = None,
    now: float | None = None,
    expired_ok: bool = False,
) -> tuple[dict, dict]:
    """``(message, head)`` of an envelope of ``kind`` addressed to ``to`` and signed by the holder
    of ``signer_public_key``; a sealed message is opened with ``ring_for(namespace)``.
    ``expired_ok``: open it past its expiry too (to report that it expired).

    EnvelopeRefused says why anything else is refused (UnknownKey passes through: sealed under a
    key generation this holder has not received yet).
    """
    head = peek(envelope)
    if head["kind"] != str(kind):
        raise EnvelopeRefused(f"expected a {kind} message, got {head['kind']!r}")
    if head["to"] != to:
        raise EnvelopeRefused(f"addressed to {head['to']!r}, not to {to!r}")
    if not signer_public_key or not verify_document(envelope, signer_public_key):
        raise EnvelopeRefused(f"not signed by the sender this receiver trusts ({head['from']!r})")
    now = time.time() if now is None else now
    sent = envelope.get("ts")
    if not isinstance(sent, (int, float)) or sent > now + CLOCK_SKEW_S:
        raise EnvelopeRefused("the envelope's send time is missing or in the future (check the clocks)")
    expires = envelope.get("exp")
    if expires is not None and (not isinstance(expires, (int, float)) or (expires < now and not expired_ok)):
        raise EnvelopeRefused("the envelope expired before it was opened")
    if "sealed" not in envelope:
        body = envelope.get("body")
        if not isinstance(body, dict):
            raise EnvelopeRefused("the envelope carries no message")
        return body, envelope
    namespace, generation = envelope.get("ns"), envelope.get("gen")
    ring = ring_for(namespace) if ring_for is not None and isinstance(namespace, str) else None
    if ring is None or not ring.covers(namespace) or not isinstance(generation, int):
        raise EnvelopeRefused(f"sealed for namespace {namespace!r}, whose key this receiver does not hold")
    try:
        plain = ring.open_data(generation, base64.b64decode(str(envelope["sealed"]), validate=True), _aad(envelope))
    except UnknownKey:
        raise
    except (EntryError, ValueError) as exc:
        raise EnvelopeRefused(f"the sealed message does not open: {exc}") from None
    try:
        message = json.loads(plain)
    except ValueError as exc:
        raise EnvelopeRefused(f"the sealed message is not JSON: {exc}") from None
    if not isinstance(message, dict):
        raise EnvelopeRefused("the sealed message is not an object")
    return message, envelope
