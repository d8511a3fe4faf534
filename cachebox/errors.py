"""Typed errors of the cache box, each with a message a person can act on."""


class CacheBoxError(Exception):
    """Base class of every cache-box error."""


class CacheBoxUnavailable(CacheBoxError):
    """The Redis/Valkey server could not be reached within the configured timeouts (or, as
    CacheBoxRefused, answered with an error): either way the caller goes on without it."""


class CacheBoxRefused(CacheBoxUnavailable):
    """The server answered with an error such as OOM (at maxmemory) or WRONGTYPE."""


class CacheBoxOverQuota(CacheBoxRefused):
    """The cache box's EdgeCache functions refused a write (``cachebox.quota``): over the
    namespace's budget (``EC_QUOTA``), over the size cap (``EC_TOO_LARGE``) or without a TTL in
    bounds (``EC_TTL``). Nothing of that write was stored."""

    def __init__(self, message: str, code: str = ""):
        super().__init__(message)
        self.code = code


class InvalidNamespace(CacheBoxError, ValueError):
    """A namespace name that cannot be used inside keys."""


class EntryError(CacheBoxError):
    """A stored entry is malformed, truncated, or does not match what was asked for."""


class CatalogFormatError(CacheBoxError, ValueError):
    """Serialized catalog bytes that cannot be loaded."""
