"""TLS to Redis/Valkey: ``rediss://`` URLs (``rediss+cluster://`` for a cluster) and the CA that
vouches for the server.

Every client of this package (the store, pub/sub, the cluster client) and of the control plane
(Celery's broker, Django's cache, the channel layer) takes its TLS options from here, so one
setting reaches all of them: ``EDGECACHE_REDIS_CA_CERT``, the CA bundle that signed the server's
certificate (empty: the system's CAs). The server's certificate is always verified and its name
checked against the URL's host; a plain ``redis://`` URL stays plain.
"""

from __future__ import annotations

import os
import ssl

TLS_SCHEMES = ("rediss", "valkeys", "rediss+cluster", "valkeys+cluster")


def is_tls_url(url: str) -> bool:
    return url.split("://", 1)[0].lower() in TLS_SCHEMES


def ca_file() -> str:
    """The CA bundle that signs the servers' certificates (``EDGECACHE_REDIS_CA_CERT``), "" for the system's."""
    return os.environ.get("EDGECACHE_REDIS_CA_CERT", "").strip()


def client_options(url: str) -> dict:
    """redis-py's TLS keyword arguments for ``url`` ({} for a plain one)."""
    if not is_tls_url(url):
        return {}
    options: dict = {"ssl_cert_reqs": "required", "ssl_check_hostname": True}
    if ca_file():
        options["ssl_ca_certs"] = ca_file()
    return options


def kombu_options(url: str) -> dict | None:
    """Celery's ``broker_use_ssl`` for a broker at ``url`` (None for a plain one)."""
    if not is_tls_url(url):
        return None
    options: dict = {"ssl_cert_reqs": ssl.CERT_REQUIRED}
    if ca_file():
        options["ssl_ca_certs"] = ca_file()
    return options
