"""Verbs on devices and namespaces (tenants): registration, tokens, signing keys, board reports."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cachebox.errors import CacheBoxError
from cachebox.events import security_event
from cachebox.keys import device_key_name, enrollment_refusal_key_name, heartbeat_key
from cachebox.signing import pin_proof
from dashboard.live.broadcast import broadcast
from dashboard.pages.stats import memory_label
from dashboard.router import CANDIDATES
from dashboard.security import ratelimit
from dashboard.security.signing import (
    control_plane_public_key,
    control_plane_signer,
    open_from,
    sealed_ring,
    signed_producer_table,
)
from inference.board import devices as registry
from inference.board.identity import (
    check_enrollment_signature,
    enrollment_public_key,
    enrollment_redis_password,
    password_sha256,
)
from inference.contract.envelope import EnvelopeRefused, Kind, peek
from inference.contract.messages import MAX_HEARTBEAT_BYTES, BoardMessage, EnrollRequest, Heartbeat

from ..models import Device, Namespace, offline_after, token_usable
from .audit import AuditAction, audit
from .cache import cachebox, delete_entries_of
from .identities import APPLIED_FLAG, apply_all_identities, apply_identity, client, servers

log = logging.getLogger("dashboard.actions")

ENROLL_WINDOW_S = 600  # an enrollment request older than this (or from a clock this far off) is refused


def _record_for(device: Device) -> registry.DeviceRecord:
    usable = token_usable(device)
    return registry.DeviceRecord(
        name=device.name,
        token_sha256=device.token_sha256 if usable else "",  # only while the token may still enroll
        pin=device.pin_proof if usable else "",
        signing_key=device.signing_public_key,
        box_key=device.box_public_key,
        threads=device.cpu_threads,
        memory_mb=device.memory_mb,
        link_bandwidth_mbps=device.link_bandwidth_mbps,
        link_rtt_ms=device.link_rtt_ms,
        revoked=device.revoked_at is not None,
        namespace=device.namespace_id,
        share=device.namespace.share_across_devices,
        keyring=sealed_ring(device),
    )


def publish_device(device: Device) -> bool:
    """Tell boards (through the cache box) the device's current token hash and settings, signed
    by the control plane.

    False when the cache box cannot be reached: the database stays the truth and
    ``publish_all_devices`` (run at every start) publishes it later.
    """
    try:
        registry.publish(cachebox(), _record_for(device), control_plane_signer())
        return True
    except CacheBoxError as exc:
        log.warning("device %s not published to the cache box: %s", device.name, exc)
        return False


def publish_all_devices() -> int:
    """Re-publish every device and its Redis users (after the cache box restarted empty)."""
    apply_all_identities()
    store = cachebox()
    signer = control_plane_signer()
    count = 0
    for device in Device.objects.select_related("namespace"):
        registry.publish(store, _record_for(device), signer)
        count += 1
    for tenant in Namespace.objects.values_list("name", flat=True):
        publish_producers(tenant)
    return count


def publish_producers(tenant: str) -> bool:
    """Publish ``tenant``'s producer table (who may make its entries, whose are quarantined), signed
    by the control plane; boards take it at their next heartbeat. False when the cache box is down
    (``publish_all_devices`` publishes it again at every start)."""
    try:
        cachebox().put_producer_table(tenant, signed_producer_table(tenant))
        return True
    except CacheBoxError as exc:
        log.warning("producer table of %s not published to the cache box: %s", tenant, exc)
        return False


def _changed(devices) -> None:
    """Publish changed devices to their boards (the registry in the cache box), make their Redis
    users match (``identities``) and, once the change commits, tell the open pages. Call it after
    the verb's transaction block: a device record must not reach boards before the database holds it."""
    tenants = set()
    for device in devices:
        apply_identity(device)
        publish_device(device)
        tenants.add(device.namespace_id)
        transaction.on_commit(lambda device=device: broadcast("device", device_json(device)))
    for tenant in sorted(tenants):  # a board enrolled, revoked or moved: who may make the tenant's entries
        publish_producers(tenant)


