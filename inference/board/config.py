"""One board configuration with one set of defaults, read from the environment.

A board needs no control-plane settings: ``BoardConfig.from_env()`` is all an edge process
reads (the cache box URL, the model, the engine and cache options). The control plane's
Django settings take their engine and cache defaults from here too, so every default
lives in this one place. Pure: no Django, no I/O beyond ``os.environ``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Mapping

from cachebox.codec import CodecChoice
from cachebox.link import LinkProfile

ROOT = Path(__file__).resolve().parents[2]  # the checkout (inference/board/config.py)
DEFAULT_ENTRY_TTL = 7 * 24 * 3600


class ConfigError(ValueError):
    """A setting in the environment that cannot be used; the message names it."""


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {raw!r}") from None


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    raw = environ.get(name, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ConfigError(f"{name} must be a number, got {raw!r}") from None


def edgecache_home(environ: Mapping[str, str] = os.environ) -> Path:
    """Where this checkout keeps its embedded cache box and database (``EDGECACHE_HOME``)."""
    return Path(environ.get("EDGECACHE_HOME", ROOT / ".edgecache")).resolve()


def secrets_home(environ: Mapping[str, str] = os.environ) -> Path:
    """Where the secrets live (``EDGECACHE_SECRETS_DIR``): by default a folder beside the state
    folder, never inside it (``.edgecache-secrets`` beside ``.edgecache``), so that a copy of the
    state (the database, the cache box's files) holds no key that opens anything."""
    explicit = environ.get("EDGECACHE_SECRETS_DIR", "").strip()
    if explicit:
        return Path(explicit).resolve()
    home = edgecache_home(environ)
    return home.with_name(f"{home.name}-secrets")


def move_legacy_secret(old: Path, new: Path) -> bool:
    """Move a secret an older version kept in the state folder to ``new`` (once, keeping its mode);
    False when there is nothing to move."""
    try:
        if new.exists() or not old.exists():
            return False
    except (
        PermissionError
    ):  # a folder this process may not enter (a demo board run as another user): nothing of its own there
        return False
    new.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        os.replace(old, new)
    except OSError:  # another file system: copy, then remove
        new.write_bytes(old.read_bytes())
        new.chmod(0o600)
        old.unlink()
    return True


@dataclass(frozen=True)
class BoardConfig:
    device: str = field(default_factory=lambda: os.uname().nodename)
    namespace: str = "default"
    redis_url: str = (
        ""  # the broker (and the cache box unless cachebox_url is set); empty: this checkout's embedded Valkey
    )
    cachebox_url: str = (
        ""  # the cache box alone, e.g. a Redis/Valkey Cluster (redis+cluster://h:p,h:p); empty: redis_url's server
    )
    model: str = ""  # a GGUF path; empty: the Gemma-3 270M package
    n_ctx: int = 4096
    threads: int = 0  # 0: every core
    kv_type: str = "f16"
    chunk_tokens: int = (
        128  # the batch grid: every prefill cuts its batches, and ranges are stored, every this many tokens
    )
    top_logits: int = 64  # logits kept with an entry that ends a segment
    catalog_capacity: int = 1_000_000
    catalog_fp_rate: float = 0.01
    sync_interval: float = 1.0  # seconds between catalog pulls
    connect_timeout: float = 0.5
    io_timeout: float = 5.0
    max_entry_bytes: int = 64 * 1024 * 1024
    max_fetch_bytes: int = 256 * 1024 * 1024  # all entries one request may download together
    entry_ttl: int | None = DEFAULT_ENTRY_TTL  # unpinned entries expire after this many seconds unused
    link: LinkProfile | None = None  # emulated link to the cache box (None: as the network is)
    context_reuse: bool = True  # a prompt that shares a prefix with the board's last one continues from it
    ram_tier_bytes: int | None = (
        None  # range entries kept next to the model (0: no RAM tier; None: follows memory_mb, 128 MB when unknown)
    )
    flash_tier_bytes: int = (
        0  # range entries kept on the board's own disk, between RAM and the cache box (0: no flash tier)
    )
    flash_dir: Path | None = None  # where the flash tier keeps them (None: the state folder's flash/<device>)
    board_state_dir: Path | None = (
        None  # what the board keeps of its own (answered requests); None: the state folder's boards/<device>
    )
    memory_mb: int = 0  # the board's registered memory: its buffers are sized to it (inference.engine.memory_plan); 0: unknown, defaults
    policy: str = "adaptive"  # fetch when it pays ("always" / "never" force it, for benchmarks)
    overlap: bool = True  # compute the front of a prompt while the back of it loads, when that is faster
    codec: str = (
        "auto"  # how uploaded states are stored: raw, zstd, zstd-shuffle, or auto (by the link: cachebox.codec)
    )
    compute_profile: str = ""  # pace model work to a board class (inference.engine.compute_profile); "" = this machine
    prefill_ms_per_token: float = 3.0  # the policy's prior until the board has measured itself
    embedded_dir: Path = field(default_factory=lambda: edgecache_home() / "valkey")
    embedded_port: int | None = None
    embedded_maxmemory: str = "1gb"
    embedded_bind: tuple[str, ...] = (
        "127.0.0.1",
    )  # addresses the embedded Valkey listens on (boards as hosts reach it on their hub's)
    link_shaped_by: str = "socket"  # who paces ``link``: "socket" (cachebox.shaping) or "kernel" (the board's interface; sockets add the RTT only)
    keys_dir: Path = field(
        default_factory=lambda: secrets_home() / "board-keys"
    )  # this board's private keys (0600 files)
    board_acl: bool = True  # reach Redis as this board's own user (cachebox.acl), never with REDIS_URL's credentials

    def upload_codec(self) -> str:
        """The codec this board stores its states with: ``codec``, or by its link when "auto"."""
        if self.codec != "auto":
            return self.codec
        return CodecChoice().choose(self.link.bytes_per_second if self.link is not None else None)

    @property
    def uses_embedded_cachebox(self) -> bool:
        return not self.redis_url

    def flash_folder(self) -> Path:
        """Where this board's flash tier keeps its entries (one folder per board: boards sharing a
        disk never evict each other's files)."""
        return self.flash_dir if self.flash_dir is not None else self.embedded_dir.parent / "flash" / self.device

    def state_folder(self) -> Path:
        """Where this board keeps what it must remember across restarts (the requests it answered)."""
        return (
            self.board_state_dir
            if self.board_state_dir is not None
            else self.embedded_dir.parent / "boards" / self.device
        )

    def key_file(self, device: str) -> Path:
        """Where the board ``device`` keeps its private keys (moved there from the state folder,
        where older versions kept them)."""
        path = self.keys_dir / f"{device}.key"
        move_legacy_secret(self.embedded_dir.parent / "board-keys" / f"{device}.key", path)
        return path

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **overrides) -> "BoardConfig":
        """The configuration the environment describes (``EDGECACHE_*``, ``REDIS_URL``), then ``overrides``."""
        d = cls.__dataclass_fields__
        home = edgecache_home(environ)
        ttl = _int(environ, "EDGECACHE_ENTRY_TTL", DEFAULT_ENTRY_TTL)
        config = cls(
            device=environ.get("EDGECACHE_DEVICE", "").strip() or os.uname().nodename,
            namespace=environ.get("EDGECACHE_NAMESPACE", "").strip() or d["namespace"].default,
            redis_url=environ.get("REDIS_URL", "").strip(),
            cachebox_url=environ.get("EDGECACHE_CACHEBOX_URL", "").strip(),
            model=environ.get("EDGECACHE_MODEL", "").strip(),
            n_ctx=_int(environ, "EDGECACHE_N_CTX", d["n_ctx"].default),
            threads=_int(environ, "EDGECACHE_THREADS", d["threads"].default),
            kv_type=environ.get("EDGECACHE_KV_TYPE", "").strip() or d["kv_type"].default,
            chunk_tokens=_int(environ, "EDGECACHE_CHUNK_TOKENS", d["chunk_tokens"].default),
            top_logits=_int(environ, "EDGECACHE_TOP_LOGITS", d["top_logits"].default),
            catalog_capacity=_int(environ, "EDGECACHE_CATALOG_CAPACITY", d["catalog_capacity"].default),
            catalog_fp_rate=_float(environ, "EDGECACHE_CATALOG_FP_RATE", d["catalog_fp_rate"].default),
            sync_interval=_float(environ, "EDGECACHE_CATALOG_SYNC_SECONDS", d["sync_interval"].default),
            connect_timeout=_float(environ, "EDGECACHE_CONNECT_TIMEOUT", d["connect_timeout"].default),
            io_timeout=_float(environ, "EDGECACHE_IO_TIMEOUT", d["io_timeout"].default),
            max_entry_bytes=_int(environ, "EDGECACHE_MAX_ENTRY_BYTES", d["max_entry_bytes"].default),
            max_fetch_bytes=_int(environ, "EDGECACHE_MAX_FETCH_BYTES", d["max_fetch_bytes"].default),
            entry_ttl=ttl or None,
            context_reuse=environ.get("EDGECACHE_CONTEXT_REUSE", "1").strip() not in ("0", "false", "no", "off"),
            overlap=environ.get("EDGECACHE_OVERLAP", "1").strip() not in ("0", "false", "no", "off"),
            codec=environ.get("EDGECACHE_CODEC", "").strip() or d["codec"].default,
            compute_profile=environ.get("EDGECACHE_COMPUTE_PROFILE", "").strip(),
            ram_tier_bytes=_int(environ, "EDGECACHE_RAM_TIER_MB", -1) * 1024 * 1024
            if environ.get("EDGECACHE_RAM_TIER_MB", "").strip()
            else None,
            flash_tier_bytes=_int(environ, "EDGECACHE_FLASH_TIER_MB", 0) * 1024 * 1024,
            flash_dir=Path(environ["EDGECACHE_FLASH_DIR"].strip())
            if environ.get("EDGECACHE_FLASH_DIR", "").strip()
            else None,
            board_state_dir=Path(environ["EDGECACHE_BOARD_STATE_DIR"].strip())
            if environ.get("EDGECACHE_BOARD_STATE_DIR", "").strip()
            else None,
            memory_mb=_int(environ, "EDGECACHE_MEMORY_MB", 0),
            embedded_dir=home / "valkey",
            embedded_port=_int(environ, "EDGECACHE_EMBEDDED_PORT", 0) or None,
            embedded_maxmemory=environ.get("EDGECACHE_EMBEDDED_MAXMEMORY", "").strip()
            or d["embedded_maxmemory"].default,
            embedded_bind=tuple(environ.get("EDGECACHE_EMBEDDED_BIND", "").replace(",", " ").split())
            or d["embedded_bind"].default,
            link_shaped_by=environ.get("EDGECACHE_LINK_SHAPED_BY", "").strip() or d["link_shaped_by"].default,
            keys_dir=Path(environ.get("EDGECACHE_BOARD_KEYS_DIR", "").strip() or secrets_home(environ) / "board-keys"),
            board_acl=environ.get("EDGECACHE_BOARD_ACL", "1").strip().lower() not in ("0", "false", "no", "off"),
        )
        return config.with_(**overrides)

    def with_(self, **changes) -> "BoardConfig":
        """A copy with ``changes`` (None values are ignored, so optional overrides pass straight through)."""
        known = {f.name for f in fields(self)}
        unknown = set(changes) - known
        if unknown:
            raise TypeError(f"unknown board options: {', '.join(sorted(unknown))}")
        return replace(self, **{key: value for key, value in changes.items() if value is not None})
