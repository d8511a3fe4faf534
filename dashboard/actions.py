"""Every change of state of the control plane goes through one function here, named for
what it does, which also tells the open pages (Zulip's ``do_...`` style)."""

from __future__ import annotations

import hmac
import logging
import uuid
from dataclasses import dataclass

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from cachebox import mirror
from cachebox.errors import CacheBoxUnavailable
from cachebox.events import security_event
from cachebox.keys import schema_key_pattern
from cachebox.signing import wrap_key
from cachebox.models import CacheEntry
from cachebox.store import CacheBox
from dashboard.celery import app as celery_app
from inference import devices as registry
from inference.breakdown import Breakdown
from inference.models import Schema

from .live import broadcast
from .signing import sealed_ring
from .models import AuditEvent, Device, InferenceRun, Namespace

log = logging.getLogger("dashboard.actions")

RUN_TASK = "edgecache.run_prompt"
ENCODE_TASK = "edgecache.encode_schema"


def cachebox() -> CacheBox:
    return CacheBox(settings.REDIS_URL, connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT, timeout=settings.EDGECACHE_IO_TIMEOUT)


def audit(user, action: str, target: str, detail: str = "") -> None:
    AuditEvent.objects.create(user=user if user and user.is_authenticated else None, action=action, target=target, detail=detail)
    log.info("audit user=%s action=%s target=%s %s", getattr(user, "username", None), action, target, detail)


# -- devices -------------------------------------------------------------------------------
def _record_for(device: Device) -> registry.DeviceRecord:
    return registry.DeviceRecord(
        name=device.name,
        token_sha256=device.token_sha256,
        threads=device.cpu_threads,
        link_bandwidth_mbps=device.link_bandwidth_mbps,
        link_rtt_ms=device.link_rtt_ms,
        revoked=device.revoked_at is not None,
        namespace=device.namespace_id,
        share=device.namespace.share_across_devices,
        keyring=sealed_ring(device),
    )


def publish_device(device: Device) -> bool:
    """Tell boards (through the cache box) the device's current token hash and settings.

    False when the cache box cannot be reached: the database stays the truth and
    ``publish_all_devices`` (run at every start) publishes it later.
    """
    try:
        registry.publish(cachebox(), _record_for(device))
        return True
    except (CacheBoxUnavailable, redis.RedisError, OSError) as exc:
        log.warning("device %s not published to the cache box: %s", device.name, exc)
        return False


def publish_all_devices() -> int:
    """Re-publish every device (after the cache box restarted empty)."""
    store = cachebox()
    count = 0
    for device in Device.objects.all():
        registry.publish(store, _record_for(device))
        count += 1
    return count


# -- namespaces (tenants) and their signing keys ---------------------------------------------------
def save_namespace(user, namespace: Namespace) -> None:
    """Create or change a namespace; its boards learn the sharing setting at their next heartbeat."""
    created = namespace.pk is None
    namespace.save()
    audit(user, "namespace.create" if created else "namespace.update", namespace.name, f"share_across_devices={namespace.share_across_devices}")
    for device in namespace.devices.all():
        publish_device(device)


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
        audit(user, "namespace.rotate_key", namespace.name, f"generation {namespace.key_generation}")
    for device in namespace.devices.all():
        publish_device(device)
    return namespace.key_generation


def _set_token(device: Device) -> str:
    token = registry.new_token()
    device.token_sha256 = registry.hash_token(token)
    device.wrap_key = wrap_key(token).hex()
    device.token_hint = token[:6]
    device.token_created = timezone.now()
    device.revoked_at = None
    return token


def register_device(user, **fields) -> tuple[Device, str]:
    """Create a device and its token; the token is returned once and only its hash is kept."""
    device = Device(**fields)
    token = _set_token(device)
    with transaction.atomic():
        device.save()
        audit(user, "device.register", device.name)
    publish_device(device)
    broadcast("device", device_json(device))
    return device, token


def update_device(user, device: Device) -> None:
    device.save()
    audit(user, "device.update", device.name)
    publish_device(device)
    broadcast("device", device_json(device))


def rotate_token(user, device: Device) -> str:
    """A new token for the device; the old one stops working at once."""
    token = _set_token(device)
    device.save()
    audit(user, "device.rotate_token", device.name)
    publish_device(device)
    broadcast("device", device_json(device))
    return token