# -- namespaces (tenants) and their signing keys ---------------------------------------------------
def save_namespace(user, namespace: Namespace) -> None:
    """Create or change a namespace; its boards learn the sharing setting at their next heartbeat."""
    created = namespace.pk is None or not Namespace.objects.filter(pk=namespace.pk).exists()
    with transaction.atomic():
        namespace.save()
        detail = (
            f"share_across_devices={namespace.share_across_devices} share_across_kernel_classes={namespace.share_across_kernel_classes} "
            f"members_manage_api_keys={namespace.members_manage_api_keys}"
        )
        audit(user, AuditAction.NAMESPACE_CREATE if created else AuditAction.NAMESPACE_UPDATE, namespace.name, detail)
    _changed(namespace.devices.all())


def rotate_signing_key(user, namespace: Namespace) -> int:
    """A new signing key for the namespace; returns its generation.

    Boards receive it sealed at their next heartbeat (a few seconds) and sign with it from
    then on; entries signed with the previous key stay valid, older ones are refused.
    """
    with transaction.atomic():
        namespace = Namespace.objects.select_for_update().get(pk=namespace.pk)
        namespace.key_generation += 1
        namespace.key_rotated_at = timezone.now()
        namespace.save(update_fields=["key_generation", "key_rotated_at"])
        audit(user, AuditAction.NAMESPACE_ROTATE_KEY, namespace.name, f"generation {namespace.key_generation}")
    _changed(namespace.devices.all())
    return namespace.key_generation


# -- devices -----------------------------------------------------------------------------------------
def _set_token(device: Device) -> str:
    """A new one-time enrollment token (it expires after ``EDGECACHE_TOKEN_TTL_HOURS``); the board
    enrolled before (if any) is refused from now on. Kept: the token's hash, the public key that
    checks an enrollment signed with it, and its proof of the control plane's key."""
    token = registry.new_token()
    device.token_sha256 = registry.hash_token(token)
    device.enroll_key = enrollment_public_key(token)
    device.pin_proof = pin_proof(token, control_plane_public_key())
    device.enroll_redis_sha256 = password_sha256(enrollment_redis_password(token))
    device.token_expires = timezone.now() + timedelta(hours=settings.EDGECACHE_TOKEN_TTL_HOURS)
    device.signing_public_key = device.box_public_key = ""
    device.enrolled_at = None
    device.last_message_ts = 0.0
    device.token_created = timezone.now()
    device.revoked_at = None
    return token


def register_device(user, **fields) -> tuple[Device, str]:
    """Create a device and its token; the token is returned once and only its hash is kept."""
    device = Device(**fields)
    token = _set_token(device)
    with transaction.atomic():
        device.save()
        audit(user, AuditAction.DEVICE_REGISTER, device.name)
    _changed([device])
    return device, token


# What staff may change on a device; credentials and enrollment change only through their verbs.
EDITABLE_FIELDS = ("kind", "cpu_threads", "memory_mb", "link_bandwidth_mbps", "link_rtt_ms", "namespace")


def update_device(user, device: Device) -> None:
    """Save a device's settings (never its credentials or enrollment, whatever the instance holds)."""
    with transaction.atomic():
        device.save(update_fields=list(EDITABLE_FIELDS))
        audit(user, AuditAction.DEVICE_UPDATE, device.name)
    device.refresh_from_db()
    _changed([device])


def rotate_token(user, device: Device) -> str:
    """A new token for the device; the old one stops working at once."""
    token = _set_token(device)
    with transaction.atomic():
        device.save()
        audit(user, AuditAction.DEVICE_ROTATE_TOKEN, device.name)
    _changed([device])
    return token


def revoke_device(user, device: Device) -> None:
    """Refuse the device's token from now on (its board stops serving at its next task), and
    quarantine its entries: the producer table lists it as revoked (every reader refuses and evicts
    what it made) and the entries the mirror knows it stored are deleted now."""
    device.revoked_at = timezone.now()
    with transaction.atomic():
        device.save(update_fields=["revoked_at"])
        audit(user, AuditAction.DEVICE_REVOKE, device.name)
    _changed([device])
    delete_entries_of(device.name)


