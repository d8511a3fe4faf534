"""An edge board in one process: the engine, its cache-box client and its catalogs.

``Board.from_settings()`` builds one from Django settings (read at call time);
``get_board()`` keeps one per process, since a process holds one model.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from django.conf import settings
from django.utils.module_loading import import_string

from cachebox import embedded
from cachebox.errors import CacheBoxUnavailable
from cachebox.link import LinkProfile
from cachebox.signing import Keychain
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry, CatalogSyncThread

from .breakeven import BreakEvenPolicy
from .engine import Engine, EngineConfig
from .model import resolve_model
from .modular import ModularInference
from .pipeline import CachedInference

log = logging.getLogger(__name__)


def cachebox_url() -> str:
    """The cache box URL; starts this checkout's embedded Valkey when no REDIS_URL is set."""
    if settings.REDIS_URL_IS_EMBEDDED:
        return embedded.ensure_running(
            settings.EDGECACHE_EMBEDDED_DIR,
            port=settings.EDGECACHE_EMBEDDED_PORT,
            maxmemory=settings.EDGECACHE_EMBEDDED_MAXMEMORY,
        )
    return settings.REDIS_URL


def control_plane_keys() -> Keychain:
    """Signing keys for code that runs next to the control plane and holds its signing secret."""
    return Keychain(import_string(settings.EDGECACHE_KEYRING_PROVIDER))


@dataclass
class BoardOptions:
    device: str
    namespace: str = "default"
    chunk_tokens: int = 64
    top_logits: int = 64
    catalog_capacity: int = 1_000_000
    catalog_fp_rate: float = 0.01
    sync_interval: float = 1.0
    connect_timeout: float = 0.5
    io_timeout: float = 5.0
    max_entry_bytes: int = 64 * 1024 * 1024
    max_fetch_bytes: int = 256 * 1024 * 1024
    entry_ttl: int | None = 7 * 24 * 3600
    link: LinkProfile | None = None  # emulated link to the cache box (None: as the network is)
    policy: str = "adaptive"  # fetch when it pays ("always" / "never" force it, for benchmarks)
    prefill_ms_per_token: float = 3.0  # the policy's prior until the board has measured itself


