"""Cache keys: model fingerprint + namespace + a chained hash over the prompt's tokens.

Pure functions only. Every function takes ``namespace, fingerprint`` first, in that order
(the order of the Redis key names). A key for the prefix ``tokens[:p]`` is the BLAKE2b digest of
``fingerprint, namespace, tokens[0:p]`` fed range by range into one running hash,
so a range key pins every token before it, does not depend on where earlier
ranges were cut, and is stable across processes and machines (never ``hash()``).

Batches are cut on a fixed grid and, for a prompt with structure (its segments, a chat's
turns), at the positions where its parts begin (``extra`` cuts). A key also pins the extra
cuts before its end: a hit then implies the very batch history its cold run has.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from .errors import InvalidNamespace

# Bump when the layout of stored state bytes or entry headers changes: old entries
# then simply stop matching instead of being restored into an incompatible context.
# 2: signed entries (ECE2); 3: prefills cut on a fixed grid (bit-exact reuse); 4: sealed states (ECE3);
# 5: the kernels that computed a state are part of its model's identity (``ModelIdentity.kernels``): entries
# stored before could have come from any build, so they stop matching.
# 6: entries signed by their producer (ECE4)
STATE_FORMAT_VERSION = 6

KEY_BYTES = 16
DEFAULT_NAMESPACE = "default"
KEY_PREFIX = "ec"
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# A device name may begin with '-' or '_' (it is a Django slug); never ':', '*' or '{'.
_DEVICE_RE = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class ModelIdentity:
    """Everything that makes two prompt states interchangeable.

    Not the context size: a range's state bytes and the logits after restoring it are the same
    bits at n_ctx 1024, 2048 and 4096 (measured), so a board sized to a small memory shares
    entries with the rest of the fleet; a prompt that does not fit its context is refused
    before any lookup.

    The kernels are: two builds of one llama.cpp (AVX2 and AVX-512, a Cortex-A53 and a Cortex-A76)
    compute other bits, so ``kernels`` names the code that computed them
    (``inference.engine.kernels.KernelClass.identity``: class name and digest of the loaded library's
    features and build) and boards of different kernel classes never share a fingerprint."""

    gguf_sha256: str
    kv_type: str
    llama_build: str
    state_format: int = STATE_FORMAT_VERSION
    repacked: bool = False  # llama.cpp's repacked weights compute other bits: such boards share among themselves
    kernels: str = ""  # the kernel class of the loaded llama.cpp ("x86_64-avx2:<digest>"); every board names one

    def fingerprint(self) -> str:
        """16 hex characters naming this model configuration in every key (a field left at its
        default, ``repacked`` False or ``kernels`` empty, is left out of the digest)."""
        fields = asdict(self)
        if not fields["repacked"]:
            del fields["repacked"]
        if not fields["kernels"]:
            del fields["kernels"]
        canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=8).hexdigest()


def check_namespace(namespace: str) -> str:
    """Return ``namespace`` if it is usable in keys, else raise InvalidNamespace."""
    if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
        raise InvalidNamespace(
            f"invalid namespace {namespace!r}: use 1-64 characters from letters, digits, '_', '.', '-'"
        )
    return namespace


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Token ids as little-endian int32: the byte form that is hashed."""
    try:
        return struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error as exc:
        raise ValueError(f"token ids must be int32: {exc}") from exc


def prefix_keys(
    namespace: str,
    fingerprint: str,
    tokens: Sequence[int],
    boundaries: Iterable[int],
    *,
    grid: int,
    extra: Iterable[int] = (),
) -> list[bytes]:
    """Keys of the prefixes ``tokens[:b]`` for each boundary ``b`` (ascending, 1..len).

    ``grid`` is where every prefill cuts its batches (every ``grid`` positions) and ``extra``
    the prompt's other cuts: both enter every key (the extra cuts below its end), so a key
    pins the batch history of its prefix too, and a hit restores the very bits its cold run
    would compute. Without extra cuts the keys are those of a plain prompt.
    """
    check_namespace(namespace)
    if grid < 1:
        raise ValueError(f"the batch grid must be at least 1 token, got {grid}")
    extra = off_grid(extra, grid)
    running = hashlib.blake2b(digest_size=KEY_BYTES, person=b"edgecache-pfx")
    running.update(f"{fingerprint}\x00{namespace}\x00grid={grid}\x00".encode())
    keys: list[bytes] = []
    previous = 0
    for boundary in boundaries:
        if boundary <= previous or boundary > len(tokens):
            raise ValueError(f"boundaries must ascend within 1..{len(tokens)}, got {boundary}")
        running.update(token_bytes(tokens[previous:boundary]))
        below = [cut for cut in extra if cut < boundary]
        if below:
            key = running.copy()
            key.update(b"\x00cuts=" + token_bytes(below))
            keys.append(key.digest())
        else:
            keys.append(running.copy().digest())
        previous = boundary
    return keys