def enroll_device(payload: dict) -> Device | None:
    """A board sends its public keys and its Redis password's hash, signed with the key its token
    gives: the device is enrolled to those keys (the token is spent), its own Redis user is made,
    and its ring is sealed to them.

    At most ``EDGECACHE_ENROLL_RATE`` attempts per device and minute are looked at. A refusal is
    logged and changes no record: the reason goes, signed, to a short-lived note that only the board
    holding the request's key reads while it enrolls (``inference.board.devices.enrollment_refusal``)."""
    request = EnrollRequest.receive(payload, receiver="control")
    if request is None:
        return None
    verdict = ratelimit.hit("enroll", request.device, settings.EDGECACHE_ENROLL_RATE)
    if not verdict.allowed:
        security_event(
            "enrollment_refused",
            device=request.device,
            reason=f"over {verdict.limit} enrollment attempts this minute (EDGECACHE_ENROLL_RATE)",
        )
        return None
    with transaction.atomic():
        device = Device.objects.select_for_update().filter(name=request.device).select_related("namespace").first()
        reason = ""
        if device is None:
            reason = "unknown device"
        elif device.revoked_at is not None:
            reason = "revoked"
        elif not device.enroll_key:
            reason = "the token was already used to enroll a board: rotate the token to enroll another one"
        elif not token_usable(device):
            reason = "the token expired: rotate it on the device's page and start the board with the new one"
        elif abs(time.time() - request.ts) > ENROLL_WINDOW_S:
            reason = "the enrollment request is stale (check the board's clock)"
        elif not check_enrollment_signature(request.dump(), device.enroll_key):
            reason = "wrong token"
        if reason:
            security_event("enrollment_refused", device=request.device, reason=reason)
            if device is not None and device.signing_public_key != request.signing_public_key:
                _note_refusal(device.name, request.signing_public_key, reason)
            return None
        device.signing_public_key = request.signing_public_key
        device.box_public_key = request.box_public_key
        device.redis_password_sha256 = request.redis_password_sha256
        device.enroll_key = device.pin_proof = device.enroll_redis_sha256 = ""  # spent: a token enrolls one board once
        device.enrolled_at = timezone.now()
        device.save(
            update_fields=[
                "signing_public_key",
                "box_public_key",
                "redis_password_sha256",
                "enroll_key",
                "pin_proof",
                "enroll_redis_sha256",
                "enrolled_at",
            ]
        )
        audit(None, AuditAction.DEVICE_ENROLL, device.name, f"signing key {device.signing_public_key[:16]}…")
    _changed([device])
    return device


def _note_refusal(name: str, signing_public_key: str, reason: str) -> None:
    """Tell the board that asked why its enrollment was refused, apart from the device's record."""
    note = registry.enrollment_refusal(name, signing_public_key, reason, control_plane_signer())
    try:
        cachebox().set_flag(
            enrollment_refusal_key_name(name, signing_public_key), registry.ENROLLMENT_REFUSAL_TTL_S, note
        )
    except CacheBoxError as exc:
        log.warning("the refusal of %s's enrollment was not noted for its board: %s", name, exc)


def authenticate_board(name: str) -> Device | None:
    """The enrolled, unrevoked device ``name``, or None (logged)."""
    device = Device.objects.filter(name=name).select_related("namespace").first() if isinstance(name, str) else None
    return _authenticated(device, name)


def _authenticated(device: Device | None, name) -> Device | None:
    reason = ""
    if device is None:
        reason = "unknown device"
    elif device.revoked_at is not None:
        reason = "revoked"
    elif not device.signing_public_key:
        reason = "not enrolled"
    if reason:
        security_event("board_message_refused", device=str(name)[:64], reason=reason)
        return None
    return device


_KINDS = {
    "RunReport": Kind.REPORT,
    "EncodeReport": Kind.ENCODED,
    "EncodeProgress": Kind.PROGRESS,
    "Heartbeat": Kind.HEARTBEAT,
    "AuditReport": Kind.AUDITED,
}


def receive_board_message(cls: type[BoardMessage], payload: dict) -> tuple[BoardMessage | None, Device | None, float]:
    """A board's message checked at the boundary: (message, its device, its send time), or Nones
    (logged) when it is not signed (and sealed) by its enrolled, unrevoked board, names another
    sender than its envelope, or does not follow the contract."""
    try:
        sender = peek(payload)["from"]
    except EnvelopeRefused as exc:
        security_event("board_message_refused", message=cls.__name__, reason=str(exc)[:300])
        return None, None, 0.0
    return _checked(cls, payload, None, sender, loaded=False)