def revoke_device(user, device: Device) -> None:
    """Refuse the device's token from now on (its board stops serving at its next task)."""
    device.revoked_at = timezone.now()
    device.save(update_fields=["revoked_at"])
    audit(user, "device.revoke", device.name)
    publish_device(device)
    broadcast("device", device_json(device))


def authenticate_board(name: str, token: str) -> Device | None:
    """The device whose valid token this is, or None (logged) for an unknown, wrong or revoked one."""
    device = Device.objects.filter(name=name).first()
    if device is None or device.revoked_at is not None or not hmac.compare_digest(device.token_sha256, registry.hash_token(token or "")):
        reason = "unknown device" if device is None else ("revoked" if device.revoked_at else "wrong token")
        security_event("board_message_refused", device=name, reason=reason)
        return None
    return device


# -- cache entries ---------------------------------------------------------------------------
def evict_entries(user, entries) -> int:
    """Delete entries from the cache box and the mirror (their catalog bits stay until reconcile)."""
    entries = list(entries)
    names = [entry.key for entry in entries]
    cachebox().delete(names)
    CacheEntry.objects.filter(key__in=names).delete()
    audit(user, "cache.evict", f"{len(names)} entries", ", ".join(names[:20]))
    return len(names)


def pin_entries(user, entries, pinned: bool) -> int:
    entries = list(entries)
    names = [entry.key for entry in entries]
    store = cachebox()
    if pinned:
        store.pin(names)
    else:
        store.unpin(names, settings.EDGECACHE_ENTRY_TTL or 7 * 24 * 3600)
    CacheEntry.objects.filter(key__in=names).update(pinned=pinned)
    audit(user, "cache.pin" if pinned else "cache.unpin", f"{len(names)} entries", ", ".join(names[:20]))
    return len(names)


def flush_entries(user, namespace: str | None, model: str | None) -> int:
    """Delete every entry of a namespace and/or model, in the store and the mirror."""
    removed = cachebox().flush(namespace, model)
    rows = CacheEntry.objects.all()
    if namespace:
        rows = rows.filter(namespace=namespace)
    if model:
        rows = rows.filter(model=model)
    rows.delete()
    audit(user, "cache.flush", f"namespace={namespace or '*'} model={model or '*'}", f"{removed} entries")
    return removed


# -- runs ----------------------------------------------------------------------------------------
@dataclass
class PromptSpec:
    """What to run, as the run page or a script describes it."""

    segments: list[str]
    source: str = "text"
    title: str = ""
    expected_answer: str = ""
    max_tokens: int = 16
    namespace: str = ""
    use_cache: bool = True
    schema: str = ""  # PML schema source, for a PML prompt (then ``pml`` holds the prompt)
    pml: str = ""

    @property
    def text(self) -> str:
        return "".join(self.segments)


def dispatch_run(user, devices: list[Device], spec: PromptSpec) -> list[dict]:
    """Send the prompt to each device's own queue; returns one {request_id, device} per device."""
    sent = []
    for device in devices:
        request_id = str(uuid.uuid4())
        message = {
            "request_id": request_id,
            "segments": spec.segments,
            "max_tokens": spec.max_tokens,
            "namespace": spec.namespace or device.namespace_id,
            "use_cache": spec.use_cache,
            "meta": {"source": spec.source, "title": spec.title[:200], "expected_answer": spec.expected_answer},
        }
        if spec.schema:
            message.update(schema=spec.schema, pml=spec.pml)
        celery_app.send_task(RUN_TASK, args=[message], queue=device.queue, expires=settings.EDGECACHE_TASK_EXPIRES)
        sent.append({"request_id": request_id, "device": device.name})
        broadcast("run.dispatched", {"request_id": request_id, "device": device.name, "title": spec.title[:200]})
    log.info("dispatched user=%s devices=%s", getattr(user, "username", None), [d.name for d in devices])
    return sent