def tokens_digest(tokens: Sequence[int]) -> str:
    """Digest of one range's token ids, kept in an entry to verify what it holds."""
    return hashlib.blake2b(token_bytes(tokens), digest_size=KEY_BYTES).hexdigest()


def entry_key_name(namespace: str, fingerprint: str, key: bytes) -> str:
    """Redis key of one entry. The ``{...}`` hash tag keeps it on one Redis Cluster slot."""
    return f"{KEY_PREFIX}:e:{check_namespace(namespace)}:{fingerprint}:{{{key.hex()}}}"


def module_key(namespace: str, fingerprint: str, schema_digest: str, piece: str) -> bytes:
    """Key of a prompt module's state: model, namespace, schema version and module path."""
    check_namespace(namespace)
    digest = hashlib.blake2b(digest_size=KEY_BYTES, person=b"edgecache-mod")
    digest.update(f"{fingerprint}\x00{namespace}\x00{schema_digest}\x00{piece}".encode())
    return digest.digest()


def module_key_name(namespace: str, fingerprint: str, schema_digest: str, key: bytes) -> str:
    """Redis key of a prompt module's entry (``ec:m:...``), tagged like prefix entries."""
    if not re.fullmatch(r"[0-9a-f]{1,32}", schema_digest):
        raise ValueError(f"invalid schema digest {schema_digest!r}")
    return f"{KEY_PREFIX}:m:{check_namespace(namespace)}:{fingerprint}:{schema_digest}:{{{key.hex()}}}"


def entry_key_pattern(namespace: str | None = None, fingerprint: str | None = None) -> str:
    """SCAN pattern for the entries (prefix ranges and prompt modules) of a namespace and/or model."""
    ns = check_namespace(namespace) if namespace else "*"
    if fingerprint and not re.fullmatch(r"[0-9a-f]{1,32}", fingerprint):
        raise ValueError(f"invalid model fingerprint {fingerprint!r}")
    if ns == "*" and fingerprint is None:
        return f"{KEY_PREFIX}:[em]:*"
    return f"{KEY_PREFIX}:[em]:{ns}:{fingerprint or '*'}:*"


def schema_key_pattern(schema_digest: str) -> str:
    """SCAN pattern for every module entry of one schema version (any namespace, any model)."""
    if not re.fullmatch(r"[0-9a-f]{1,32}", schema_digest):
        raise ValueError(f"invalid schema digest {schema_digest!r}")
    return f"{KEY_PREFIX}:m:*:*:{schema_digest}:*"


def parse_entry_key_name(name: str) -> tuple[str, str, bytes]:
    """Inverse of ``entry_key_name`` and ``module_key_name``: (namespace, fingerprint, key)."""
    try:
        parts = name.split(":")
        prefix, kind, namespace, fingerprint, tagged = parts[0], parts[1], parts[2], parts[3], parts[-1]
        if prefix != KEY_PREFIX or (kind, len(parts)) not in (("e", 5), ("m", 6)):
            raise ValueError
        if not (tagged.startswith("{") and tagged.endswith("}")):
            raise ValueError
        return namespace, fingerprint, bytes.fromhex(tagged[1:-1])
    except (ValueError, IndexError) as exc:
        raise ValueError(f"not an EdgeCache entry key: {name!r}") from exc


def catalog_key_names(namespace: str) -> dict[str, str]:
    """Redis keys of a namespace's master catalog; one hash tag so MULTI works on a cluster."""
    tag = f"{KEY_PREFIX}:c:{{{check_namespace(namespace)}}}"
    return {"epoch": f"{tag}:epoch", "log": f"{tag}:log", "snapshot": f"{tag}:snap"}


def device_key_name(name: str) -> str:
    """Redis key of a device's registry record (``ec:device:<name>``); ValueError for a name unfit for keys."""
    if not isinstance(name, str) or not _DEVICE_RE.match(name):
        raise ValueError(f"invalid device name {name!r}: use 1-64 characters from letters, digits, '_', '.', '-'")
    return f"{KEY_PREFIX}:device:{name}"


def queue_key_names(namespace: str, who: str = "") -> list[str]:
    """Redis keys of the runs under way in ``namespace`` (``ec:q:{ns}``) and, with ``who`` (an API
    key's id), of that key's own (``ec:q:{ns}:k:<who>``): sorted sets the control plane alone
    writes (admission control); one hash tag so a script takes both on a cluster."""
    tag = f"{KEY_PREFIX}:q:{{{check_namespace(namespace)}}}"
    if not who:
        return [tag]
    if not isinstance(who, str) or not _DEVICE_RE.match(who):
        raise ValueError(f"invalid queue owner {who!r}")
    return [tag, f"{tag}:k:{who}"]


def off_grid(extra: Iterable[int], grid: int) -> tuple[int, ...]:
    """The extra cuts that add a batch end: positive, off the grid, ascending, once each."""
    return tuple(sorted({int(cut) for cut in extra if cut > 0 and cut % grid}))