class Board:
    """Engine + cache box + catalogs + the background catalog puller."""

    def __init__(
        self,
        engine: Engine,
        store: CacheBox | None,
        options: BoardOptions,
        *,
        catalogs: CatalogRegistry | None = None,
        background_sync: bool = True,
        keys: Keychain | None = None,
    ):
        self.engine = engine
        self.keys = keys
        self.store = store
        self.options = options
        if catalogs is None and store is not None:
            catalogs = CatalogRegistry(store, options.catalog_capacity, options.catalog_fp_rate)
        self.catalogs = catalogs
        self.pipeline = CachedInference(
            engine,
            store,
            self.catalogs,
            device=options.device,
            chunk_tokens=options.chunk_tokens,
            top_logits=options.top_logits,
            max_entry_bytes=options.max_entry_bytes,
            max_fetch_bytes=options.max_fetch_bytes,
            namespace=options.namespace,
            entry_ttl=options.entry_ttl,
            keys=keys,
            policy=BreakEvenPolicy(prefill_ms_per_token=options.prefill_ms_per_token, link=options.link, mode=options.policy),
        )
        self.modular = ModularInference(
            engine,
            store,
            self.catalogs,
            device=options.device,
            namespace=options.namespace,
            entry_ttl=options.entry_ttl,
            max_entry_bytes=options.max_entry_bytes,
            keys=keys,
        )
        self._sync_thread: CatalogSyncThread | None = None
        if self.catalogs is not None:
            self.catalogs.get(options.namespace)
            if background_sync:
                self._sync_thread = CatalogSyncThread(self.catalogs, options.sync_interval)
                self._sync_thread.start()

    @classmethod
    def start(
        cls, engine_config: EngineConfig, options: BoardOptions, redis_url: str | None, *, model_path=None, background_sync=True, keys=None
    ) -> "Board":
        """Load the model; meanwhile connect to the cache box and pull the catalog (start-up, not request path)."""
        store = catalogs = None
        if redis_url:
            store = CacheBox(redis_url, connect_timeout=options.connect_timeout, timeout=options.io_timeout, link=options.link)
            catalogs = CatalogRegistry(store, options.catalog_capacity, options.catalog_fp_rate)
            catalogs.get(options.namespace)
        with ThreadPoolExecutor(max_workers=1) as pool:
            # A fresh process knows what the cache box holds before its first request.
            synced = pool.submit(catalogs.sync_all) if catalogs else None
            engine = Engine(resolve_model(model_path), engine_config)
            options.prefill_ms_per_token = calibrate_prefill(engine)
            if synced is not None:
                synced.result()
        return cls(engine, store, options, catalogs=catalogs, background_sync=background_sync, keys=keys)

    @classmethod
    def from_settings(
        cls,
        *,
        device: str | None = None,
        namespace: str | None = None,
        threads: int | None = None,
        link: LinkProfile | None = None,
        policy: str = "adaptive",
        background_sync: bool = True,
        keys: Keychain | None = None,
    ) -> "Board":
        """A board from settings; without ``keys`` it signs with the control plane's own rings
        (``EDGECACHE_KEYRING_PROVIDER``), as the commands that run next to it do."""
        try:
            url = cachebox_url()
        except CacheBoxUnavailable as exc:
            # Keep the URL: runs then say "unavailable" and the puller retries in the background.
            log.warning("%s", exc)
            url = settings.REDIS_URL
        engine_config = EngineConfig(
            n_ctx=settings.EDGECACHE_N_CTX,
            n_threads=threads or settings.EDGECACHE_THREADS,
            kv_type=settings.EDGECACHE_KV_TYPE,
        )
        options = BoardOptions(
            device=device or settings.EDGECACHE_DEVICE,
            namespace=namespace or settings.EDGECACHE_NAMESPACE,
            chunk_tokens=settings.EDGECACHE_CHUNK_TOKENS,
            top_logits=settings.EDGECACHE_TOP_LOGITS,
            catalog_capacity=settings.EDGECACHE_CATALOG_CAPACITY,
            catalog_fp_rate=settings.EDGECACHE_CATALOG_FP_RATE,
            sync_interval=settings.EDGECACHE_CATALOG_SYNC_SECONDS,
            connect_timeout=settings.EDGECACHE_CONNECT_TIMEOUT,
            io_timeout=settings.EDGECACHE_IO_TIMEOUT,
            max_entry_bytes=settings.EDGECACHE_MAX_ENTRY_BYTES,
            max_fetch_bytes=settings.EDGECACHE_MAX_FETCH_BYTES,
            entry_ttl=settings.EDGECACHE_ENTRY_TTL or None,
            link=link,
            policy=policy,
        )
        if keys is None:
            keys = control_plane_keys()
        return cls.start(engine_config, options, url, model_path=settings.EDGECACHE_MODEL or None, background_sync=background_sync, keys=keys)

    def run(self, prompt, **kwargs):
        return self.pipeline.run(prompt, **kwargs)

    def run_pml(self, schema_source: str, prompt_source: str, **kwargs):
        """Serve a PML prompt from the schema's cached modules (see inference.modular)."""
        return self.modular.run(schema_source, prompt_source, **kwargs)

    def status(self) -> dict:
        """What a heartbeat reports: model, threads and every catalog's size and counters."""
        catalogs = {}
        for replica in self.catalogs.replicas if self.catalogs else []:
            catalog = replica.catalog
            catalogs[replica.namespace] = {
                "approx_items": round(catalog.approx_items),
                "size_bytes": catalog.size_bits // 8,
                "fill_ratio": round(catalog.fill_ratio(), 6),
                "estimated_fp_rate": catalog.estimated_fp_rate(),
                "configured_fp_rate": catalog.fp_rate,
                "last_sync": replica.last_sync,
                **catalog.stats.as_dict(),
            }
        return {
            "model": self.engine.model_file.path.name,
            "fingerprint": self.engine.fingerprint,
            "threads": self.engine.config.threads(),
            "catalogs": catalogs,
        }

    def close(self) -> None:
        if self._sync_thread is not None:
            self._sync_thread.stop()
        self.engine.close()


def calibrate_prefill(engine: Engine, tokens: int = 48) -> float:
    """This board's prefill cost in ms per token, measured once at start (the policy's prior)."""
    sample = (engine.tokenize("The quick brown fox jumps over the lazy dog. " * 8, add_bos=True) * 2)[:tokens]
    with engine.lock:
        engine.remove(engine.scratch_seq)
        started = time.perf_counter()
        engine.prefill(sample, 0, seq=engine.scratch_seq)
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        engine.remove(engine.scratch_seq)
    return elapsed_ms / len(sample)


_board: Board | None = None
_board_lock = threading.Lock()


def get_board(**options) -> Board:
    """This process's board, started on first use (``options`` go to ``from_settings``)."""
    global _board
    with _board_lock:
        if _board is None:
            _board = Board.from_settings(**options)
        return _board