def record_run(payload: dict) -> InferenceRun | None:
    """Store a board's result as an InferenceRun and broadcast it (once, however often delivered)."""
    device = authenticate_board(payload.get("device", ""), payload.get("token", ""))
    if device is None:
        return None
    breakdown = Breakdown.from_dict(payload.get("breakdown") or {})
    meta = payload.get("meta") or {}
    with transaction.atomic():
        run, created = InferenceRun.objects.get_or_create(
            request_id=payload["request_id"],
            defaults={
                "device": device,
                "source": meta.get("source", "text"),
                "title": meta.get("title", ""),
                "expected_answer": meta.get("expected_answer", ""),
                "prompt": payload.get("prompt", ""),
                "text": payload.get("text", ""),
                "error": payload.get("error", ""),
                "breakdown": {**breakdown.as_dict(), **({"modules_hit": payload["modules_hit"]} if "modules_hit" in payload else {})},
                "case": breakdown.case if not payload.get("error") else "",
                "ttft_ms": breakdown.ttft_ms,
                "ttlt_ms": breakdown.ttlt_ms,
                "prompt_tokens": breakdown.prompt_tokens,
                "matched_tokens": breakdown.matched_tokens,
                "state_bytes": breakdown.state_bytes,
            },
        )
        if not created:
            return run  # a redelivered message: stored once, broadcast once
        mirror.record_uploads(payload.get("uploaded") or [], device.name)
        mirror.record_hits(payload.get("fetched") or [])
        Device.objects.filter(pk=device.pk).update(last_seen=timezone.now())
        transaction.on_commit(lambda: broadcast("run", run_json(run)))
    return run


def record_heartbeat(payload: dict) -> Device | None:
    device = authenticate_board(payload.get("device", ""), payload.get("token", ""))
    if device is None:
        return None
    device.last_seen = timezone.now()
    device.status = payload.get("status") or {}
    device.save(update_fields=["last_seen", "status"])
    broadcast("device", device_json(device))
    return device


# -- JSON for pages ---------------------------------------------------------------------------
# -- schemas ------------------------------------------------------------------------------------
def dispatch_encode(user, schema: Schema, devices: list[Device], namespace: str = "") -> list[dict]:
    """Ask boards to encode a schema's modules into the cache box; progress comes back live."""
    sent = []
    for device in devices:
        request_id = str(uuid.uuid4())
        message = {"request_id": request_id, "schema_id": schema.pk, "schema": schema.source, "namespace": namespace or device.namespace_id}
        celery_app.send_task(ENCODE_TASK, args=[message], queue=device.queue, expires=settings.EDGECACHE_TASK_EXPIRES)
        sent.append({"request_id": request_id, "device": device.name})
    audit(user, "schema.encode", schema.name, ", ".join(d.name for d in devices))
    return sent


def record_encode_progress(payload: dict) -> None:
    device = authenticate_board(payload.get("device", ""), payload.get("token", ""))
    if device is not None:
        fields = ("request_id", "schema_id", "done", "total", "piece")
        broadcast("encode.progress", {"device": device.name, **{key: payload.get(key) for key in fields}})


def record_encoded(payload: dict) -> None:
    """A board finished encoding: mirror the stored entries and tell the pages."""
    device = authenticate_board(payload.get("device", ""), payload.get("token", ""))
    if device is None:
        return
    mirror.record_uploads(payload.get("stored") or [], device.name)
    broadcast(
        "encode.done",
        {
            "device": device.name,
            "request_id": payload.get("request_id"),
            "schema_id": payload.get("schema_id"),
            "error": payload.get("error", ""),
            "stored": len(payload.get("stored") or []),
            "skipped": len(payload.get("skipped") or []),
        },
    )


def delete_schema(user, schema: Schema) -> int:
    """Delete a schema and every cache entry of its modules (any namespace, any model)."""
    store = cachebox()
    names = [name.decode() for name in store.redis.scan_iter(match=schema_key_pattern(schema.digest), count=1000)]
    removed = store.delete(names)
    CacheEntry.objects.filter(key__contains=f":{schema.digest}:").delete()
    audit(user, "schema.delete", schema.name, f"{removed} cache entries")
    schema.delete()
    return removed


def run_json(run: InferenceRun) -> dict:
    return {
        "id": run.pk,
        "request_id": str(run.request_id),
        "device": run.device.name,
        "created": run.created.isoformat(),
        "title": run.title,
        "source": run.source,
        "text": run.text,
        "error": run.error,
        "expected_answer": run.expected_answer,
        "breakdown": run.breakdown,
    }


def device_json(device: Device) -> dict:
    return {
        "name": device.name,
        "online": device.online,
        "revoked": device.revoked_at is not None,
        "last_seen": device.last_seen.isoformat() if device.last_seen else None,
        "link": device.link_label,
    }
