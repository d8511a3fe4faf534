"""An edge board in one process: the engine, its cache-box client, its catalogs, and the
strategies that serve prompts over the one exchange path.

``Board.start(config, keys=...)`` builds one from a ``BoardConfig`` (no Django settings);
the signing keys are passed in explicitly: an edge process passes its own device's
ring, commands that run next to the control plane pass the control plane's.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Callable, TypeVar

from cachebox import embedded
from cachebox.link import rtt_only
from cachebox.signing import Keychain
from cachebox.store import CacheBox
from cachebox.sync import CatalogRegistry, CatalogSyncThread
from inference.board.config import BoardConfig
from inference.contract.messages import BoardRates
from inference.engine.chat import FollowUps, chat_prompt, follow_up
from inference.engine.compute_profile import Pacer, profile_named
from inference.engine.llama import Engine, EngineConfig
from inference.engine.memory_plan import (
    MAX_RAM_TIER_BYTES,
    MB,
    MemoryPlan,
    ModelFacts,
    check_lab_strategy,
    plan_memory,
    unsized_plan,
)
from inference.engine.model_file import resolve_model
from inference.engine.proc_memory import ProcessMemory
from inference.placement import DEFAULT_DECODE_MS_PER_TOKEN
from inference.serving.breakeven import BreakEvenPolicy
from inference.serving.exchange import Exchange
from inference.serving.prefix import Extension, PrefixServing
from inference.serving.run import Prompt, RunOptions, RunResult, Strategy
from inference.serving.schema import SchemaServing
from inference.serving.strategies import EXACT, REGISTRY, StrategySpec

log = logging.getLogger(__name__)

Opened = TypeVar("Opened")


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
    kernel already shapes the board's interface (boards as hosts, ``dashboard.hosts.plan``)."""
    return rtt_only(config.link) if config.link_shaped_by == "kernel" else config.link


def engine_config(config: BoardConfig) -> EngineConfig:
    return EngineConfig(n_ctx=config.n_ctx, n_threads=config.threads, kv_type=config.kv_type)


