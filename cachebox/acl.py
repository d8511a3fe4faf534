"""Redis/Valkey identities: one ACL user per board, confined to what that board does.

A board reaches the broker and the cache box as ``edgecache-board-NAME``, a user that may:

- take work from its own queue and its namespace's shared queue (``device.NAME``, ``boards.NS``),
  keeping its unacknowledged messages under keys of its own (``unacked.NAME``, ...; Kombu's
  ``unacked_key`` transport options), and read the bindings of those two queues only;
- push its reports onto its own inbox (``ec:inbox:NAME``, LPUSH only) and overwrite its own latest
  heartbeat (``ec:hb:NAME``, PSETEX only: always with a TTL); it cannot write the control plane's
  Celery queue (``control``), which only the control plane writes, so a board can never name a task there;
- read its cache namespace's entries and catalog (``ec:e:NS:*``, ``ec:m:NS:*``, ``ec:c:{NS}:*``)
  and write them through the cache box's ``edgecache`` functions (``FCALL``, ``cachebox.quota``),
  which check a value's size, give it a TTL and charge the namespace's budget (``ec:quota:NS:*``);
  Redis checks the commands a function runs with the caller's rights, so the user holds those
  commands too, in their TTL-carrying forms (PSETEX, never SET or PERSIST);
- read its own registry record, its tenant's producer table and its own runs' cancel flags, never
  write them;
- publish on its own runs' stream channels (``ec:stream:NAME:*``);
- run no other command: no admin, no scripts of its own (EVAL, FUNCTION LOAD: a Lua script could
  hold the whole server), no KEYS/SCAN, no FLUSH*, no CONFIG, no ACL.

Each group of commands is an ACL *selector* (``(...)``, Redis 7 / Valkey): a command is allowed
when one selector allows it on all the keys it names, so DEL reaches the board's own queue but
never ``control``. Passwords are set by their SHA-256 (``#...``): the password itself never
leaves the board. Before it enrolls, a board has a second user, ``edgecache-enroll-NAME``, that
may only read its record and push its enrollment onto its own enrollment inbox (``ec:enroll:NAME``);
its password comes from the token (``inference.board.identity.enrollment_redis_password``).

The rules are pure (``board_rules``, ``enroll_rules``); applying them goes through
``CacheBox.set_user`` (every node of a cluster).
"""

from __future__ import annotations

import re
from urllib.parse import quote

from .keys import enroll_inbox_key, heartbeat_key, inbox_key
from .quota import quota_key_pattern
from .signing import tenant_of

BOARD_USER_PREFIX = "edgecache-board-"
ENROLL_USER_PREFIX = "edgecache-enroll-"

# What every client sends when it connects (redis-py: HELLO/AUTH, CLIENT SETINFO; a cluster
# client asks for the slot map and the command table), none of which touches a key.
CONNECTION = [
    "+ping",
    "+echo",
    "+hello",
    "+auth",
    "+select",
    "+quit",
    "+reset",
    "+readonly",
    "+client|setinfo",
    "+client|setname",
    "+client|getname",
    "+client|id",
    "+cluster|slots",
    "+cluster|shards",
    "+cluster|nodes",
    "+cluster|myid",
    "+command",
    "+command|info",
    "+command|docs",
    "+command|count",
]
_TRANSACTIONS = "+watch +unwatch +multi +exec +discard"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,80}$")  # device and namespace names: no glob characters


def _checked(value: str) -> str:
    if not _SAFE_NAME.match(value):
        raise ValueError(f"{value!r} cannot appear in an ACL pattern")
    return value


def board_user(device: str) -> str:
    return BOARD_USER_PREFIX + _checked(device)


def enroll_user(device: str) -> str:
    return ENROLL_USER_PREFIX + _checked(device)


def _base(password_sha256: str) -> list[str]:
    if not re.fullmatch(r"[0-9a-f]{64}", password_sha256 or ""):
        raise ValueError("a password is set by its SHA-256 (64 hex characters)")
    return ["reset", "on", f"#{password_sha256}", "resetkeys", "resetchannels", "-@all", *CONNECTION]


