"""Every change of state of the control plane goes through one function here, named for what it
does (Zulip's ``do_...`` style), grouped by domain: ``devices`` (and namespaces), ``cache``,
``runs``, ``schemas``, ``api_keys``; ``audit`` holds the audit trail and its actions. Each verb changes the
database inside a transaction and tells the open pages once it commits. Receivers of board
reports validate them against the message contract (``inference.contract.messages``) first.
"""

from .audit import AuditAction, audit
from .cache import cachebox, cachebox_url, evict_entries, flush_entries, pin_entries, start_cachebox, stop_cachebox
from .devices import (
    authenticate_board,
    device_json,
    enroll_device,
    publish_all_devices,
    publish_device,
    record_heartbeat,
    register_device,
    revoke_device,
    rotate_signing_key,
    rotate_token,
    save_namespace,
    update_device,
)
from .entry_audits import clear_quarantine, quarantine_producer, record_audit
from .runs import dispatch_run, record_run, route_run, run_json, run_request
from .schemas import delete_schema, dispatch_encode, record_encode_progress, record_encoded, save_schema

__all__ = [
    "AuditAction",
    "clear_quarantine",
    "quarantine_producer",
    "record_audit",
    "audit",
    "authenticate_board",
    "cachebox",
    "cachebox_url",
    "start_cachebox",
    "stop_cachebox",
    "delete_schema",
    "device_json",
    "dispatch_encode",
    "dispatch_run",
    "enroll_device",
    "evict_entries",
    "flush_entries",
    "pin_entries",
    "publish_all_devices",
    "publish_device",
    "record_encode_progress",
    "record_encoded",
    "record_heartbeat",
    "record_run",
    "route_run",
    "register_device",
    "revoke_device",
    "rotate_signing_key",
    "rotate_token",
    "run_json",
    "run_request",
    "save_namespace",
    "save_schema",
    "update_device",
]
