"""Typed errors of the cache box, each with a message a person can act on."""


class CacheBoxError(Exception):
    """Base class of every cache-box error."""


class CacheBoxUnavailable(CacheBoxError):
    """The Redis/Valkey server could not be reached within the configured timeouts."""


class InvalidNamespace(CacheBoxError, ValueError):
    """A namespace name that cannot be used inside keys."""


class EntryError(CacheBoxError):
    """A stored entry is malformed, truncated, or does not match what was asked for."""


class CatalogFormatError(CacheBoxError, ValueError):
    """Serialized catalog bytes that cannot be loaded."""
