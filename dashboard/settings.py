"""Django settings for EdgeCache.

Everything has an embedded default so that `make run` works on a fresh machine:
SQLite and an embedded Valkey server under ``.edgecache/``. Real deployments set
``DATABASE_URL`` (PostgreSQL) and ``REDIS_URL``. Nothing secret lives in the repo.
"""

import os
import secrets
from pathlib import Path

import dj_database_url

from cachebox.embedded import url_for

BASE_DIR = Path(__file__).resolve().parent.parent
EDGECACHE_HOME = Path(os.environ.get("EDGECACHE_HOME", BASE_DIR / ".edgecache")).resolve()
EDGECACHE_HOME.mkdir(parents=True, exist_ok=True)


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


def _secret(env: str, file_name: str) -> str:
    """A secret from the environment, else one generated once into .edgecache/ (mode 0600)."""
    if os.environ.get(env):
        return os.environ[env]
    key_file = EDGECACHE_HOME / file_name
    if not key_file.exists():
        key_file.touch(mode=0o600)
        key_file.write_text(secrets.token_urlsafe(50))
    return key_file.read_text().strip()


SECRET_KEY = _secret("DJANGO_SECRET_KEY", "secret_key")
# Master secret of the cache-entry signing keys (one derived key per namespace and generation).
EDGECACHE_SIGNING_SECRET = _secret("EDGECACHE_SIGNING_SECRET", "signing_secret").encode()
DEBUG = os.environ.get("DJANGO_DEBUG", "") == "1"
ALLOWED_HOSTS = [h for h in os.environ.get("DJANGO_ALLOWED_HOSTS", "127.0.0.1,localhost").split(",") if h]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "channels",
    "cachebox",
    "inference",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
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
            ],
        },
    },
]
WSGI_APPLICATION = None
ASGI_APPLICATION = "dashboard.asgi.application"

DATABASES = {
    "default": dj_database_url.config(default=f"sqlite:///{EDGECACHE_HOME / 'db.sqlite3'}", conn_max_age=60)
}
if DATABASES["default"]["ENGINE"].endswith("sqlite3"):
    # The web server and the control-plane worker write at once: wait for the lock.
    DATABASES["default"].setdefault("OPTIONS", {})["timeout"] = 20
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
LOGIN_URL = "login"
LOGIN_REDIRECT_URL = "home"
LOGOUT_REDIRECT_URL = "login"
SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_SAMESITE = "Lax"
X_FRAME_OPTIONS = "DENY"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
STATICFILES_DIRS = [BASE_DIR / "static"]
STATIC_ROOT = EDGECACHE_HOME / "staticfiles"
STATIC_ROOT.mkdir(exist_ok=True)
WHITENOISE_USE_FINDERS = True  # serve straight from static/ and the apps: no collectstatic step to forget

# --- The cache box, broker and channel layer: one Redis/Valkey server. -------------------
EDGECACHE_EMBEDDED_DIR = EDGECACHE_HOME / "valkey"
EDGECACHE_EMBEDDED_PORT = _env_int("EDGECACHE_EMBEDDED_PORT", 0) or None
EDGECACHE_EMBEDDED_MAXMEMORY = os.environ.get("EDGECACHE_EMBEDDED_MAXMEMORY", "1gb")
REDIS_URL_IS_EMBEDDED = not os.environ.get("REDIS_URL")
REDIS_URL = os.environ.get("REDIS_URL") or url_for(EDGECACHE_EMBEDDED_DIR, EDGECACHE_EMBEDDED_PORT)

CELERY_BROKER_URL = REDIS_URL
CELERY_TASK_SERIALIZER = "json"  # never pickle: boards load what they receive
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True  # boards report results as control-plane tasks
CELERY_TASK_ACKS_LATE = True  # a message is acknowledged after its task ran: a board killed mid-task loses nothing
CELERY_TASK_REJECT_ON_WORKER_LOST = True
# Unacknowledged messages of a worker that died go back to the queue after this many seconds.
# Keep it longer than any task (a task still running then would run twice; runs are stored
# once by id) and shorter than EDGECACHE_TASK_EXPIRES.
# Every worker looks for such messages every EDGECACHE_RESTORE_INTERVAL seconds (one small query;
# kombu's default throttle would make it every 100 s).
CELERY_BROKER_TRANSPORT_OPTIONS = {
    "visibility_timeout": _env_int("EDGECACHE_VISIBILITY_TIMEOUT", 300),
    "unacked_restore_interval": _env_int("EDGECACHE_RESTORE_INTERVAL", 10),
    "unacked_restore_throttle": 1,
}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A run or encode no board of its device has started this many seconds after dispatch is not
# run any more (a board back from a long outage does not replay stale work); the board that
# meets it reports it, so it is recorded as expired instead of vanishing.
EDGECACHE_TASK_EXPIRES = _env_int("EDGECACHE_TASK_EXPIRES", 600)
CELERY_TASK_DEFAULT_QUEUE = "control"
CELERY_TASK_ROUTES = {
    name: {"queue": "control"}
    for name in ("edgecache.record_run", "edgecache.heartbeat", "edgecache.encode_progress", "edgecache.encoded")
}
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL]},
    }
}

