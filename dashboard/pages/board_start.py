"""How an operator starts a board on another machine, as every page that says so shows it (the
token page, the Dashboard's empty state, the Run page's hints): the board's own install
(``make install-board``: ``pip install .``, the base dependencies only, into ``.venv-board``), its
entry point (``edgecache-board``), and the cache box's address as a board elsewhere reaches it.

The address is ``EDGECACHE_PUBLIC_REDIS_URL`` when set; otherwise ``REDIS_URL``, or, for the embedded
Valkey, its port on the first address of ``EDGECACHE_EMBEDDED_BIND`` other than loopback (the
machine's name when it listens on every address). Credentials never appear in it: a board logs in
as its own Redis user (``cachebox.acl``), and the deployment's password stays with the control
plane. Staff alone see the address (it is internal); settings are read at call time.
"""

from __future__ import annotations

import ipaddress
import shlex
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings

INSTALL = (
    "make install-board"  # in a checkout of EdgeCache on the board: .venv-board with `pip install .` (no control plane)
)
ENTRY_POINT = ".venv-board/bin/edgecache-board"  # what `make install-board` installs (`edgecache-board` in any venv with `pip install .`)
ANY_ADDRESS = ("0.0.0.0", "::", "*")


@dataclass(frozen=True)
class BoardAddress:
    """The cache box as a board reaches it (URLs without credentials)."""

    redis_url: str
    cachebox_url: str = ""  # the cache box's own server, when it is not REDIS_URL's
    source: str = "REDIS_URL"  # where the address comes from, in the operator's words
    local_only: bool = False  # a loopback address: only boards on this machine reach it

    def environment(self) -> str:
        """The variables the start command sets."""
        pairs = [("REDIS_URL", self.redis_url)] + (
            [("EDGECACHE_CACHEBOX_URL", self.cachebox_url)] if self.cachebox_url else []
        )
        return " ".join(f"{name}={shlex.quote(value)}" for name, value in pairs)


def without_credentials(url: str) -> str:
    """``url`` without a user name or password (a board brings its own)."""
    if not url:
        return ""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


def is_loopback(host: str) -> bool:
    if not host or host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _host_of(url: str) -> str:
    parts = urlsplit(url)
    return "" if parts.scheme == "unix" else (parts.hostname or "")


def _with_host(url: str, host: str) -> str:
    parts = urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    shown = f"[{host}]" if ":" in host else host
    return urlunsplit(parts._replace(netloc=shown + port))


def _embedded_host(bind: tuple[str, ...]) -> str:
    """Where boards on other hosts reach the embedded Valkey: its first address beside loopback."""
    for address in bind:
        if address in ANY_ADDRESS:
            return socket.getfqdn()
        if not is_loopback(address):
            return address
    return "127.0.0.1"


def board_address() -> BoardAddress:
    """The cache box's address for a board's start command, from the settings now."""
    cachebox = without_credentials(getattr(settings, "EDGECACHE_CACHEBOX_URL", "") or "")
    public = (getattr(settings, "EDGECACHE_PUBLIC_REDIS_URL", "") or "").strip()
    if public:
        url, source = without_credentials(public), "EDGECACHE_PUBLIC_REDIS_URL"
    elif settings.REDIS_URL_IS_EMBEDDED:
        url = _with_host(
            without_credentials(settings.REDIS_URL), _embedded_host(tuple(settings.EDGECACHE_EMBEDDED_BIND))
        )
        source = "the embedded Valkey"
    else:
        url, source = without_credentials(settings.REDIS_URL), "REDIS_URL"
    local = is_loopback(_host_of(url)) or (
        bool(cachebox) and "+cluster" not in cachebox and is_loopback(_host_of(cachebox))
    )
    return BoardAddress(redis_url=url, cachebox_url=cachebox, source=source, local_only=local)


def start_command(name: str, token: str | None = None, address: BoardAddress | None = None) -> str:
    """The shell command that starts board ``name`` where ``make install-board`` ran (``token``: its
    first start, which enrolls it). Without ``address``: the command a non-staff member may see
    (no address)."""
    return " ".join([command_prefix(address), _option("--name", name)] + ([_option("--token", token)] if token else []))


def command_prefix(address: BoardAddress | None = None) -> str:
    """What comes before ``--name``: the cache box's address (when given) and the entry point."""
    return f"{address.environment()} {ENTRY_POINT}" if address is not None else ENTRY_POINT


def _option(flag: str, value: str) -> str:
    """``--flag value``, or ``--flag=value`` for a value that begins with "-" (a token may: argparse
    would take ``--token -x…`` for an option without its value)."""
    return f"{flag}={shlex.quote(value)}" if value.startswith("-") else f"{flag} {shlex.quote(value)}"


def shown_to(user, name: str = "NAME", token: str | None = None) -> dict:
    """What a page shows ``user`` to start board ``name``: the install, the command (with the cache
    box's address for staff only) and where the address comes from."""
    address = board_address() if user.is_staff else None
    return {
        "install": INSTALL,
        "command": start_command(name, token, address),
        "prefix": command_prefix(address),
        "address": address,
    }
