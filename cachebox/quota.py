"""What a writer may put in the cache box: a server-side function library (pure: its source).

Every write of an entry or of a namespace's catalog goes through one of the functions of the
``edgecache`` library (``FCALL``), which the control plane loads on every server with
``FUNCTION LOAD REPLACE`` (``CacheBox.load_functions``) when it applies the boards' users. A
function, atomically on the server:

- refuses a value over its cap (``max_value``: an entry; ``max_snapshot``: a catalog snapshot),
- gives what it writes a TTL of at most ``max_ttl`` seconds (an entry with none is refused),
- charges the bytes to the namespace's budget (``quota``; ``overhead`` more per key, for the key
  and the book-keeping) and refuses a write that would take it over; an overwrite is charged the
  difference.

The budget is kept in a ledger per namespace (``ec:quota:NS:{k}``: a hash of key -> charged
bytes plus the ``total``, and ``...:exp``, a sorted set of key -> expiry in ms). Each call first
credits back up to 64 keys whose expiry has passed and that are gone (expired or evicted; a key
whose TTL was renewed or removed is re-scored, still charged), so the budget recovers as entries
expire, without any sweeper. The ledger itself expires ``max_ttl`` + 60 s after the namespace's
last write: by then every key it charges has expired. An entry evicted before its expiry stays
charged until its expiry (the budget errs on the safe side).

On a cluster each node keeps its own ledger (the first ``{k}`` whose slot that node serves; the
functions are flagged ``allow-cross-slot-keys``), so a namespace holds at most ``quota`` on each
node. Every key a function is given or finds is still checked against the caller's ACL (Redis and
Valkey check each command a script runs with the caller's rights): a board's user needs the
commands the functions run on its own namespace's keys and ledger, so these functions are the
path every EdgeCache writer takes, not a wall against a board that sends the same commands itself
(docs/operations.md, "What one board can do to memory").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Bumped whenever what a function takes or does changes: its functions then have new names, so a
# server that still holds an older library (loaded by an older control plane) is not called with
# arguments it reads otherwise; the new library is loaded beside it.
VERSION = 1
LIBRARY = f"edgecache_v{VERSION}"
QUOTA_PREFIX = "ec:quota:"
QUOTA_ERROR = "EC_QUOTA"
TOO_LARGE_ERROR = "EC_TOO_LARGE"
TTL_ERROR = "EC_TTL"
# The functions and the keys each is given (all of one hash slot).
PUT = f"ec_put_v{VERSION}"  # KEYS: entry; ARGV: value, ttl seconds (or "max": the longest allowed)
TOUCH = f"ec_touch_v{VERSION}"  # KEYS: entry; ARGV: ttl seconds (or "max")
DELETE = f"ec_del_v{VERSION}"  # KEYS: entry
CATALOG_EPOCH = f"ec_cat_epoch_v{VERSION}"  # KEYS: epoch; ARGV: the epoch to create when there is none
CATALOG_APPEND = f"ec_cat_append_v{VERSION}"  # KEYS: log; ARGV: 16-byte keys
CATALOG_SNAPSHOT = f"ec_cat_snapshot_v{VERSION}"  # KEYS: snapshot, epoch, log; ARGV: bloom, last id, epoch
CATALOG_DROP = f"ec_cat_drop_v{VERSION}"  # KEYS: snapshot
FUNCTIONS = (PUT, TOUCH, DELETE, CATALOG_EPOCH, CATALOG_APPEND, CATALOG_SNAPSHOT, CATALOG_DROP)


@dataclass(frozen=True)
class Limits:
    """What one namespace may hold (bytes, seconds); the control plane's settings."""

    max_value: int = 64 * 1024 * 1024
    max_ttl: int = 7 * 24 * 3600
    quota: int = 256 * 1024 * 1024
    overhead: int = 256
    max_snapshot: int = 16 * 1024 * 1024
    log_maxlen: int = 200_000

    def __post_init__(self):
        for field in ("max_value", "max_ttl", "quota", "overhead", "max_snapshot", "log_maxlen"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"cache box limit {field} must be a positive whole number, got {value!r}")