class _Sizer:
    """Sizes a board's engine to its registered memory once the model's facts are known
    (``inference.engine.memory_plan``); keeps the plan for the board. Without a registered memory,
    every buffer keeps its default (the plan only describes them)."""

    def __init__(self, config: BoardConfig):
        self.config = config
        self.plan: MemoryPlan | None = None

    def __call__(self, facts: ModelFacts) -> EngineConfig:
        base = engine_config(self.config)
        if not self.config.memory_mb:
            self.plan = unsized_plan(
                facts,
                n_ctx=base.n_ctx,
                n_ubatch=base.n_ubatch or base.n_batch,
                ram_tier_bytes=self.config.ram_tier_bytes,
            )
            return base
        self.plan = plan_memory(
            self.config.memory_mb,
            facts,
            n_ctx=self.config.n_ctx,
            grid=self.config.chunk_tokens,
            ram_tier_bytes=self.config.ram_tier_bytes,
        )
        if self.plan.n_ctx < self.config.n_ctx:
            log.warning(
                "a context of %d tokens does not fit this board's %d MB: it runs with %d (%s)",
                self.config.n_ctx,
                self.config.memory_mb,
                self.plan.n_ctx,
                ", ".join(f"{name} {mb:g} MB" for name, mb in self.plan.parts_mb.items()),
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
        rates: BoardRates | None = None,
    ):
        self.engine = engine
        self.rates = rates  # measured at start (``calibrate``): reported in every heartbeat
        self.follow_ups = (
            FollowUps()
        )  # whether this board's clients take up the chat turns it prepares (inference.board.serve)
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
            policy=BreakEvenPolicy(
                prefill_ms_per_token=config.prefill_ms_per_token,
                link=config.link,
                mode=config.policy,
                overlap=config.overlap,
            ),
            context_reuse=config.context_reuse,
            ram_tier_bytes=ram_tier_bytes,
            # a board registered with its memory keeps its whole process under the budget: the RAM tier gives way
            ram_rss_limit_bytes=int(memory_plan.budget_mb * MB)
            if memory_plan is not None and memory_plan.memory_mb
            else None,
            flash_tier_bytes=config.flash_tier_bytes,
            flash_dir=config.flash_folder(),
        )
        self.schemas = SchemaServing(engine, self.exchange, namespace=config.namespace)
        self._sync_thread: CatalogSyncThread | None = None
        self._opened: dict[
            StrategySpec, Any
        ] = {}  # lab strategies (or what they share), loaded on first use; closed with the board
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
        store = CacheBox(
            cachebox_url(config),
            connect_timeout=config.connect_timeout,
            timeout=config.io_timeout,
            link=store_link(config),
        )
        catalogs = CatalogRegistry(store, config.catalog_capacity, config.catalog_fp_rate)
        catalogs.get(config.namespace)
        sizer = _Sizer(config)
        with ThreadPoolExecutor(max_workers=1) as pool:
            # A fresh process knows what the cache box holds before its first request.
            synced = pool.submit(catalogs.sync_all)
            engine = Engine(
                resolve_model(config.model or None), engine_config(config), size=sizer
            )  # MemoryRefused: the model does not fit
            profile = profile_named(config.compute_profile)
            if profile is not None:
                engine.pacer = Pacer(profile)  # before calibrating: the policy's prior is the paced rate
            rates = calibrate(engine)
            config = config.with_(prefill_ms_per_token=rates.prefill_ms_per_token)
            synced.result()
        return cls(
            engine,
            store,
            config,
            catalogs=catalogs,
            background_sync=background_sync,
            keys=keys,
            memory_plan=sizer.plan,
            rates=rates,
        )

    def cachebox_only(self) -> "Board":
        """Turn the board-local tiers off (benchmarks that measure the cache box itself)."""
        self.prefix.context.reuse = False
        self.prefix.ram = None
        self.prefix.flash = None
        return self

    def strategy(self, spec: StrategySpec, prompt: Prompt | None = None) -> Strategy:
        """The strategy that serves ``spec`` here: prefix serving, or schema serving for a PML
        prompt, when exact; a lab strategy opened by its registered module (on first use)."""
        if spec.exact:
            return self.schemas if prompt is not None and prompt.is_schema else self.prefix
        self._check_memory(spec)
        return REGISTRY[spec.name].open(self, spec)

    def opened(self, key: StrategySpec, load: Callable[[], Opened]) -> Opened:
        """What a lab strategy loaded for ``key`` (a second model, a reference engine): loaded on
        first use, kept until the board closes."""
        if key not in self._opened:
            self._opened[key] = load()
        return self._opened[key]

    def serve(self, spec: StrategySpec, prompt: Prompt, options: RunOptions) -> RunResult:
        """Answer ``prompt`` with the strategy ``spec`` names (``inference.serving.strategies``)."""
        strategy = self.strategy(spec, prompt)
        if not spec.exact:  # a lab run may not run on the paced engine at all (a reference engine, a second model)
            return strategy.run(prompt, options)
        with self._paced() as label:
            return label(strategy.run(prompt, options))

    def run(self, prompt, **kwargs) -> RunResult:
        """Serve a prompt (text or segments) by prefix reuse (see inference.serving.prefix); ``tokens=``
        and ``cuts=`` complete it, the other keywords are ``RunOptions``."""
        asked = Prompt.of(prompt, tokens=kwargs.pop("tokens", None), cuts=kwargs.pop("cuts", ()))
        return self.serve(EXACT, asked, RunOptions(**kwargs))

    def run_chat(self, messages, **kwargs):
        """Serve a conversation (role, content) through the model's chat template, cut where its
        turns begin (see inference.engine.chat)."""
        chat = chat_prompt(self.engine, messages)
        return chat, self.serve(EXACT, chat.prompt, RunOptions(**kwargs))

    def follow_up(self, messages, answer: str, *, namespace: str | None = None, upload: bool = True) -> Extension:
        """After a conversation's turn is answered: compute the prefix its next turn shares (the
        answer and the next turn's opening) on that turn's cuts, keep it in the context and share
        it, so the next turn prefills only its new message, on this board or another."""
        prefix = follow_up(self.engine, messages, answer)
        if prefix is None:
            return Extension()
        with self._paced():
            return self.prefix.extend(prefix.tokens, prefix.cuts, namespace=namespace, upload=upload)

    def run_pml(self, schema_source: str, prompt_source: str, **kwargs) -> RunResult:
        """Serve a PML prompt from the schema's cached modules (see inference.serving.schema)."""
        return self.serve(EXACT, Prompt(schema=schema_source, pml=prompt_source), RunOptions(**kwargs))

    @contextmanager
    def _paced(self):
        """Label a run served under a compute profile (emulated) with the time its pacing added."""
        pacer = self.engine.pacer
        before = pacer.total_ms if pacer is not None else 0.0

        def label(result):
            result.breakdown.kernel_class = self.engine.kernels.name  # the code that computed its bits
            if pacer is not None:
                result.breakdown.compute_profile = pacer.profile.emulated_label
                result.breakdown.paced_ms = round(pacer.total_ms - before, 3)
            return result

        yield label

    def _check_memory(self, spec: StrategySpec) -> None:
        """MemoryRefused (a clear error in the run's report) when the lab strategy ``spec`` would
        not fit this board's registered memory next to what it holds now (checked before its
        module is imported: PyTorch alone is 200 MB)."""
        if any(key.name == spec.name and key.aux_layers == spec.aux_layers for key in self._opened):
            return  # loaded already: what it holds is in the board's memory now
        facts = getattr(self.engine, "facts", None)
        if facts is not None:
            strategy = f"{spec.name}:{spec.aux_layers}" if spec.aux_layers is not None else spec.name
            check_lab_strategy(
                strategy,
                facts,
                n_ctx=self.engine.n_ctx,
                memory_mb=self.config.memory_mb,
                rss_mb=ProcessMemory.read().rss_mb,
            )

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
            "kv_cache_mb": plan.parts_mb.get("KV cache")
            if plan is not None
            else None,  # of the plan: what a smaller context frees
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
            "kernel_class": self.engine.kernels.name,
            "threads": self.engine.config.threads(),
            "catalogs": catalogs,
            "ram_tier": self.prefix.ram.status() if self.prefix.ram is not None else None,
            "flash_tier": self.prefix.flash.status() if self.prefix.flash is not None else None,
            "kv_type": self.engine.config.kv_type,
            "codec": self.exchange.codec,
            "compute_profile": self.engine.pacer.profile.emulated_label if self.engine.pacer is not None else "",
            "memory": self.memory(),
            "rates": self.rates.dump() if self.rates is not None else None,
        }

    def close(self) -> None:
        if self._sync_thread is not None:
            self._sync_thread.stop()
        for opened in self._opened.values():
            opened.close()
        self.engine.close()