def _checked(
    cls: type[BoardMessage], payload: dict, device: Device | None, sender: str, *, loaded: bool = True
) -> tuple[BoardMessage | None, Device | None, float]:
    """``receive_board_message`` for a sender whose device was read already (``loaded``: ``device``
    is what the database holds for ``sender``, None for none)."""
    device = _authenticated(device, sender) if loaded else authenticate_board(sender)
    if device is None:
        return None, None, 0.0
    try:
        body, head = open_from(device, payload, _KINDS[cls.__name__])
    except (EnvelopeRefused, CacheBoxError, ValueError) as exc:  # UnknownKey too: nothing this control plane sealed
        security_event("board_message_refused", device=device.name, message=cls.__name__, reason=str(exc)[:300])
        return None, None, 0.0
    message = cls.receive(body, receiver="control")
    if message is None:
        return None, None, 0.0
    if message.device != device.name:
        security_event(
            "board_message_refused",
            device=device.name,
            message=cls.__name__,
            reason=f"names device {message.device!r}, not its signer",
        )
        return None, None, 0.0
    return message, device, float(head["ts"])


def record_heartbeat(payload: dict) -> Device | None:
    """A board lives: store its status (catalogs, model) and tell the open pages.

    A heartbeat older than the last one accepted is a replay (or out of order): refused."""
    beat, device, sent = receive_board_message(Heartbeat, payload)
    if device is None:
        return None
    with transaction.atomic():
        fresh = Device.objects.filter(pk=device.pk, last_message_ts__lt=sent).update(last_message_ts=sent)
        if not fresh:
            security_event("board_message_refused", device=device.name, reason="replayed or out-of-order heartbeat")
            return None
        device.last_seen = timezone.now()
        device.status = beat.status.dump()
        device.announced_online = True
        device.save(update_fields=["last_seen", "status", "announced_online"])
        transaction.on_commit(lambda: broadcast("device", device_json(device)))
    _republish_if_missing(device)
    return device


