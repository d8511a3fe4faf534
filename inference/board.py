"""An edge board in one process: the engine, its cache-box client, its catalogs, and the
strategies that serve prompts over the one exchange path.

``Board.start(config, keys=...)`` builds one from a ``BoardConfig`` (no Django settings);
the signing keys are passed in explicitly: an edge process passes its own device's
ring, commands that run next to the control plane pass the control plane's.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from cachebox import embedded
from cachebox.signing import Keychain
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry, CatalogSyncThread

from .breakeven import BreakEvenPolicy
from .compute_profile import Pacer, profile_named
from .config import BoardConfig
from .engine import Engine, EngineConfig
from .exchange import Exchange
from .host_plan import rtt_only
from .memory_plan import MAX_RAM_TIER_BYTES, MemoryPlan, ModelFacts, check_lab_strategy, plan_memory, unsized_plan
from .model_file import resolve_model
from .proc_memory import ProcessMemory
from .chat import chat_prompt, follow_up
from .prefix_serving import Extension, PrefixServing
from .schema_serving import SchemaServing

log = logging.getLogger(__name__)


def broker_url(config: BoardConfig) -> str:
    """The Celery broker's URL (REDIS_URL); this checkout's embedded Valkey when none is set (the
    control plane starts it: a board only connects)."""
    if config.uses_embedded_cachebox:
        return embedded.url_for(config.embedded_dir, config.embedded_port)
    return config.redis_url


def cachebox_url(config: BoardConfig) -> str:
    """The cache box URL: EDGECACHE_CACHEBOX_URL (a server or a cluster of its own), else the broker's server."""
    return config.cachebox_url or broker_url(config)


def store_link(config: BoardConfig):
    """The link the board's cache-box client paces: all of it, or only the round trip where the
    kernel already shapes the board's interface (boards as hosts, ``inference.host_plan``)."""
    return rtt_only(config.link) if config.link_shaped_by == "kernel" else config.link


def engine_config(config: BoardConfig) -> EngineConfig:
    return EngineConfig(n_ctx=config.n_ctx, n_threads=config.threads, kv_type=config.kv_type)


class _Sizer:
    """Sizes a board's engine to its registered memory once the model's facts are known
    (``inference.memory_plan``); keeps the plan for the board. Without a registered memory,
    every buffer keeps its default (the plan only describes them)."""

    def __init__(self, config: BoardConfig):
        self.config = config
        self.plan: MemoryPlan | None = None

    def __call__(self, facts: ModelFacts) -> EngineConfig:
        base = engine_config(self.config)
        if not self.config.memory_mb:
            self.plan = unsized_plan(facts, n_ctx=base.n_ctx, n_ubatch=base.n_ubatch or base.n_batch, ram_tier_bytes=self.config.ram_tier_bytes)
            return base
        self.plan = plan_memory(self.config.memory_mb, facts, n_ctx=self.config.n_ctx, grid=self.config.chunk_tokens, ram_tier_bytes=self.config.ram_tier_bytes)
        if self.plan.n_ctx < self.config.n_ctx:
            log.warning(
                "a context of %d tokens does not fit this board's %d MB: it runs with %d (%s)",
                self.config.n_ctx, self.config.memory_mb, self.plan.n_ctx, ", ".join(f"{name} {mb:g} MB" for name, mb in self.plan.parts_mb.items()),
            )
        return replace(base, n_ctx=self.plan.n_ctx, n_ubatch=self.plan.n_ubatch, repack=self.plan.repack)