DEFAULT_QUOTA = 256 * 1024 * 1024


def default_quota(maxmemory: int) -> int:
    """A namespace's budget when none is configured: a quarter of the server's (or each cluster
    node's) ``maxmemory``, so that a few namespaces, the clients' buffers (an eighth) and the queues
    fit; 256 MB on a server with no ``maxmemory``."""
    return maxmemory // 4 if maxmemory > 0 else DEFAULT_QUOTA


def quota_key_pattern(namespace: str) -> str:
    """ACL pattern of a namespace's ledgers (every ``{k}``, and their expiry sets)."""
    return f"{QUOTA_PREFIX}{namespace}:*"


def library_source(limits: Limits) -> str:
    """The Lua source of the ``edgecache`` library with ``limits`` written in (boards cannot read it:
    FUNCTION LIST and DUMP are not theirs)."""
    values = {
        "@LIBRARY@": LIBRARY,
        "@V@": str(VERSION),
        "@MAX_VALUE@": str(limits.max_value),
        "@MAX_TTL_MS@": str(limits.max_ttl * 1000),
        "@QUOTA@": str(limits.quota),
        "@OVERHEAD@": str(limits.overhead),
        "@MAX_SNAPSHOT@": str(limits.max_snapshot),
        "@LOG_MAXLEN@": str(limits.log_maxlen),
    }
    return re.sub(r"@[A-Z_]+@", lambda found: values[found.group(0)], _SOURCE)


_ERROR = re.compile(r"(EC_[A-Z_]+) (.*)", re.S)


def refusal(message: str) -> tuple[str, str] | None:
    """(code, reason) when ``message`` (a server error) is one of the library's refusals, else None."""
    found = _ERROR.search(message or "")
    return (found.group(1), found.group(2).strip()) if found else None