def grid_cuts(n_tokens: int, grid: int, start: int = 0, extra: Iterable[int] = ()) -> list[int]:
    """Positions in ``(start, n_tokens)`` where a prefill ends a batch: every grid point and
    every extra cut (where a segment or a chat turn begins)."""
    first = (start // grid + 1) * grid
    points = set(range(first, n_tokens, grid))
    points.update(cut for cut in extra if start < cut < n_tokens)
    return sorted(points)


def range_boundaries(n_tokens: int, grid: int, extra: Iterable[int] = ()) -> list[int]:
    """Prefix lengths that are stored and looked up for a prompt of ``n_tokens``: every cut
    (where every prefill ends a batch, so a range is whole batches) and the whole prompt.
    Ascending; the lookup walks it from the end."""
    if n_tokens <= 0:
        return []
    return [*grid_cuts(n_tokens, grid, 0, extra), n_tokens]


_REQUEST_ID_RE = re.compile(r"^[0-9a-fA-F-]{32,36}$")


def _request_id(request_id: str) -> str:
    if not isinstance(request_id, str) or not _REQUEST_ID_RE.match(request_id):
        raise ValueError(f"invalid request id {request_id!r}: expected a UUID")
    return request_id.lower()


def _device(name: str) -> str:
    if not isinstance(name, str) or not _DEVICE_RE.match(name):
        raise ValueError(f"invalid device name {name!r}")
    return name


# The control inbox: where boards reach the control plane, each through keys that name the sender,
# so that who sent a message is told by the key its ACL let it write, never by what it wrote.


def inbox_key(device: str) -> str:
    """A board's own inbox (``ec:inbox:<device>``), a list of the broker's server: its signed reports,
    progress and encoding results, pushed by it alone (LPUSH only) and drained by the control plane
    (``dashboard.worker.inbox``), a few at a time per board in turn."""
    return f"{KEY_PREFIX}:inbox:{_device(device)}"


def enroll_inbox_key(device: str) -> str:
    """Where a device's enrollment user sends its one kind of message, an enrollment (``ec:enroll:<device>``)."""
    return f"{KEY_PREFIX}:enroll:{_device(device)}"


def heartbeat_key(device: str) -> str:
    """A board's latest heartbeat (``ec:hb:<device>``): one value it overwrites (SET only), so a board
    that beats a million times a second still holds one key, and the control plane reads every
    board's latest (``HeartbeatBatch``) whatever one board sends."""
    return f"{KEY_PREFIX}:hb:{_device(device)}"


def producers_key_name(tenant: str) -> str:
    """Redis key of a tenant's producer table (``ec:producers:<tenant>``): who may make its entries,
    whose are quarantined; signed by the control plane, read-only to the tenant's boards."""
    return f"{KEY_PREFIX}:producers:{check_namespace(tenant)}"


def stream_channel(device: str, request_id: str) -> str:
    """Pub/sub channel the board ``device`` publishes a run's events on while it answers
    (``ec:stream:<device>:<id>``): a board's ACL reaches its own channels only."""
    return f"{KEY_PREFIX}:stream:{_device(device)}:{_request_id(request_id)}"


def stream_pattern(device: str) -> str:
    """Every stream channel of ``device`` (its ACL's channel pattern)."""
    return f"{KEY_PREFIX}:stream:{_device(device)}:*"


def cancel_key_name(device: str, request_id: str) -> str:
    """Key that tells the board ``device`` to stop a run, holding the control plane's signed cancel
    (``ec:cancel:<device>:<id>``): a board reads its own flags only and writes none."""
    return f"{KEY_PREFIX}:cancel:{_device(device)}:{_request_id(request_id)}"


def enrollment_refusal_key_name(device: str, signing_public_key: str) -> str:
    """Key of the control plane's signed word on a refused enrollment of ``device`` by the board whose
    signing key is ``signing_public_key`` (``ec:enroll-refused:<device>:<its SHA-256, 32 hex>``): short-lived,
    read only by that device's enrollment user while it enrolls, never part of the device's record."""
    fingerprint = hashlib.sha256(str(signing_public_key).encode()).hexdigest()[:32]
    return f"{KEY_PREFIX}:enroll-refused:{_device(device)}:{fingerprint}"


def enrollment_refusal_pattern(device: str) -> str:
    """Every enrollment refusal of ``device`` (its enrollment user's read pattern)."""
    return f"{KEY_PREFIX}:enroll-refused:{_device(device)}:*"


def heard_key_name(device: str, request_id: str | None = None) -> str:
    """Key holding when the control plane last heard a board on a run's stream (a stage, a token):
    ``ec:heard:<device>`` for the board (busy is alive, whatever its heartbeats' delay),
    ``ec:heard:<device>:<id>`` for one run (its board took it). The control plane's only."""
    return f"{KEY_PREFIX}:heard:{_device(device)}" + (f":{_request_id(request_id)}" if request_id is not None else "")


def cancel_pattern(device: str) -> str:
    """Every cancel flag of ``device`` (its ACL's read pattern)."""
    return f"{KEY_PREFIX}:cancel:{_device(device)}:*"
