"""Django settings for EdgeCache.

Everything has an embedded default so that `make run` works on a fresh machine:
SQLite and an embedded Valkey server under ``.edgecache/``. Real deployments set
``DATABASE_URL`` (PostgreSQL) and ``REDIS_URL``. Nothing secret lives in the repo.
"""

import os
import secrets
import stat
import tempfile
from datetime import timedelta
from pathlib import Path

import dj_database_url

from cachebox.cluster import is_cluster_url, parse_cluster_url
from cachebox.embedded import url_for
from cachebox.tls import client_options as tls_options
from inference.board.app import celery_settings
from inference.board.config import BoardConfig, edgecache_home, move_legacy_secret, secrets_home

BASE_DIR = Path(__file__).resolve().parent.parent
EDGECACHE_HOME = edgecache_home()
# Secrets apart from the state: a backup or copy of EDGECACHE_HOME (database, cache box files)
# opens nothing. Keep them in a secret store or another backup than the state's.
EDGECACHE_SECRETS_DIR = secrets_home()


def _private_dir(folder: Path) -> None:
    """The folder of the secrets and the database: only its owner may list or enter it (0700)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    if stat.S_IMODE(folder.stat().st_mode) & 0o077:
        folder.chmod(0o700)


_private_dir(EDGECACHE_HOME)
_private_dir(EDGECACHE_SECRETS_DIR)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError as exc:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from exc


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError as exc:
        raise ValueError(f"{name} must be a number, got {raw!r}") from exc


def _env_bool(name: str, default: bool = False) -> bool:
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name} must be 1 or 0 (true/false, yes/no, on/off), got {raw!r}")


def _read_secret(key_file: Path) -> str:
    value = key_file.read_text().strip()
    if not value:
        raise ValueError(
            f"{key_file} is empty (left by an interrupted start of an older version): delete it and start again, "
            "a new secret is generated"
        )
    return value


def _secret(env: str, file_name: str) -> str:
    """A secret from the environment, else one generated once into the secrets folder (mode 0600;
    an older version's, found in the state folder, is moved there).

    Processes that start together race to create it: each writes a complete secret to a
    temporary file of its own and links it into place, which fails if another one got there
    first (then that one is read). The file appears whole or not at all: a reader never sees
    it empty or half-written.
    """
    if os.environ.get(env):
        return os.environ[env]
    key_file = EDGECACHE_SECRETS_DIR / file_name
    move_legacy_secret(EDGECACHE_HOME / file_name, key_file)
    if not key_file.exists():
        fd, temporary = tempfile.mkstemp(dir=EDGECACHE_SECRETS_DIR, prefix=f".{file_name}.")  # mode 0600
        try:
            with os.fdopen(fd, "w") as out:
                out.write(secrets.token_urlsafe(50))
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(temporary, key_file)
            except FileExistsError:
                pass  # another process created it first: use theirs
        finally:
            os.unlink(temporary)
    return _read_secret(key_file)


SECRET_KEY = _secret("DJANGO_SECRET_KEY", "secret_key")
# Master secret of the cache-entry signing keys (one derived key per namespace and generation).
EDGECACHE_SIGNING_SECRET = _secret("EDGECACHE_SIGNING_SECRET", "signing_secret").encode()
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "axes",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "dashboard.middleware.AsyncWhiteNoiseMiddleware",  # WhiteNoise without a thread hop per request
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "axes.middleware.AxesMiddleware",  # last: turns a lockout into the page that says when to retry
]

ROOT_URLCONF = "dashboard.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "dashboard.pages.context.chart_stack",
            ],
        },
    },
]
WSGI_APPLICATION = None
ASGI_APPLICATION = "dashboard.asgi.application"

_SQLITE_DEFAULT = EDGECACHE_HOME / "db.sqlite3"
DATABASES = {"default": dj_database_url.config(default=f"sqlite:///{_SQLITE_DEFAULT}", conn_max_age=60)}
if Path(str(DATABASES["default"].get("NAME", ""))) == _SQLITE_DEFAULT:
    # The database holds password hashes and sessions: created 0600 before SQLite opens it (SQLite
    # then gives its journal files the same mode), and an older, more open one is closed down.
    os.close(os.open(_SQLITE_DEFAULT, os.O_CREAT | os.O_RDWR, 0o600))  # an empty file is an empty database
    if stat.S_IMODE(_SQLITE_DEFAULT.stat().st_mode) & 0o077:
        _SQLITE_DEFAULT.chmod(0o600)
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # The web server and the control-plane worker write at once: wait for the lock. Transactions
    # take the write lock when they begin (IMMEDIATE): a deferred one that reads, then writes,
    # fails at once with "database is locked" when another writer holds it, timeout or not.
    # Write-ahead logging: readers (an API request's key and routing) never wait for a writer (the
    # worker recording a run), and a writer never waits for readers. synchronous=NORMAL, as SQLite
    # advises with WAL: a commit no longer waits for an fsync (0.2 ms here, on every API dispatch);
    # the database stays consistent on a crash, and a power cut may lose the last commits only.
    DATABASES["default"].setdefault("OPTIONS", {}).update(
        {
            "timeout": 20,
            "transaction_mode": "IMMEDIATE",
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    )
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# --- Logins: throttled per username and address (django-axes) ---------------------------------
# Axes first: it refuses a locked-out (username, address) before any password is checked.
AUTHENTICATION_BACKENDS = ["axes.backends.AxesStandaloneBackend", "django.contrib.auth.backends.ModelBackend"]
AXES_FAILURE_LIMIT = _env_int("EDGECACHE_LOGIN_FAILURES", 5)
if AXES_FAILURE_LIMIT < 1:
    raise ValueError(f"EDGECACHE_LOGIN_FAILURES must be at least 1, got {AXES_FAILURE_LIMIT}")
AXES_COOLOFF_TIME = timedelta(minutes=_env_float("EDGECACHE_LOGIN_COOLOFF_MINUTES", 15))
if AXES_COOLOFF_TIME <= timedelta(0):
    raise ValueError(
        "EDGECACHE_LOGIN_COOLOFF_MINUTES must be positive (a lockout that never ends needs an admin for every typo)"
    )
# The combination: a guesser at one address cannot lock a user out everywhere, nor one user
# lock out everyone behind the same address.
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_LOCKOUT_CALLABLE = "dashboard.views.login_locked_out"

LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"
SESSION_COOKIE_HTTPONLY = True
# Sessions are stored under a keyed digest of their cookie, never the cookie itself: a copy of the
# database replays no login (dashboard.security.sessions).
SESSION_ENGINE = "dashboard.security.sessions"
CSRF_COOKIE_SAMESITE = "Lax"
X_FRAME_OPTIONS = "DENY"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
FORMAT_MODULE_PATH = ["dashboard.formats"]  # one date format on every page: Y-m-d H:i
USE_TZ = True

# --- HTTPS: off for `make run` (plain HTTP on localhost); set EDGECACHE_HTTPS=1 where the
# dashboard is served over TLS (the web server behind a TLS proxy, see README). -----------------------
EDGECACHE_HTTPS = _env_bool("EDGECACHE_HTTPS")
EDGECACHE_BEHIND_PROXY = _env_bool("EDGECACHE_BEHIND_PROXY")
if EDGECACHE_HTTPS:
    SECURE_SSL_REDIRECT = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True
    # Browsers refuse plain HTTP to this host for this long once they saw HTTPS (set it low while trying).
    SECURE_HSTS_SECONDS = _env_int("EDGECACHE_HSTS_SECONDS", 31_536_000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = _env_bool("EDGECACHE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = _env_bool("EDGECACHE_HSTS_PRELOAD")  # a commitment to browsers' lists: opt in
if EDGECACHE_BEHIND_PROXY:
    # The TLS proxy says which scheme the browser used; without this every request looks like
    # plain HTTP and SECURE_SSL_REDIRECT would loop. Only behind a proxy that sets (overwrites) it.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = EDGECACHE_HOME / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)
WHITENOISE_USE_FINDERS = True  # serve straight from static/ and the apps: no collectstatic step to forget

# --- The cache box, broker and channel layer: one Redis/Valkey server unless the cache box has its own. ---
EDGECACHE_BOARD = BoardConfig.from_env()
EDGECACHE_EMBEDDED_DIR = EDGECACHE_BOARD.embedded_dir
EDGECACHE_EMBEDDED_PORT = EDGECACHE_BOARD.embedded_port
EDGECACHE_EMBEDDED_MAXMEMORY = EDGECACHE_BOARD.embedded_maxmemory
REDIS_URL_IS_EMBEDDED = EDGECACHE_BOARD.uses_embedded_cachebox
# The embedded Valkey's password for its ``default`` user: the control plane's alone (boards get
# users of their own, see cachebox.acl). Kept with the other secrets.
EDGECACHE_EMBEDDED_PASSWORD = (
    _secret("EDGECACHE_EMBEDDED_PASSWORD", "cachebox_password") if REDIS_URL_IS_EMBEDDED else ""
)
# Addresses the embedded Valkey listens on besides loopback (boards on other hosts reach it at one of them).
EDGECACHE_EMBEDDED_BIND = EDGECACHE_BOARD.embedded_bind
REDIS_URL = EDGECACHE_BOARD.redis_url or url_for(
    EDGECACHE_EMBEDDED_DIR, EDGECACHE_EMBEDDED_PORT, EDGECACHE_EMBEDDED_PASSWORD
)
if REDIS_URL_IS_EMBEDDED:  # commands that run a board next to the control plane reach it as the control plane
    EDGECACHE_BOARD = EDGECACHE_BOARD.with_(redis_url=REDIS_URL)
if is_cluster_url(REDIS_URL):
    raise ValueError(
        "REDIS_URL is the Celery broker's and the channel layer's, which need one plain Redis/Valkey server; "
        "put a cluster in EDGECACHE_CACHEBOX_URL (the cache box alone may be a cluster)"
    )
# The cache box alone may live elsewhere, e.g. on a Redis/Valkey Cluster
# (redis+cluster://host:port[,host:port...]); empty: REDIS_URL's server holds it too (read at call
# time by dashboard.actions.cache.cachebox_url). Boards read the same variable.
EDGECACHE_CACHEBOX_URL = EDGECACHE_BOARD.cachebox_url
if is_cluster_url(EDGECACHE_CACHEBOX_URL):
    parse_cluster_url(EDGECACHE_CACHEBOX_URL)  # a malformed one stops here, with the reason
# The cache box's address as a board on another machine reaches it, for the start command the pages
# show staff (dashboard/pages/board_start.py); credentials in it are dropped (a board logs in as its own
# user). Empty: derived from REDIS_URL, or from the embedded Valkey and EDGECACHE_EMBEDDED_BIND.
EDGECACHE_PUBLIC_REDIS_URL = os.environ.get("EDGECACHE_PUBLIC_REDIS_URL", "").strip()

# Celery: the settings boards use too (inference.board.app), as CELERY_* names.
for _name, _value in celery_settings(REDIS_URL).items():
    globals()[f"CELERY_{_name.upper()}"] = _value
# A run or encode no board of its device has started this many seconds after dispatch is not
# run any more (a board back from a long outage does not replay stale work); the board that
# meets it reports it, so it is recorded as expired instead of vanishing.
EDGECACHE_TASK_EXPIRES = _env_int("EDGECACHE_TASK_EXPIRES", 600)
# Every board reaches Redis as a user of its own (cachebox.acl); the control plane creates them.
# Off (0) only where the server has no ACLs the control plane may manage: boards then use REDIS_URL
# as given, and any board can act on every key (docs/operations.md).
EDGECACHE_BOARD_ACL = _env_bool("EDGECACHE_BOARD_ACL", True)
# A board counts as offline once it has missed this many of its heartbeats (it says how often it
# beats: `manage.py edge --heartbeat`, 5 s by default); open pages are told at once.
EDGECACHE_MISSED_HEARTBEATS = _env_int("EDGECACHE_MISSED_HEARTBEATS", 3)
if EDGECACHE_MISSED_HEARTBEATS < 1:
    raise ValueError(f"EDGECACHE_MISSED_HEARTBEATS must be at least 1, got {EDGECACHE_MISSED_HEARTBEATS}")
# How often the control worker looks for runs nobody will answer (expired, or on a board that died).
EDGECACHE_SWEEP_SECONDS = _env_float("EDGECACHE_SWEEP_SECONDS", 5.0)
# How often a web process reads the dispatches and reports other processes wrote into its routing
# state, from a thread of its own, so that a routing decision reads memory only (0: each decision
# reads them itself, as other processes do).
EDGECACHE_ROUTING_FOLLOW_SECONDS = _env_float("EDGECACHE_ROUTING_FOLLOW_SECONDS", 0.05)
# A device token enrolls one board once, within this many hours of being shown (then rotate it).
EDGECACHE_TOKEN_TTL_HOURS = _env_float("EDGECACHE_TOKEN_TTL_HOURS", 24.0)
if EDGECACHE_TOKEN_TTL_HOURS <= 0:
    raise ValueError(f"EDGECACHE_TOKEN_TTL_HOURS must be positive, got {EDGECACHE_TOKEN_TTL_HOURS}")

# Live events travel through Redis: they are encrypted and authenticated with a key derived from
# SECRET_KEY (Fernet), so a page only ever shows events this server made. A message someone else
# wrote into the layer's keys fails to decrypt and is dropped.
# A page's socket waits for its events with a blocking pop of 5 s (channels_redis); a read must
# outlast it. redis-py 8 reads with a 5 s timeout by default, which under load fired before the
# server's empty answer: the consumer died, the page reconnected and lost what came meanwhile.
CHANNEL_LAYER_READ_TIMEOUT_S = 15
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "dashboard.live.broadcast.AuthenticatedChannelLayer",
        "CONFIG": {
            "hosts": [{"address": REDIS_URL, "socket_timeout": CHANNEL_LAYER_READ_TIMEOUT_S, **tls_options(REDIS_URL)}],
            "symmetric_encryption_keys": [SECRET_KEY],
        },
    }
}

# --- The engine and the cache options, for commands that run a board next to the control plane
# (infer, bench). One set of defaults: inference.board.config.BoardConfig, read from the same
# environment variables an edge process reads.
EDGECACHE_MODEL = EDGECACHE_BOARD.model  # empty: the Gemma-3 270M package
EDGECACHE_N_CTX = EDGECACHE_BOARD.n_ctx
EDGECACHE_NAMESPACE = EDGECACHE_BOARD.namespace
EDGECACHE_CONNECT_TIMEOUT = EDGECACHE_BOARD.connect_timeout
EDGECACHE_IO_TIMEOUT = EDGECACHE_BOARD.io_timeout
# Unpinned entries expire after this many seconds unused (0: the longest the cache box allows) and
# are the ones Redis evicts under `volatile-lru`; only entries staff pin have no TTL.
EDGECACHE_ENTRY_TTL = EDGECACHE_BOARD.entry_ttl or 0
# What the cache box's write functions allow every writer (cachebox.quota, loaded by the control
# plane on every server): an entry's TTL is at most EDGECACHE_MAX_ENTRY_TTL seconds, its size at most
# EDGECACHE_MAX_ENTRY_BYTES, and a namespace holds at most EDGECACHE_NAMESPACE_QUOTA bytes (on each
# node of a cluster; 0: a quarter of the server's maxmemory). With the broker on the same server,
# keep the namespaces' quotas together below maxmemory minus what the queues need (docs/operations.md).
EDGECACHE_MAX_ENTRY_TTL = _env_int("EDGECACHE_MAX_ENTRY_TTL", 7 * 24 * 3600)
EDGECACHE_NAMESPACE_QUOTA = _env_int("EDGECACHE_NAMESPACE_QUOTA", 0)
if EDGECACHE_MAX_ENTRY_TTL < 1 or EDGECACHE_NAMESPACE_QUOTA < 0:
    raise ValueError(
        "EDGECACHE_MAX_ENTRY_TTL must be positive and EDGECACHE_NAMESPACE_QUOTA not negative (0: a quarter of maxmemory)"
    )
if EDGECACHE_ENTRY_TTL > EDGECACHE_MAX_ENTRY_TTL:
    raise ValueError(
        f"EDGECACHE_ENTRY_TTL ({EDGECACHE_ENTRY_TTL} s) is over EDGECACHE_MAX_ENTRY_TTL ({EDGECACHE_MAX_ENTRY_TTL} s): "
        "the cache box would refuse every entry; lower the one or raise the other"
    )

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "loggers": {
        "cachebox": {"handlers": ["console"], "level": os.environ.get("EDGECACHE_LOG_LEVEL", "WARNING")},
        "inference": {"handlers": ["console"], "level": os.environ.get("EDGECACHE_LOG_LEVEL", "WARNING")},
    },
}

# --- Metrics, rate limits and security events. --------------------------------------------
# /metrics answers `Authorization: Bearer <EDGECACHE_METRICS_TOKEN>` (when set) or a staff login.
EDGECACHE_METRICS_TOKEN = os.environ.get("EDGECACHE_METRICS_TOKEN", "").strip()
EDGECACHE_METRICS_CACHE_SECONDS = _env_float("EDGECACHE_METRICS_CACHE_SECONDS", 2.0)
# The share of reported cache hits recomputed cold on another board of the same model and compared
# bit for bit (dashboard.actions.entry_audits): small, never zero by default.
EDGECACHE_AUDIT_RATE = _env_float("EDGECACHE_AUDIT_RATE", 0.02)
if not 0.0 <= EDGECACHE_AUDIT_RATE <= 1.0:
    raise ValueError(f"EDGECACHE_AUDIT_RATE is a share of hits between 0 and 1, got {EDGECACHE_AUDIT_RATE}")
# Run submissions per user and minute (0: no limit); over it the Run page answers 429.
EDGECACHE_RUN_RATE = _env_int("EDGECACHE_RUN_RATE", 30)
# Enrollment attempts per device and minute the control plane looks at (0: no limit); past it they are dropped, logged.
EDGECACHE_ENROLL_RATE = _env_int("EDGECACHE_ENROLL_RATE", 10)

# Django's cache (the rate-limit counters) lives on the cache box's server, so every web
# process shares it. The embedded URL is a redis:// URL like any other: the commands that
# serve pages start the embedded Valkey first. Its clear() removes only this prefix (a plain
# RedisCache.clear() is FLUSHDB, which would also empty the cache box and the broker).
if REDIS_URL.split("://", 1)[0] in ("redis", "rediss", "unix"):
    CACHES = {
        "default": {
            "BACKEND": "dashboard.store.django_cache.CacheBoxRedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "edgecache:django",
            # JSON values (never pickle: dashboard.store.django_cache). A bounded pool: a burst of requests
            # waits up to the I/O timeout for a connection instead of opening one each.
            "OPTIONS": {
                "socket_connect_timeout": EDGECACHE_CONNECT_TIMEOUT,
                "socket_timeout": EDGECACHE_IO_TIMEOUT,
                "pool_class": "redis.BlockingConnectionPool",
                "max_connections": _env_int("EDGECACHE_CACHE_CONNECTIONS", 32),
                "timeout": EDGECACHE_IO_TIMEOUT,
                **tls_options(REDIS_URL),  # rediss://: the server's certificate checked (EDGECACHE_REDIS_CA_CERT)
            },
        }
    }
else:  # not a Redis URL: counters per process only
    CACHES = {"default": {"BACKEND": "dashboard.store.django_cache.JSONLocMemCache", "LOCATION": "edgecache"}}

# `edgecache.security`: one JSON object per line (cachebox.events.security_event).
LOGGING["formatters"]["json_lines"] = {"()": "cachebox.events.JsonLineFormatter"}
LOGGING["handlers"]["security"] = {"class": "logging.StreamHandler", "formatter": "json_lines"}
# ... and counted in the cache box for /metrics (edgecache_security_events_total{event}).
LOGGING["handlers"]["security_count"] = {"class": "dashboard.ops.security_counts.SecurityEventCounter"}
LOGGING["loggers"]["edgecache.security"] = {
    "handlers": ["security", "security_count"],
    "level": "INFO",
    "propagate": False,
}

# --- The OpenAI-compatible API (/v1/, dashboard.api) ---------------------------------------------
# Requests per API key and minute (a key's own rate, set by staff, wins; 0: no limit); over it, 429.
EDGECACHE_API_RATE = _env_int("EDGECACHE_API_RATE", 60)
# Seconds an API request waits for its board to say something (its first token, then each next
# one); past it the answer is 504 and the run is cancelled. Also how long the run may wait in its
# board's queue: a board that starts it later finds its client gone.
EDGECACHE_API_TIMEOUT = _env_int("EDGECACHE_API_TIMEOUT", 120)
if EDGECACHE_API_TIMEOUT < 1:
    raise ValueError(f"EDGECACHE_API_TIMEOUT must be at least 1 second, got {EDGECACHE_API_TIMEOUT}")
# Bounded queues (dashboard.admission): runs under way per online board of a namespace (API and Run
# page together), and per API key; past either, the run is refused at once (429 / 503 with
# Retry-After; the Run page says the fleet is busy). 0: no bound.
EDGECACHE_QUEUE_PER_BOARD = _env_int("EDGECACHE_QUEUE_PER_BOARD", 8)
EDGECACHE_API_QUEUE_PER_KEY = _env_int("EDGECACHE_API_QUEUE_PER_KEY", 16)
# Answer length when a request names none (max_tokens / max_completion_tokens).
EDGECACHE_API_MAX_TOKENS = _env_int("EDGECACHE_API_MAX_TOKENS", 256)
