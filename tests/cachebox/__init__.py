"""Tests of the cache-box library: keys, entries, signing, the catalog, the store, links, TLS, a cluster."""
