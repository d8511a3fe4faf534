"""Typed errors of the cache box, each with a message a person can act on."""


class CacheBoxError(Exception):
    """Base class of every cache-box error."""


class CacheBoxUnavailable(CacheBoxError):
    """The Redis/Valkey server could not be reached within the configured timeouts (or, as
    CacheBoxRefused, answered with an error): either way the caller goes on without it."""


class CacheBoxRefused(CacheBoxUnavailable):
    """The server answered with an error such as OOM (at maxmemory) or WRONGTYPE."""


class InvalidNamespace(CacheBoxError, ValueError):
    """A namespace name that cannot be used inside keys."""


class EntryError(CacheBoxError):
    """A stored entry is malformed, truncated, or does not match what was asked for."""


class CatalogFormatError(CacheBoxError, ValueError):
    """Serialized catalog bytes that cannot be loaded."""