def board_rules(device: str, cache_namespace: str, password_sha256: str) -> list[str]:
    """The ACL rules of a board's own user (``ACL SETUSER NAME <rules>``)."""
    name, ns = _checked(device), _checked(cache_namespace)
    return [
        *_base(password_sha256),
        # its own queue and its namespace's shared one (one BRPOP names both): take work and put
        # it back, never delete or overwrite a queue; BLMOVE from a queue to itself waits for work
        # and leaves it in place (inference.board.serve.work_arrives)
        f"(~device.{name} ~boards.{ns} +brpop +blmove +lpush +rpush +llen +exists)",
        # the bookkeeping of the messages it holds, and the lock it restores them under
        f"(~unacked.{name} ~unacked_index.{name} +zadd +zrem +zrange +zrevrangebyscore +zrangebyscore +hset +hget +hdel {_TRANSACTIONS})",
        f"(~unacked_mutex.{name} +set +get +del +expire {_TRANSACTIONS})",
        # where a message it puts back goes (the control plane declares these)
        f"(%R~_kombu.binding.device.{name} %R~_kombu.binding.boards.{ns} +smembers)",
        # its inbox and its latest heartbeat: keys that name it, so the key tells who sent a message
        f"(%W~{inbox_key(name)} +lpush)",
        f"(%W~{heartbeat_key(name)} +psetex)",  # a heartbeat always expires
        # its cache namespace: entries, prompt modules, catalog, read at will; written through the
        # cache box's edgecache functions (cachebox.quota: size cap, TTL, the namespace's budget),
        # which run the commands of the next selectors with this user's rights
        f"(~ec:e:{ns}:* ~ec:m:{ns}:* ~ec:c:{{{ns}}}:* ~{quota_key_pattern(ns)} "
        f"+fcall +get +getrange +strlen +exists +pttl +xrange +xlen +hgetall +hget +hstrlen {_TRANSACTIONS})",
        f"(~ec:e:{ns}:* ~ec:m:{ns}:* +psetex +pexpire +del)",  # an entry's write always carries a TTL (no SET, PERSIST, APPEND)
        f"(~ec:c:{{{ns}}}:* +psetex +pexpire +xadd +xtrim +hset +del)",
        f"(~{quota_key_pattern(ns)} +hset +hincrby +hdel +hexists +zadd +zrem +zrangebyscore +pexpire)",
        "+time",
        f"(%R~ec:device:{name} %R~ec:cancel:{name}:* +get +exists)",
        f"(%R~ec:producers:{_checked(tenant_of(cache_namespace))} +get)",
        f"(&ec:stream:{name}:* +publish)",
    ]


def enroll_rules(device: str, password_sha256: str) -> list[str]:
    """The ACL rules of a device's enrollment user: read its record and why an enrollment was refused,
    send its enrollment (to its own enrollment inbox: it can reach no queue and no other device's inbox)."""
    name = _checked(device)
    return [
        *_base(password_sha256),
        f"(%R~ec:device:{name} %R~ec:enroll-refused:{name}:* +get +exists)",
        f"(%W~{enroll_inbox_key(name)} +lpush)",
    ]


def board_transport_options(device: str, cache_namespace: str) -> dict:
    """Kombu transport options for a board: its unacknowledged messages under keys of its own, and
    one queue name per queue (no priority lists), which its ACL names exactly."""
    name = _checked(device)
    return {
        "unacked_key": f"unacked.{name}",
        "unacked_index_key": f"unacked_index.{name}",
        "unacked_mutex_key": f"unacked_mutex.{name}",
        "priority_steps": [0],
    }


def with_credentials(url: str, username: str, password: str) -> str:
    """``url`` (a server's or a cluster's) reached as ``username``/``password``, replacing any
    credentials it carried: a board never uses the deployment's password."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"not a Redis URL: {url.split('@')[-1]!r}")
    if scheme == "unix":
        raise ValueError("a board reaches the broker over TCP, not a unix socket")
    host_part = rest.rpartition("@")[2]
    return f"{scheme}://{quote(username, safe='')}:{quote(password, safe='')}@{host_part}"


def has_credentials(url: str) -> bool:
    return "@" in url.partition("://")[2].split("/", 1)[0] or "@" in url.partition("://")[2].split(",", 1)[0]