# --- The engine and the cached-inference pipeline (read at call time). ------------------
EDGECACHE_MODEL = os.environ.get("EDGECACHE_MODEL", "")  # empty: the Gemma-3 270M package
EDGECACHE_N_CTX = _env_int("EDGECACHE_N_CTX", 4096)
EDGECACHE_THREADS = _env_int("EDGECACHE_THREADS", 0)  # 0: all cores
EDGECACHE_KV_TYPE = os.environ.get("EDGECACHE_KV_TYPE", "f16")
EDGECACHE_NAMESPACE = os.environ.get("EDGECACHE_NAMESPACE", "default")
EDGECACHE_DEVICE = os.environ.get("EDGECACHE_DEVICE", "") or os.uname().nodename
EDGECACHE_CHUNK_TOKENS = _env_int("EDGECACHE_CHUNK_TOKENS", 64)
EDGECACHE_TOP_LOGITS = _env_int("EDGECACHE_TOP_LOGITS", 64)
EDGECACHE_CATALOG_CAPACITY = _env_int("EDGECACHE_CATALOG_CAPACITY", 1_000_000)
EDGECACHE_CATALOG_FP_RATE = _env_float("EDGECACHE_CATALOG_FP_RATE", 0.01)
EDGECACHE_CATALOG_SYNC_SECONDS = _env_float("EDGECACHE_CATALOG_SYNC_SECONDS", 1.0)
EDGECACHE_CONNECT_TIMEOUT = _env_float("EDGECACHE_CONNECT_TIMEOUT", 0.5)
EDGECACHE_IO_TIMEOUT = _env_float("EDGECACHE_IO_TIMEOUT", 5.0)
EDGECACHE_MAX_ENTRY_BYTES = _env_int("EDGECACHE_MAX_ENTRY_BYTES", 64 * 1024 * 1024)
# All entries one request may download together (a board refuses bigger chains before fetching).
EDGECACHE_MAX_FETCH_BYTES = _env_int("EDGECACHE_MAX_FETCH_BYTES", 256 * 1024 * 1024)
# Signing key rings for boards and commands that run on the control plane (infer, bench):
# a callable namespace -> cachebox.signing.KeyRing, derived from EDGECACHE_SIGNING_SECRET.
EDGECACHE_KEYRING_PROVIDER = "dashboard.signing.keyring_for"
# Unpinned entries expire after this many seconds unused (0: never) and are the ones
# Redis evicts under `volatile-lru`; pinned entries have no TTL.
EDGECACHE_ENTRY_TTL = _env_int("EDGECACHE_ENTRY_TTL", 7 * 24 * 3600)

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
# Run submissions per user and minute (0: no limit); over it the Run page answers 429.
EDGECACHE_RUN_RATE = _env_int("EDGECACHE_RUN_RATE", 30)

# Django's cache (the rate-limit counters) lives on the cache box's server, so every daphne
# process shares it. The embedded URL is a redis:// URL like any other: the commands that
# serve pages start the embedded Valkey first. Its clear() removes only this prefix (a plain
# RedisCache.clear() is FLUSHDB, which would also empty the cache box and the broker).
if REDIS_URL.split("://", 1)[0] in ("redis", "rediss", "unix"):
    CACHES = {
        "default": {
            "BACKEND": "dashboard.cache.CacheBoxRedisCache",
            "LOCATION": REDIS_URL,
            "KEY_PREFIX": "edgecache:django",
            "OPTIONS": {"socket_connect_timeout": EDGECACHE_CONNECT_TIMEOUT, "socket_timeout": EDGECACHE_IO_TIMEOUT},
        }
    }
else:  # not a Redis URL: counters per process only
    CACHES = {"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "edgecache"}}

# `edgecache.security`: one JSON object per line (cachebox.events.security_event).
LOGGING["formatters"]["json_lines"] = {"()": "cachebox.events.JsonLineFormatter"}
LOGGING["handlers"]["security"] = {"class": "logging.StreamHandler", "formatter": "json_lines"}
LOGGING["loggers"]["edgecache.security"] = {"handlers": ["security"], "level": "INFO", "propagate": False}