class HeartbeatBatch:
    """Heartbeats as a control worker reads them, each board's latest from its own key: kept in memory and written together every
    ``FLUSH_S`` (one query for their devices, one transaction of one UPDATE each, one pipelined
    look-up of their registry records), instead of a query, two writes, a commit and a registry
    read per heartbeat. Each is checked as ``record_heartbeat`` checks it (signed by its enrolled,
    unrevoked board, newer than the last one accepted); pages are told of a board at most every
    ``BROADCAST_EVERY_S``, of ``BROADCASTS_PER_FLUSH`` boards per flush at most. A worker that dies loses the heartbeats of its
    last ``FLUSH_S`` at most: its boards beat again within their interval.
    """

    FLUSH_S = 0.25
    BROADCAST_EVERY_S = 30.0
    # Pages are told of at most this many boards per flush (a broadcast is a round trip): 5,000 boards
    # coming online at once took 41 s of broadcasts and the list grew faster than it drained. The
    # sweeper tells pages of every board whose online state changed, every few seconds, anyway.
    BROADCASTS_PER_FLUSH = 20

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: list[dict] = []
        self._thread: threading.Thread | None = None
        self._told: dict[str, float] = {}  # device -> when the pages were last told of it
        self._names: list[str] = []  # the enrolled, unrevoked boards whose heartbeat keys are read
        self._roster_at = float("-inf")
        self._seen: dict[str, bytes | int] = {}  # device -> digest (or size, too large) of the beat read last

    ROSTER_EVERY_S = 2.0  # how soon a newly enrolled board's heartbeats are read
    READ_BATCH = 1000  # heartbeat keys read per round trip

    def add(self, payload: dict) -> None:
        """One heartbeat for the next flush (as ``take`` adds what it reads)."""
        with self._lock:
            self._pending.append(payload)

    def start(self) -> None:
        """Record heartbeats from now on, every ``FLUSH_S``: every enrolled board's latest one
        (several control workers may read them: a board's row only moves forward)."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="edgecache-heartbeats", daemon=True)
                self._thread.start()

    def take(self) -> int:
        """Read every enrolled board's latest heartbeat (``ec:hb:NAME``: at most
        ``MAX_HEARTBEAT_BYTES`` of it, in pipelined round trips) and keep for this batch those that
        changed since the last read; how many. Each board holds one key however often it beats, so
        one board's flood delays no other board."""
        if time.monotonic() - self._roster_at > self.ROSTER_EVERY_S:
            self._names = list(
                Device.objects.filter(revoked_at=None).exclude(signing_public_key="").values_list("name", flat=True)
            )
            self._roster_at = time.monotonic()
            self._seen = {name: seen for name, seen in self._seen.items() if name in set(self._names)}
        broker = broker_server()
        taken = 0
        for start in range(0, len(self._names), self.READ_BATCH):
            names = self._names[start : start + self.READ_BATCH]
            heads = broker.read_heads([heartbeat_key(name) for name in names], MAX_HEARTBEAT_BYTES + 1)
            for name, (raw, size) in zip(names, heads):
                if not size:
                    continue
                seen = hashlib.blake2b(raw, digest_size=16).digest() if size <= MAX_HEARTBEAT_BYTES else size
                if self._seen.get(name) == seen:
                    continue  # the beat read last time: nothing new from this board
                self._seen[name] = seen
                if size > MAX_HEARTBEAT_BYTES:
                    security_event(
                        "board_message_refused",
                        device=name,
                        message="Heartbeat",
                        reason=f"{size} bytes, more than {MAX_HEARTBEAT_BYTES}",
                    )
                    continue
                try:
                    payload = json.loads(raw)
                except ValueError:
                    security_event("board_message_refused", device=name, message="Heartbeat", reason="not JSON")
                    continue
                if not isinstance(payload, dict):
                    security_event(
                        "board_message_refused", device=name, message="Heartbeat", reason="not a JSON object"
                    )
                    continue
                with self._lock:
                    self._pending.append(payload)
                taken += 1
        return taken

    def _run(self) -> None:
        from django.db import close_old_connections

        warned = 0.0
        due = time.monotonic()
        while True:
            # A flush every FLUSH_S from the last one's start (not FLUSH_S after it ended): a
            # heartbeat waits FLUSH_S / 2 on average, whatever a flush of a thousand boards costs.
            due += self.FLUSH_S
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                due = time.monotonic()  # a flush took longer than FLUSH_S: the next starts now
            try:
                close_old_connections()
                self.take()
                self.flush()
            except Exception as exc:  # the broker or database away for a moment: the next heartbeats land
                if time.monotonic() - warned > 30:
                    warned = time.monotonic()
                    log.warning(
                        "heartbeats not recorded (again in %.1f s): %s: %s", self.FLUSH_S, type(exc).__name__, exc
                    )
            finally:
                close_old_connections()

    def flush(self) -> int:
        """Record every heartbeat taken since the last flush; returns how many were accepted."""
        with self._lock:
            payloads, self._pending = self._pending, []
        if not payloads:
            return 0
        senders = {}
        for payload in payloads:
            try:
                senders[id(payload)] = peek(payload)["from"]
            except EnvelopeRefused as exc:
                security_event("board_message_refused", message="Heartbeat", reason=str(exc)[:300])
        devices = {
            device.name: device
            for device in Device.objects.filter(name__in=set(senders.values())).select_related("namespace")
        }
        newest: dict[str, tuple[float, dict]] = {}
        for payload in payloads:
            name = senders.get(id(payload))
            if name is None:
                continue
            beat, device, sent = _checked(Heartbeat, payload, devices.get(name), name)
            if device is None:
                continue
            if time.time() - sent > offline_after(beat.status.dump()).total_seconds():
                continue  # sent before its board would count as offline now: it says nothing of now
            if name not in newest or sent > newest[name][0]:
                newest[name] = (sent, beat.status.dump())
        accepted = []
        for name, (sent, status) in newest.items():
            device = devices[name]
            if sent > device.last_message_ts:
                accepted.append((device, sent, status))
            else:
                security_event("board_message_refused", device=name, reason="replayed or out-of-order heartbeat")
        now = timezone.now()
        _write_heartbeats([(device.pk, sent, status) for device, sent, status in accepted], now)
        # Boards the pages were told are offline (or never told of) come back first in the broadcasts.
        accepted.sort(key=lambda row: row[0].announced_online)
        returning = {device.name for device, _, _ in accepted if not device.announced_online}
        for device, sent, status in accepted:
            device.last_message_ts, device.last_seen, device.status, device.announced_online = sent, now, status, True
        accepted = [device for device, _, _ in accepted]
        if accepted:
            CANDIDATES.forget()
        clock = time.monotonic()
        told = 0
        for device in accepted:
            told_at = self._told.get(device.name)
            if told < self.BROADCASTS_PER_FLUSH and (
                device.name in returning or told_at is None or clock - told_at > self.BROADCAST_EVERY_S
            ):
                self._told[device.name] = clock
                told += 1
                broadcast("device", device_json(device))
        _republish_missing(accepted)
        return len(accepted)


