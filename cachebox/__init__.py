"""The cache box: keys, entries, the Bloom catalog and the Redis/Valkey store.

Pure modules (``keys``, ``entry``, ``catalog``) hold no I/O and test in
milliseconds; ``store``, ``sync`` and ``embedded`` are the thin adapters.
This package knows no model runtime and no UI (see the architecture notes).
"""