CALIBRATION_PROMPT_TOKENS = 32  # a short prompt, as llama-bench's: 1.3 s on a paced Pi Zero 2W, ~50 ms here
CALIBRATION_DECODE_TOKENS = 2  # paced to a Pi Zero 2W, ~0.6 s each
CALIBRATION_BUDGET_S = 1.0  # repetitions (at most 3) while they fit: the best one is the board's rate


def calibrate(
    engine: Engine, prompt_tokens: int = CALIBRATION_PROMPT_TOKENS, decode_tokens: int = CALIBRATION_DECODE_TOKENS
) -> BoardRates:
    """This board's prefill and decode cost in ms per token, measured once at start as llama-bench
    does (a fixed prompt, then a few decode steps), under its compute profile when one paces it.
    Repeated while it fits ``CALIBRATION_BUDGET_S`` (a fast board, 3 times) and the best kept: a
    board starting next to other work measures its own speed, not its neighbours' load. The
    breakeven policy's prior, and what its heartbeats tell the router."""
    sample = (engine.tokenize("The quick brown fox jumps over the lazy dog. " * 8, add_bos=True) * 2)[:prompt_tokens]
    prefills: list[float] = []
    steps: list[float] = []
    began = time.perf_counter()
    with engine.lock:
        while len(prefills) < 3 and (not prefills or time.perf_counter() - began < CALIBRATION_BUDGET_S / 2):
            engine.remove(engine.scratch_seq)
            try:
                started = time.perf_counter()
                logits = engine.prefill(sample, 0, seq=engine.scratch_seq, logits_at={len(sample) - 1})
                prefills.append((time.perf_counter() - started) * 1000.0)
                token = int(logits[len(sample) - 1].argmax())
                for position in range(len(sample), len(sample) + decode_tokens):
                    started = time.perf_counter()
                    token = int(engine.decode_one(token, position, seq=engine.scratch_seq).argmax())
                    steps.append((time.perf_counter() - started) * 1000.0)
            finally:
                engine.remove(engine.scratch_seq)
    pacer = engine.pacer
    return BoardRates(
        prefill_ms_per_token=round(min(prefills) / len(sample), 4),
        decode_ms_per_token=round(min(steps), 4) if steps else DEFAULT_DECODE_MS_PER_TOKEN,
        prompt_tokens=len(sample),
        decode_tokens=len(steps),
        compute_profile=pacer.profile.name if pacer is not None else "",
    )


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