HEARTBEATS = HeartbeatBatch()


def _write_heartbeats(rows: list[tuple[int, float, dict]], now) -> None:
    """One statement for every accepted heartbeat, in one transaction (no model instance, no query
    built per row); a row only moves forward (``last_message_ts``), whoever else writes meanwhile."""
    from django.db import connection

    if not rows:
        return
    fields = {
        name: Device._meta.get_field(name) for name in ("last_message_ts", "last_seen", "status", "announced_online")
    }
    seen = fields["last_seen"].get_db_prep_save(now, connection)
    online = fields["announced_online"].get_db_prep_save(True, connection)
    quote = connection.ops.quote_name
    sql = (
        f"UPDATE {quote(Device._meta.db_table)} SET {quote(fields['last_message_ts'].column)} = %s, {quote(fields['last_seen'].column)} = %s, "
        f"{quote(fields['status'].column)} = %s, {quote(fields['announced_online'].column)} = %s "
        f"WHERE {quote(Device._meta.pk.column)} = %s AND {quote(fields['last_message_ts'].column)} < %s"
    )
    params = [
        (sent, seen, fields["status"].get_db_prep_save(status, connection), online, pk, sent)
        for pk, sent, status in rows
    ]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(sql, params)


def broker_server():
    """The broker's server (``REDIS_URL``), where boards push their heartbeats (one client per process)."""
    return client(settings.REDIS_URL, settings.EDGECACHE_CONNECT_TIMEOUT, settings.EDGECACHE_IO_TIMEOUT)


def _republish_missing(devices: list[Device]) -> None:
    """Live boards whose records the registry lost (its cache box restarted empty) get them back:
    one pipelined look-up for all of them."""
    if not devices:
        return

    try:
        present = cachebox().exists([device_key_name(device.name) for device in devices])
    except CacheBoxError:
        return
    tenants = set()
    for device, there in zip(devices, present):
        if not there:
            log.warning("device %s: its registry record was gone (cache box restarted?); published again", device.name)
            publish_device(device)
            tenants.add(device.namespace_id)
    for tenant in sorted(tenants):  # the producer tables went with the records
        publish_producers(tenant)


def heartbeat_records() -> list[tuple[str, float, float]]:
    """(device, when its last accepted heartbeat was sent, when the control plane took it), as
    Unix times, for every device that has beaten (what ``bench fleet-sim`` samples for the ingest lag)."""
    out = []
    for name, status, last_seen in Device.objects.exclude(last_seen=None).values_list("name", "status", "last_seen"):
        sent = (status or {}).get("sent")
        if isinstance(sent, (int, float)) and sent > 0:
            out.append((name, float(sent), last_seen.timestamp()))
    return out


def _republish_if_missing(device: Device) -> None:
    """A live board whose record the registry lost (its cache box restarted empty) gets it back."""
    try:
        missing = registry.lookup(cachebox(), device.name) is None
    except CacheBoxError:
        return
    except registry.DeviceRefused:  # unreadable: written again below
        missing = True
    if missing:
        log.warning("device %s: its registry record was gone (cache box restarted?); published again", device.name)
        publish_device(device)
        publish_producers(device.namespace_id)  # the producer table went with the record


def device_json(device: Device, now=None) -> dict:
    return {
        "name": device.name,
        "online": device.online_at(now or timezone.now()),
        "revoked": device.revoked_at is not None,
        "last_seen": device.last_seen.isoformat() if device.last_seen else None,
        "link": device.link_label,
        "memory": memory_label(device.status, device.memory_mb),
    }


def ensure_identities() -> bool:
    """Apply every device's Redis users (and publish every record) again when a server lost them:
    it restarted empty, without an ACL file to reload them from. One GET per server when nothing
    is missing. True when they had to be applied."""
    if not settings.EDGECACHE_BOARD_ACL:
        return False
    stores = servers()
    try:
        missing = [store for store in stores if store.read_flag(APPLIED_FLAG) is None]
    except CacheBoxError as exc:
        log.warning("cannot tell whether boards' Redis users are in place: %s", exc)
        return False
    if not missing:
        return False
    log.warning(
        "boards' Redis users missing on %s (restarted empty?): applying them again",
        ", ".join(store.safe_url for store in missing),
    )
    publish_all_devices()  # applies every identity, then publishes every record
    return True
