"""The broker as a board uses it: Kombu's Redis transport without Lua scripts.

A board's Redis user may run no script (``cachebox.acl``: a script holds the whole server while
it runs). Kombu takes a lock while it puts back the messages a dead worker held, through
redis-py's ``Lock``, whose release is a script; ``without_scripts`` swaps in a lock made of plain
commands (SET NX EX to take it; WATCH, GET, MULTI/DEL to give it back only while it is ours).
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager

from kombu.transport import redis as kombu_redis
from redis import exceptions as redis_errors


@contextmanager
def script_free_mutex(client, name: str, expire: int):
    """Kombu's ``Mutex`` contract (raise ``MutexHeld`` when another holds it), with plain commands."""
    token = uuid.uuid4().hex.encode()
    if not client.set(name, token, nx=True, ex=max(1, int(expire))):
        raise kombu_redis.MutexHeld()
    try:
        yield
    finally:
        with client.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(name)
                if pipe.get(name) == token:
                    pipe.multi()
                    pipe.delete(name)
                    pipe.execute()
                else:
                    pipe.unwatch()
            except redis_errors.WatchError:
                pass  # it expired and someone else took it: theirs now


def without_scripts() -> None:
    """Make this process's Kombu Redis transport lock without scripts (a board process)."""
    kombu_redis.Mutex = script_free_mutex


def wait_in_queue(client, queue: str, timeout: float) -> bool | None:
    """Whether a message lands in (or already waits in) the broker list ``queue`` within ``timeout``
    seconds, leaving it there: BLMOVE from the list to its own end wakes the moment one lands and
    moves nothing. None when the server refuses BLMOVE (Redis before 6.2, or an ACL without it)."""
    try:
        return client.blmove(queue, queue, timeout, "RIGHT", "RIGHT") is not None
    except redis_errors.ResponseError:
        return None


# The task ids of a broker list's messages, newest first, read on the server: only the ids travel
# (each message carries its sealed request, up to tens of kB). Kombu's message is JSON whose body is
# base64 (no quotes inside), so the first "id" key is its headers' task id.
_TASK_IDS = """
local ids = {}
for _, raw in ipairs(redis.call('LRANGE', KEYS[1], -tonumber(ARGV[1]), -1)) do
  ids[#ids + 1] = string.match(raw, '"id"%s*:%s*"([^"]+)"') or ''
end
return {redis.call('LLEN', KEYS[1]), ids}
"""


def queued_task_ids(client, queue: str, window: int = 500) -> tuple[list[str], int]:
    """The task ids of the messages waiting in the broker list ``queue`` (at most the ``window``
    next to be taken), the next to be taken first, and how many wait in all. ``client``: the
    control plane's client of the broker (a script runs: not for a board's user)."""
    length, ids = client.eval(_TASK_IDS, 1, queue, max(1, int(window)))
    return [value.decode() if isinstance(value, bytes) else str(value) for value in reversed(ids)], int(length)
