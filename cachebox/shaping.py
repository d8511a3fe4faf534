"""Link emulation on the wire: a board's cache-box connections are paced in their socket
reads and writes so that one machine can stand for a fleet on Wi-Fi.

Every byte sent or received waits its turn on the link (bandwidth, both directions
share it, as on Wi-Fi), and the first reply byte after a request comes one round trip after the
request's last byte went (a caller that reads it later waits only what is left of that).
Nothing is added to a report afterwards: the time is spent where the bytes move.
"""

from __future__ import annotations

import socket
import threading
import time

import redis

from .link import LinkProfile


class LinkShaper:
    """The pacing of one link; shared by every connection of one board."""

    def __init__(self, profile: LinkProfile):
        self.profile = profile
        self._lock = threading.Lock()
        self._busy_until = 0.0

    def transmit(self, size_bytes: int) -> None:
        """Block until ``size_bytes`` have crossed the link, after what is already on it."""
        if size_bytes <= 0:
            return
        with self._lock:
            now = time.monotonic()
            start = max(now, self._busy_until)
            self._busy_until = start + size_bytes / self.profile.bytes_per_second
            wait = self._busy_until - now
        time.sleep(wait)

    def round_trip(self, sent_at: float | None = None) -> None:
        """Wait until the reply to a request sent at ``sent_at`` (``time.monotonic()``; None: now)
        has come back: one round trip after it was sent. A caller that did other work meanwhile
        (a publish whose answer is read later) waits only what is left of it."""
        if self.profile.rtt_ms > 0:
            left = self.profile.rtt_ms / 1000.0 - (0.0 if sent_at is None else time.monotonic() - sent_at)
            if left > 0:
                time.sleep(left)


class ShapedSocket:
    """A socket whose sends and receives are paced by a LinkShaper (everything else passes through)."""

    def __init__(self, sock: socket.socket, shaper: LinkShaper):
        self._sock = sock
        self._shaper = shaper
        self._awaiting_reply = False
        self._sent_at = 0.0  # when the last bytes of a request went on the link

    def sendall(self, data, *args):
        self._shaper.transmit(len(data))
        self._sock.sendall(data, *args)
        self._sent()

    def send(self, data, *args):
        sent = self._sock.send(data, *args)
        self._shaper.transmit(sent)
        self._sent()
        return sent

    def _sent(self) -> None:
        self._sent_at = time.monotonic()  # the request's last bytes so far: its reply is due a round trip later
        self._awaiting_reply = True

    def _before_reply(self, flags: int) -> bool:
        if flags & socket.MSG_PEEK:
            return False
        if self._awaiting_reply:
            self._awaiting_reply = False
            self._shaper.round_trip(self._sent_at)
        return True

    def recv(self, size, flags=0):
        paced = self._before_reply(flags)
        data = self._sock.recv(size, flags)
        if paced:
            self._shaper.transmit(len(data))
        return data

    def recv_into(self, buffer, size=0, flags=0):
        paced = self._before_reply(flags)
        count = self._sock.recv_into(buffer, size, flags)
        if paced:
            self._shaper.transmit(count)
        return count

    def __getattr__(self, name):
        return getattr(self._sock, name)


class ShapedConnection(redis.Connection):
    """A redis-py TCP connection whose socket is a ShapedSocket."""

    def __init__(self, *args, shaper: LinkShaper | None = None, **kwargs):
        self.shaper = shaper
        super().__init__(*args, **kwargs)

    def _connect(self):
        sock = super()._connect()
        return ShapedSocket(sock, self.shaper) if self.shaper else sock


class ShapedSSLConnection(redis.SSLConnection):
    """A redis-py TLS connection whose (wrapped) socket is a ShapedSocket: the link is paced
    below TLS, as the network would pace it."""

    def __init__(self, *args, shaper: LinkShaper | None = None, **kwargs):
        self.shaper = shaper
        super().__init__(*args, **kwargs)

    def _connect(self):
        sock = super()._connect()
        return ShapedSocket(sock, self.shaper) if self.shaper else sock