class Board:
    """Engine + cache box + catalogs + the background catalog puller + the serving strategies."""

    def __init__(
        self,
        engine: Engine,
        store: CacheBox | None,
        config: BoardConfig,
        *,
        catalogs: CatalogRegistry | None = None,
        background_sync: bool = True,
        keys: Keychain | None = None,
        memory_plan: MemoryPlan | None = None,
    ):
        self.engine = engine
        profile = profile_named(config.compute_profile)  # the board's class, or None: this machine's speed
        if profile is None or engine.pacer is None or engine.pacer.profile != profile:
            engine.pacer = Pacer(profile) if profile is not None else None
        self.keys = keys
        self.store = store
        self.config = config
        if catalogs is None and store is not None:
            catalogs = CatalogRegistry(store, config.catalog_capacity, config.catalog_fp_rate)
        self.catalogs = catalogs
        self.exchange = Exchange(
            store,
            catalogs,
            fingerprint=engine.fingerprint,
            device=config.device,
            keys=keys,
            max_entry_bytes=config.max_entry_bytes,
            max_fetch_bytes=config.max_fetch_bytes,
            entry_ttl=config.entry_ttl,
            codec=config.upload_codec(),
        )
        self.memory_plan = memory_plan
        if config.ram_tier_bytes is not None:
            ram_tier_bytes = config.ram_tier_bytes
        else:  # follows the memory: on a small board the cache box is its memory
            ram_tier_bytes = memory_plan.ram_tier_bytes if memory_plan is not None else MAX_RAM_TIER_BYTES
        self.prefix = PrefixServing(
            engine,
            self.exchange,
            chunk_tokens=config.chunk_tokens,
            top_logits=config.top_logits,
            namespace=config.namespace,
            policy=BreakEvenPolicy(prefill_ms_per_token=config.prefill_ms_per_token, link=config.link, mode=config.policy, overlap=config.overlap),
            context_reuse=config.context_reuse,
            ram_tier_bytes=ram_tier_bytes,
        )
        self.schemas = SchemaServing(engine, self.exchange, namespace=config.namespace)
        self._sync_thread: CatalogSyncThread | None = None
        self._lab: dict[int | str, object] = {}  # k -> KV prediction, name -> anchor strategy, "early-exit"; loaded on first use
        if self.catalogs is not None:
            self.catalogs.get(config.namespace)
            if background_sync:
                self._sync_thread = CatalogSyncThread(self.catalogs, config.sync_interval)
                self._sync_thread.start()

    @classmethod
    def start(cls, config: BoardConfig, *, keys: Keychain | None, background_sync: bool = True) -> "Board":
        """Load the model; meanwhile connect to the cache box and pull the catalog (start-up, not request path).

        A cache box that cannot be reached is not fatal: runs then say "unavailable" and the
        puller retries in the background.
        """
        store = CacheBox(cachebox_url(config), connect_timeout=config.connect_timeout, timeout=config.io_timeout, link=store_link(config))
        catalogs = CatalogRegistry(store, config.catalog_capacity, config.catalog_fp_rate)
        catalogs.get(config.namespace)
        sizer = _Sizer(config)
        with ThreadPoolExecutor(max_workers=1) as pool:
            # A fresh process knows what the cache box holds before its first request.
            synced = pool.submit(catalogs.sync_all)
            # A sized board loads without repacked weights (their copy would count in its peak); it
            # loads them again only where the plan has room for them.
            first = replace(engine_config(config), repack=False) if config.memory_mb else engine_config(config)
            engine = Engine(resolve_model(config.model or None), first, size=sizer)  # MemoryRefused: the model does not fit
            profile = profile_named(config.compute_profile)
            if profile is not None:
                engine.pacer = Pacer(profile)  # before calibrating: the policy's prior is the paced rate
            config = config.with_(prefill_ms_per_token=calibrate_prefill(engine))
            synced.result()
        return cls(engine, store, config, catalogs=catalogs, background_sync=background_sync, keys=keys, memory_plan=sizer.plan)

    def cachebox_only(self) -> "Board":
        """Turn the board-local tiers off (benchmarks that measure the cache box itself)."""
        self.prefix.context_reuse = False
        self.prefix.ram = None
        return self

    def run(self, prompt, **kwargs):
        """Serve a prompt (text or segments) by prefix reuse (see inference.prefix_serving)."""
        with self._paced() as label:
            result = self.prefix.run(prompt, **kwargs)
        return label(result)

    def run_chat(self, messages, **kwargs):
        """Serve a conversation (role, content) through the model's chat template, cut where its
        turns begin (see inference.chat)."""
        chat = chat_prompt(self.engine, messages)
        result = self.run(chat.text, tokens=chat.tokens, cuts=chat.cuts, **kwargs)
        return chat, result

    def follow_up(self, messages, answer: str, *, namespace: str | None = None, upload: bool = True) -> Extension:
        """After a conversation's turn is answered: compute the prefix its next turn shares (the
        answer and the next turn's opening) on that turn's cuts, keep it in the context and share
        it, so the next turn prefills only its new message, on this board or another."""
        prefix = follow_up(self.engine, messages, answer)
        if prefix is None:
            return Extension()
        with self._paced():
            return self.prefix.extend(prefix.tokens, prefix.cuts, namespace=namespace, upload=upload)

    def run_pml(self, schema_source: str, prompt_source: str, **kwargs):
        """Serve a PML prompt from the schema's cached modules (see inference.schema_serving)."""
        with self._paced() as label:
            result = self.schemas.run(schema_source, prompt_source, **kwargs)
        return label(result)

    @contextmanager
    def _paced(self):
        """Label a run served under a compute profile (emulated) with the time its pacing added."""
        pacer = self.engine.pacer
        before = pacer.total_ms if pacer is not None else 0.0

        def label(result):
            if pacer is not None:
                result.breakdown.compute_profile = pacer.profile.emulated_label
                result.breakdown.paced_ms = round(pacer.total_ms - before, 3)
            return result

        yield label

    def kv_prediction(self, k: int):
        """The KV prediction strategy with ``k`` auxiliary layers (lab, approximate; loaded on first
        use: the auxiliary GGUF and the predictor file from ``$EDGECACHE_HOME/lab``)."""
        if k not in self._lab:
            self._check_memory(f"kv-prediction:{k}")
            from .lab.kv_prediction import KVPredictionServing, lab_dir

            self._lab[k] = KVPredictionServing.open(self.engine, k, lab_dir())
        return self._lab[k]

    def anchors(self, strategy: str):
        """Anchor inference (seed 004; lab, approximate): ``anchors`` prunes the board's own model's
        state to anchor tokens, ``anchors-tuned`` runs the anchor-tuned GGUF from ``$EDGECACHE_HOME/lab``
        (loaded on first use). Never reads or writes the cache box."""
        if strategy not in self._lab:
            self._check_memory(strategy)
            from .lab.anchors import AnchorServing
            from .lab.kv_prediction import lab_dir

            self._lab[strategy] = AnchorServing.open(self.engine, strategy, lab_dir())
        return self._lab[strategy]

    def early_exit(self, policy):
        """Early exit with KV fill (seed 002; lab, approximate) under ``policy``: decoding on the
        reference engine of this board's model (loaded on first use: ~15 s, ~1 GB), with the exit
        adapters ``bench lab-exit`` fitted if present. Never touches the context or the cache box."""
        if "early-exit" not in self._lab:
            self._check_memory("early-exit")  # before PyTorch is imported: it alone is 200 MB
            from .lab.early_exit import EarlyExitServing

            self._lab["early-exit"] = EarlyExitServing.open(self.engine)
        return self._lab["early-exit"].with_policy(policy)

    def _check_memory(self, strategy: str) -> None:
        """MemoryRefused (a clear error in the run's report) when ``strategy`` would not fit this
        board's registered memory next to what it holds now."""
        facts = getattr(self.engine, "facts", None)
        if facts is not None:
            check_lab_strategy(strategy, facts, n_ctx=self.engine.n_ctx, memory_mb=self.config.memory_mb, rss_mb=ProcessMemory.read().rss_mb)

    def memory(self) -> dict:
        """This process's memory now and at its peak, against what the board registered."""
        now = ProcessMemory.read()
        plan = self.memory_plan
        return {
            "rss_mb": now.rss_mb,
            "peak_rss_mb": now.peak_rss_mb,
            "pss_mb": now.pss_mb,
            "memory_mb": self.config.memory_mb,
            "budget_mb": plan.budget_mb if plan is not None and plan.memory_mb else None,
            "n_ctx": self.engine.n_ctx,
        }

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
                "epoch": replica.epoch,
                **catalog.stats.as_dict(),
            }
        return {
            "model": self.engine.model_file.path.name,
            "fingerprint": self.engine.fingerprint,
            "threads": self.engine.config.threads(),
            "catalogs": catalogs,
            "ram_tier": self.prefix.ram.status() if self.prefix.ram is not None else None,
            "kv_type": self.engine.config.kv_type,
            "codec": self.exchange.codec,
            "compute_profile": self.engine.pacer.profile.emulated_label if self.engine.pacer is not None else "",
            "memory": self.memory(),
        }

    def close(self) -> None:
        if self._sync_thread is not None:
            self._sync_thread.stop()
        for strategy in self._lab.values():
            strategy.close()
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


def set_board(board: Board) -> Board:
    """Make ``board`` the one this process's tasks serve with (an edge process has one model)."""
    global _board
    _board = board
    return board


def get_board() -> Board:
    if _board is None:
        raise RuntimeError("this process has no board; start it with `python manage.py edge`")
    return _board