_SOURCE = r"""#!lua name=@LIBRARY@
-- EdgeCache's writes to the cache box (cachebox/quota.py); loaded by the control plane.
local MAX_VALUE = @MAX_VALUE@
local MAX_TTL_MS = @MAX_TTL_MS@
local QUOTA = @QUOTA@
local OVERHEAD = @OVERHEAD@
local MAX_SNAPSHOT = @MAX_SNAPSHOT@
local LOG_MAXLEN = @LOG_MAXLEN@
local KEEP_MS = MAX_TTL_MS + 60000
local PRUNE = 64

local function refuse(code, reason) return redis.error_reply(code .. ' ' .. reason) end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function entry_namespace(name)
  return string.match(name, '^ec:[em]:([A-Za-z0-9_.-]+):')
end

local function catalog_namespace(name)
  return string.match(name, '^ec:c:{([A-Za-z0-9_.-]+)}:')
end

-- The namespace's ledger on this node: the first {k} this node serves (k = 0 on one server).
local function ledger(ns)
  for k = 0, 1023 do
    local book = 'ec:quota:' .. ns .. ':{' .. k .. '}'
    local reply = redis.pcall('EXISTS', book)
    if type(reply) ~= 'table' or reply.err == nil then return book end
    if not string.find(reply.err, 'non local', 1, true) and not string.find(reply.err, 'CROSSSLOT', 1, true) then
      error(reply.err)
    end
  end
  error('EC_LEDGER no ledger of namespace ' .. ns .. ' can live on this node')
end

local function charged(book, name)
  return tonumber(redis.call('HGET', book, name) or '0') or 0
end

local function credit(book, name)
  local bytes = charged(book, name)
  redis.call('HDEL', book, name)
  redis.call('ZREM', book .. ':exp', name)
  if bytes ~= 0 then redis.call('HINCRBY', book, 'total', -bytes) end
end

-- Credit what expired (or was evicted) since; keys still there are re-scored, still charged.
local function prune(book, now)
  local due = redis.call('ZRANGEBYSCORE', book .. ':exp', '-inf', now, 'LIMIT', 0, PRUNE)
  for _, name in ipairs(due) do
    local left = redis.call('PTTL', name)
    if left == -2 then
      credit(book, name)
    else
      redis.call('ZADD', book .. ':exp', now + ((left > 0) and left or MAX_TTL_MS), name)
    end
  end
end

local function keep(book)
  redis.call('PEXPIRE', book, KEEP_MS)
  redis.call('PEXPIRE', book .. ':exp', KEEP_MS)
end

-- Charge `bytes` for `name` (replacing what it was charged); false and the reason when over budget.
local function charge(book, name, bytes, expires)
  local before = charged(book, name)
  local total = tonumber(redis.call('HGET', book, 'total') or '0') or 0
  if total - before + bytes > QUOTA then
    return false, 'namespace ' .. string.match(book, '^ec:quota:([^:]+)') .. ' holds ' .. total .. ' of its ' .. QUOTA ..
      ' bytes and this write needs ' .. (bytes - before) .. ' more: it was refused (nothing written). Entries free their ' ..
      'bytes as they expire; the operator can raise EDGECACHE_NAMESPACE_QUOTA'
  end
  redis.call('HSET', book, name, bytes)
  if bytes ~= before then redis.call('HINCRBY', book, 'total', bytes - before) end
  redis.call('ZADD', book .. ':exp', expires, name)
  keep(book)
  return true
end

local function ttl_ms(raw)
  if raw == 'max' then return MAX_TTL_MS end  -- the writer asks for the longest TTL allowed
  local ttl = tonumber(raw)
  if not ttl or ttl ~= math.floor(ttl) or ttl < 1 or ttl * 1000 > MAX_TTL_MS then return nil end
  return ttl * 1000
end

local function put(keys, args)
  local name, value = keys[1], args[1]
  local ns = entry_namespace(name or '')
  if not ns or not value then return refuse('EC_KEY', 'ec_put_v@V@ takes one entry key (ec:e:NS:... or ec:m:NS:...) and its value') end
  if #value > MAX_VALUE then
    return refuse('EC_TOO_LARGE', 'the entry is ' .. #value .. ' bytes, over the cache box cap of ' .. MAX_VALUE ..
      ' (EDGECACHE_MAX_ENTRY_BYTES)')
  end
  local ms = ttl_ms(args[2])
  if not ms then
    return refuse('EC_TTL', 'an entry needs a TTL of 1 to ' .. (MAX_TTL_MS / 1000) .. ' seconds (EDGECACHE_MAX_ENTRY_TTL), got ' ..
      tostring(args[2]))
  end
  local book = ledger(ns)
  local now = now_ms()
  prune(book, now)
  local ok, reason = charge(book, name, #value + #name + OVERHEAD, now + ms)
  if not ok then return refuse('EC_QUOTA', reason) end
  redis.call('PSETEX', name, ms, value)
  return #value
end

local function touch(keys, args)
  local name = keys[1]
  local ns = entry_namespace(name or '')
  local ms = ttl_ms(args[1])
  if not ns then return refuse('EC_KEY', 'ec_touch_v@V@ takes one entry key') end
  if not ms then return refuse('EC_TTL', 'a TTL of 1 to ' .. (MAX_TTL_MS / 1000) .. ' seconds, got ' .. tostring(args[1])) end
  if redis.call('PTTL', name) < 0 then return 0 end  -- missing, or pinned (no TTL): left as it is
  redis.call('PEXPIRE', name, ms)
  local book = ledger(ns)
  if redis.call('HEXISTS', book, name) == 1 then
    redis.call('ZADD', book .. ':exp', now_ms() + ms, name)
    keep(book)
  end
  return 1
end

local function delete(keys)
  local name = keys[1]
  local ns = entry_namespace(name or '')
  if not ns then return refuse('EC_KEY', 'ec_del_v@V@ takes one entry key') end
  local removed = redis.call('DEL', name)
  local book = ledger(ns)
  if redis.call('HEXISTS', book, name) == 1 then credit(book, name) end
  return removed
end

local function catalog_epoch(keys, args)
  local name, new = keys[1], args[1]
  if not catalog_namespace(name or '') or not new or #new == 0 or #new > 64 then
    return refuse('EC_KEY', 'ec_cat_epoch_v@V@ takes a catalog epoch key and an epoch of 1-64 bytes')
  end
  local current = redis.call('GET', name)
  if not current then
    redis.call('PSETEX', name, KEEP_MS, new)
    return new
  end
  if redis.call('PTTL', name) > 0 then redis.call('PEXPIRE', name, KEEP_MS) end
  return current
end

local function catalog_append(keys, args)
  local name = keys[1]
  if not catalog_namespace(name or '') then return refuse('EC_KEY', 'ec_cat_append_v@V@ takes a catalog log key') end
  for _, key in ipairs(args) do
    if #key ~= 16 then return refuse('EC_TOO_LARGE', 'a catalog record is one 16-byte entry key, got ' .. #key .. ' bytes') end
  end
  for _, key in ipairs(args) do
    redis.call('XADD', name, 'MAXLEN', '~', LOG_MAXLEN, '*', 'k', key)
  end
  if redis.call('PTTL', name) ~= -1 then redis.call('PEXPIRE', name, KEEP_MS) end
  return #args
end

local function stream_after(a, b)
  local am, as = string.match(a, '^(%d+)-?(%d*)$')
  local bm, bs = string.match(b, '^(%d+)-?(%d*)$')
  if not am or not bm then return false end
  am, bm = tonumber(am), tonumber(bm)
  if am ~= bm then return am > bm end
  return (tonumber(as) or 0) > (tonumber(bs) or 0)
end

local function catalog_snapshot(keys, args)
  local snap, epoch_key, log_key = keys[1], keys[2], keys[3]
  local bloom, last_id, epoch = args[1], args[2], args[3]
  local ns = catalog_namespace(snap or '')
  if not ns or not bloom or not last_id or not epoch then
    return refuse('EC_KEY', 'ec_cat_snapshot_v@V@ takes the snapshot, epoch and log keys, and the filter, last id and epoch')
  end
  if #bloom > MAX_SNAPSHOT then
    return refuse('EC_TOO_LARGE', 'the catalog snapshot is ' .. #bloom .. ' bytes, over the cap of ' .. MAX_SNAPSHOT ..
      ' (EDGECACHE_CATALOG_CAPACITY)')
  end
  local current = redis.call('HGET', snap, 'last_id') or '0'
  local live = redis.call('GET', epoch_key) or ''
  if live ~= epoch or not stream_after(last_id, current) then return 0 end
  local book = ledger(ns)
  local now = now_ms()
  prune(book, now)
  local ok, reason = charge(book, snap, #bloom + #snap + OVERHEAD, now + KEEP_MS)
  if not ok then return refuse('EC_QUOTA', reason) end
  redis.call('HSET', snap, 'bloom', bloom, 'last_id', last_id, 'epoch', epoch)
  redis.call('PEXPIRE', snap, KEEP_MS)
  redis.call('XTRIM', log_key, 'MINID', last_id)
  return 1
end

local function catalog_drop(keys)
  local snap = keys[1]
  local ns = catalog_namespace(snap or '')
  if not ns then return refuse('EC_KEY', 'ec_cat_drop_v@V@ takes a catalog snapshot key') end
  local removed = redis.call('DEL', snap)
  local book = ledger(ns)
  if redis.call('HEXISTS', book, snap) == 1 then credit(book, snap) end
  return removed
end

local cross = {'allow-cross-slot-keys'}
redis.register_function{function_name='ec_put_v@V@', callback=put, flags=cross}
redis.register_function{function_name='ec_touch_v@V@', callback=touch, flags=cross}
redis.register_function{function_name='ec_del_v@V@', callback=delete, flags=cross}
redis.register_function{function_name='ec_cat_epoch_v@V@', callback=catalog_epoch, flags=cross}
redis.register_function{function_name='ec_cat_append_v@V@', callback=catalog_append, flags=cross}
redis.register_function{function_name='ec_cat_snapshot_v@V@', callback=catalog_snapshot, flags=cross}
redis.register_function{function_name='ec_cat_drop_v@V@', callback=catalog_drop, flags=cross}
"""
