"""Text the control plane's database keeps encrypted at rest: prompts, answers, schema sources.

A value is sealed with AES-256-GCM under a key derived (HKDF) from the control plane's master
secret (``EDGECACHE_SIGNING_SECRET``, kept in the secrets folder, never in the database), with a
random nonce each time, and stored as ``ec1:`` + base64. So a copy of the database (a backup, a
dump) shows none of them. A value stored before this existed (no prefix) is read as it is, and
the migration that introduced the fields seals every such row.

The fields cost one AES-GCM decryption per value read; lookups that compare text in SQL
(``icontains``, equality) cannot see through them, so callers filter sealed text in Python.
"""

from __future__ import annotations

import base64
import functools
import json
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.db import models

PREFIX = "ec1:"
_AAD = b"edgecache/database"


@functools.lru_cache(maxsize=4)
def _cipher(master: bytes) -> AESGCM:
    return AESGCM(HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"edgecache/database/v1").derive(master))


def _master() -> bytes:
    from django.conf import settings  # read at call time: the control plane's secret

    return settings.EDGECACHE_SIGNING_SECRET


def seal_text(plain: str, master: bytes | None = None) -> str:
    """``plain`` as it is stored: ``ec1:`` + base64(nonce + AES-256-GCM ciphertext)."""
    nonce = os.urandom(12)
    sealed = _cipher(master or _master()).encrypt(nonce, plain.encode("utf-8"), _AAD)
    return PREFIX + base64.b64encode(nonce + sealed).decode("ascii")


def is_sealed(stored) -> bool:
    return isinstance(stored, str) and stored.startswith(PREFIX)


def open_text(stored: str, master: bytes | None = None) -> str:
    """The text of a stored value (one stored before sealing existed is returned as it is)."""
    if not is_sealed(stored):
        return stored
    raw = base64.b64decode(stored[len(PREFIX) :])
    try:
        return _cipher(master or _master()).decrypt(raw[:12], raw[12:], _AAD).decode("utf-8")
    except (InvalidTag, ValueError) as exc:
        raise ValueError(
            "a value in the database was sealed under another master secret (EDGECACHE_SIGNING_SECRET): restore the secrets "
            "folder that belongs with this database"
        ) from exc


class SealedTextField(models.TextField):
    """A TextField stored sealed (``seal_text``); "" stays "" (nothing to hide, and ``error=""`` filters keep working)."""

    def get_prep_value(self, value):
        value = super().get_prep_value(value)
        if value is None or value == "" or is_sealed(value):
            return value
        return seal_text(value)

    def from_db_value(self, value, expression, connection):
        return value if value is None else open_text(value)


class SealedJSONField(models.JSONField):
    """A JSONField whose non-empty documents are stored as ``{"sealed": "ec1:..."}``."""

    def get_prep_value(self, value):
        if value and not (isinstance(value, dict) and set(value) == {"sealed"}):
            value = {"sealed": seal_text(json.dumps(value, separators=(",", ":"), cls=self.encoder))}
        return super().get_prep_value(value)

    def from_db_value(self, value, expression, connection):
        value = super().from_db_value(value, expression, connection)
        if isinstance(value, dict) and set(value) == {"sealed"} and is_sealed(value["sealed"]):
            return json.loads(open_text(value["sealed"]), cls=self.decoder)
        return value


# -- migrations: seal the rows written before, open them again when going back ------------------------
def _rows(schema_editor, table: str, column: str):
    quote = schema_editor.quote_name
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(f"SELECT {quote('id')}, {quote(column)} FROM {quote(table)}")
        return cursor.fetchall()


def _write(schema_editor, table: str, column: str, rows: list[tuple], *, is_json: bool) -> None:
    quote = schema_editor.quote_name
    value = "CAST(%s AS jsonb)" if is_json and schema_editor.connection.vendor == "postgresql" else "%s"
    with schema_editor.connection.cursor() as cursor:
        cursor.executemany(f"UPDATE {quote(table)} SET {quote(column)} = {value} WHERE {quote('id')} = %s", rows)
        if rows and schema_editor.connection.vendor == "postgresql":
            # Check the deferred foreign keys now: PostgreSQL refuses an ALTER TABLE of the same
            # migration (going back) while the updates' trigger events are pending.
            cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")
            cursor.execute("SET CONSTRAINTS ALL DEFERRED")


def seal_column(schema_editor, table: str, column: str, *, is_json: bool = False, master: bytes | None = None) -> int:
    """Seal every value of ``table.column`` stored in clear (a migration's forward step); returns how many."""
    changed = []
    for pk, stored in _rows(schema_editor, table, column):
        if is_json:
            document = json.loads(stored) if isinstance(stored, str) else stored
            if document and not (isinstance(document, dict) and set(document) == {"sealed"}):
                changed.append(
                    (json.dumps({"sealed": seal_text(json.dumps(document, separators=(",", ":")), master)}), pk)
                )
        elif stored and not is_sealed(stored):
            changed.append((seal_text(stored, master), pk))
    _write(schema_editor, table, column, changed, is_json=is_json)
    return len(changed)


def open_column(schema_editor, table: str, column: str, *, is_json: bool = False, master: bytes | None = None) -> int:
    """Store every sealed value of ``table.column`` in clear again (a migration's backward step)."""
    changed = []
    for pk, stored in _rows(schema_editor, table, column):
        if is_json:
            document = json.loads(stored) if isinstance(stored, str) else stored
            if isinstance(document, dict) and set(document) == {"sealed"} and is_sealed(document["sealed"]):
                changed.append((open_text(document["sealed"], master), pk))
        elif is_sealed(stored):
            changed.append((open_text(stored, master), pk))
    _write(schema_editor, table, column, changed, is_json=is_json)
    return len(changed)
