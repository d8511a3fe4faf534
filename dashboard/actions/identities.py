"""Verbs on boards' Redis identities: one ACL user per enrolled board, one per pending enrollment.

The control plane holds the deployment's Redis password; every board reaches the broker and the
cache box as a user of its own (``cachebox.acl``), made when it enrolls, replaced when its token is
rotated and deleted (its connections closed) when it is revoked. ``apply_all_identities`` runs at
every start and after the cache box restarted: the database stays the truth.
"""

from __future__ import annotations

import functools
import logging

from django.conf import settings
from kombu import Exchange
from kombu import Queue as KombuQueue

from cachebox import acl
from cachebox.errors import CacheBoxError
from cachebox.store import CacheBox
from inference.contract.messages import Queue

from ..models import Device, token_usable
from ..outbox import app as celery_app
from .cache import cachebox_limits

log = logging.getLogger("dashboard.actions")

APPLIED_FLAG = "ec:control:identities-applied"  # set on every server once every user was applied


def servers() -> list[CacheBox]:
    """The servers a board talks to: the broker, and the cache box when it lives elsewhere (one
    client each per process: the sweeper asks every few seconds)."""
    urls = [settings.REDIS_URL]
    if settings.EDGECACHE_CACHEBOX_URL and settings.EDGECACHE_CACHEBOX_URL != settings.REDIS_URL:
        urls.append(settings.EDGECACHE_CACHEBOX_URL)
    return [client(url, settings.EDGECACHE_CONNECT_TIMEOUT, settings.EDGECACHE_IO_TIMEOUT) for url in urls]


@functools.lru_cache(maxsize=8)
def client(url: str, connect_timeout: float, timeout: float) -> CacheBox:
    return CacheBox(url, connect_timeout=connect_timeout, timeout=timeout)


def _enrolled(device: Device) -> bool:
    return device.revoked_at is None and bool(device.signing_public_key) and bool(device.redis_password_sha256)


def apply_identity(device: Device, *, stores: list[CacheBox] | None = None, save: bool = True) -> bool:
    """Make the Redis users of ``device`` what the database says: its board's user while it is
    enrolled and not revoked, its enrollment user while its token may enroll. False (logged) when a
    server could not be told (``apply_all_identities`` at the next start tells it)."""
    if not settings.EDGECACHE_BOARD_ACL:
        return True
    board, enrolling = acl.board_user(device.name), acl.enroll_user(device.name)
    try:
        for store in stores or servers():
            store.load_functions(cachebox_limits(store))  # what its user may write goes through them
            if _enrolled(device):
                store.set_user(
                    board, acl.board_rules(device.name, device.cache_namespace, device.redis_password_sha256)
                )
            else:
                store.delete_user(board)  # its connections close now
            if token_usable(device) and device.enroll_redis_sha256:
                store.set_user(enrolling, acl.enroll_rules(device.name, device.enroll_redis_sha256))
            else:
                store.delete_user(enrolling)
            if save:
                store.save_users()
    except CacheBoxError as exc:
        log.warning("the Redis users of device %s were not updated: %s", device.name, exc)
        return False
    if _enrolled(device):
        declare_queue(device)
    return True


def declare_queue(device: Device) -> None:
    """Declare the board's queue and its binding on the broker (a board may only read bindings:
    it puts a message it held back where the control plane bound it)."""

    name = Queue.device(device.name)
    try:
        with celery_app.connection_for_write(connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT) as connection:
            # One quick retry: kombu waits 2 s before it by default, and a staff edit or an
            # enrollment should not wait on a broker that is away (the first dispatch declares it).
            connection.ensure_connection(max_retries=1, interval_start=0.2, interval_step=0.2, interval_max=0.2)
            KombuQueue(name, Exchange(name), routing_key=name)(connection.default_channel).declare()
    except Exception as exc:  # the broker away: the first dispatch declares it too
        log.warning("queue %s not declared: %s", name, exc)


def _users_of(names) -> set[str]:
    return {user for name in names for user in (acl.board_user(name), acl.enroll_user(name))}


def apply_all_identities() -> int:
    """Every device's Redis users, and no board user the database does not know (a deleted
    device's is removed). Returns how many devices were applied."""
    if not settings.EDGECACHE_BOARD_ACL:
        return 0
    stores = servers()
    devices = list(Device.objects.select_related("namespace"))
    for device in devices:
        apply_identity(device, stores=stores, save=False)
    for store in stores:
        try:
            store.load_functions(cachebox_limits(store))
            listed = [
                user for user in store.users() if user.startswith((acl.BOARD_USER_PREFIX, acl.ENROLL_USER_PREFIX))
            ]
            # The names are read after the users: a device registered meanwhile (its row is committed
            # before its users are made) is known, and its new enrollment user is not deleted.
            known = _users_of(Device.objects.values_list("name", flat=True))
            for user in listed:
                if user not in known:
                    store.delete_user(user)
            store.save_users()
            store.set_flag(APPLIED_FLAG, 10 * 365 * 24 * 3600, b"1")
        except CacheBoxError as exc:
            log.warning("Redis users not reconciled on %s: %s", store.safe_url, exc)
    return len(devices)
