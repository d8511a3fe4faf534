"""A board's memory budget: what its process may hold, and how its buffers are sized to fit.

A board registers its memory (the Device's ``memory_mb``, in its registry record). Of it, the
board's process may hold ``RSS_SHARE`` (the rest is the operating system's: a Pi Zero 2W's 512 MB
leave it 400). Where that goes, measured on this model (Gemma-3 270M Q4_K_M, 262,144-token
vocabulary) with ``bench footprint``:

- the mapped GGUF file, every page resident (each token reads every layer, and each output
  reads the whole tied embedding: 178 MB of the 253);
- the interpreter, a board's imports and their shared libraries (``RUNTIME_MB``);
- llama.cpp's vocabulary and model structures (about 150 bytes per vocabulary entry);
- the KV cache: n_ctx x the state bytes per token, all of it touched when the context is made;
- the compute buffer: llama.cpp reserves n_ubatch x vocabulary x 4 bytes for logits it never
  computes (514 MB at n_ubatch 512, 129 MB at 128; virtual, barely touched), and the output
  buffer (n_seq_max x vocabulary x 4 bytes);
- llama.cpp's repacked copies of some weights (``REPACK_SHARE`` of the file), only when asked for:
  they change the bits (``inference.engine.llama.EngineConfig.repack``);
- the states one run moves (fetched, restored, exported) and the RAM tier.

``plan_memory`` picks, within the budget, the largest context (up to what was asked), n_ubatch
on the batch grid (a prefill is cut there anyway, so the bits are the cold run's), repacked
weights when asked for and they fit, and gives the rest to the RAM tier: on a small board the cache box is
its memory. The estimate is only the plan: as entries come in, the RAM tier also keeps the whole
process under the budget by its RSS as Linux counts it (``local_tier.RamEntries``). When not even the smallest context fits, the board refuses (``MemoryRefused``) with
the numbers. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

MB = 1024 * 1024
RSS_SHARE = 0.78  # of the registered memory, what the board's process aims to hold (512 MB -> 400 MB)
OS_RESERVE_MB = 64  # what the operating system needs at least: a board whose estimate leaves less refuses
RUNTIME_MB = 93.0  # interpreter + a board's imports (numpy, llama.cpp's bindings, redis, celery, pydantic, cryptography) + their libraries
VOCAB_BYTES_PER_ENTRY = 150  # llama.cpp's vocabulary structures (token texts, maps): 38 MB for 262,144 entries
COMPUTE_TOUCHED_MB = 12.0  # the part of the compute buffer a grid batch writes (measured at n_ubatch 128 and 512)
REPACK_SHARE = 0.053  # llama.cpp's repacked weights (q4_K_8x8 here), as a share of the file: 12.7 MB of 241
RUN_WORKING_TOKENS = (
    512  # a run holds the exported states of a prompt this long (or n_ctx, if smaller) until they are sent ...
)
UPLOAD_COPIES_TOKENS = 256  # ... plus a sealed and a packed copy of one range (128 tokens) in flight
MIN_N_CTX = 1024  # a smaller context serves no five-shot MMLU prompt
MAX_RAM_TIER_BYTES = 128 * MB  # the RAM tier's default where memory is plenty (or unknown)
MIN_RAM_TIER_BYTES = 16 * MB  # below this (a few ranges), no RAM tier: the cache box serves
N_CTX_STEP = 256  # llama.cpp pads the context to this


class MemoryRefused(ValueError):
    """The board's registered memory cannot hold what it was asked to run; the message gives the numbers."""


@dataclass(frozen=True)
class ModelFacts:
    """What the memory of a loaded model depends on (read from the GGUF by the engine)."""

    file_bytes: int
    n_params: int
    n_vocab: int
    kv_bytes_per_token: int  # K and V of every layer for one position, at the KV type in use
    n_seq_max: int = 4

    @property
    def file_mb(self) -> float:
        return self.file_bytes / MB


@dataclass(frozen=True)
class MemoryPlan:
    memory_mb: int
    budget_mb: float  # the RSS the board aims to stay under
    n_ctx: int
    n_ubatch: int
    repack: bool
    ram_tier_bytes: int
    parts_mb: dict[str, float] = field(default_factory=dict)  # the estimate, by part

    @property
    def estimate_mb(self) -> float:
        return round(sum(self.parts_mb.values()), 1)

    @property
    def within_budget(self) -> bool:
        return not self.memory_mb or self.estimate_mb <= self.budget_mb

    def as_dict(self) -> dict:
        return {**asdict(self), "estimate_mb": self.estimate_mb, "within_budget": self.within_budget}


def budget_mb(memory_mb: int) -> float:
    """The RSS a board registered with ``memory_mb`` aims to stay under."""
    return round(memory_mb * RSS_SHARE, 1)


def limit_mb(memory_mb: int) -> float:
    """The most a board registered with ``memory_mb`` can hold at all (the OS keeps the rest)."""
    return float(max(0, memory_mb - OS_RESERVE_MB))


def fixed_parts(
    facts: ModelFacts, n_ctx: int, *, repack: bool, state_bytes_per_token: float | None = None
) -> dict[str, float]:
    """Estimated MB of each part of a board at ``n_ctx`` (without its RAM tier)."""
    state = state_bytes_per_token or facts.kv_bytes_per_token
    return {
        "model file (mapped)": round(facts.file_mb, 1),
        "runtime (interpreter, imports, libraries)": RUNTIME_MB,
        "llama.cpp vocabulary and model structures": round(facts.n_vocab * VOCAB_BYTES_PER_ENTRY / MB, 1),
        "repacked weights": round(facts.file_mb * REPACK_SHARE, 1) if repack else 0.0,
        "KV cache": round(n_ctx * facts.kv_bytes_per_token / MB, 1),
        "compute and output buffers": round(COMPUTE_TOUCHED_MB + facts.n_seq_max * facts.n_vocab * 4 / MB, 1),
        "a run's states in flight": round((min(n_ctx, RUN_WORKING_TOKENS) + UPLOAD_COPIES_TOKENS) * state / MB, 1),
    }


def plan_memory(
    memory_mb: int, facts: ModelFacts, *, n_ctx: int, grid: int, ram_tier_bytes: int | None = None, repack: bool = False
) -> MemoryPlan:
    """Size a board registered with ``memory_mb`` for ``facts``' model.

    ``n_ctx``: the context asked for; the largest one within the budget is taken (``repack``:
    repacked weights if they fit too), else the smallest (``MIN_N_CTX``) when it fits the memory at
    all: the plan then says it is over budget. ``grid``: the batch grid (n_ubatch is set to it,
    or to its largest divisor up to 512). ``ram_tier_bytes``: an explicit RAM tier (None: what
    the budget leaves, up to ``MAX_RAM_TIER_BYTES``). Raises MemoryRefused, with the numbers,
    when the model does not fit even at the smallest context.
    """
    budget, limit = budget_mb(memory_mb), limit_mb(memory_mb)
    n_ubatch = _ubatch_for(grid)
    top = max(n_ctx, MIN_N_CTX)
    contexts = list(range(top // N_CTX_STEP * N_CTX_STEP, MIN_N_CTX - 1, -N_CTX_STEP)) or [MIN_N_CTX]
    for size in contexts:
        for repacked in (True, False) if repack else (False,):
            parts = fixed_parts(facts, size, repack=repacked)
            left_mb = budget - sum(parts.values())
            if left_mb >= 0:
                return _with_ram_tier(
                    MemoryPlan(memory_mb, budget, size, n_ubatch, repacked, 0, parts), left_mb, ram_tier_bytes
                )
    smallest = fixed_parts(facts, MIN_N_CTX, repack=False)
    needed = sum(smallest.values())
    if needed <= limit:
        return _with_ram_tier(
            MemoryPlan(memory_mb, budget, MIN_N_CTX, n_ubatch, False, 0, smallest), 0.0, ram_tier_bytes
        )
    biggest = sorted(smallest.items(), key=lambda item: -item[1])[:3]
    raise MemoryRefused(
        f"this board is registered with {memory_mb} MB, of which its process can hold at most {limit:.0f} MB, but the model "
        f"needs about {needed:.0f} MB at the smallest context ({MIN_N_CTX} tokens): "
        + ", ".join(f"{name} {mb:.0f} MB" for name, mb in biggest)
        + f"; register the board with at least {needed + OS_RESERVE_MB:.0f} MB, or serve a smaller model"
    )


def _with_ram_tier(plan: MemoryPlan, left_mb: float, ram_tier_bytes: int | None) -> MemoryPlan:
    if ram_tier_bytes is None:
        tier = min(MAX_RAM_TIER_BYTES, int(max(0.0, left_mb) * MB))
        tier = tier if tier >= MIN_RAM_TIER_BYTES else 0
    else:
        tier = ram_tier_bytes
    return replace(plan, ram_tier_bytes=tier, parts_mb={**plan.parts_mb, "RAM tier": round(tier / MB, 1)})


def unsized_plan(
    facts: ModelFacts, *, n_ctx: int, n_ubatch: int, ram_tier_bytes: int | None, repack: bool = False
) -> MemoryPlan:
    """What a board whose memory is unknown holds: the context asked for, every buffer at its default."""
    tier = MAX_RAM_TIER_BYTES if ram_tier_bytes is None else ram_tier_bytes
    parts = fixed_parts(facts, n_ctx, repack=repack)
    parts["RAM tier"] = round(tier / MB, 1)
    return MemoryPlan(0, 0.0, n_ctx, n_ubatch, repack, tier, parts)


def _ubatch_for(grid: int) -> int:
    """The largest divisor of the grid no larger than 512: every grid batch is whole ubatches, so
    llama.cpp computes the very batches of the cold run."""
    for size in range(min(grid, 512), 0, -1):
        if grid % size == 0:
            return size
    return 1


# -- lab strategies: what they load besides the board's model ------------------------------------------
TORCH_RUNTIME_MB = 200.0  # PyTorch's import (measured: 237 MB RSS for `import torch`, 44 MB of it already a board's)


def lab_strategy_mb(strategy: str, facts: ModelFacts, n_ctx: int) -> tuple[float, str]:
    """(MB, what) a lab strategy loads on first use, besides what the board holds."""
    engine_mb = facts.file_mb + facts.n_vocab * VOCAB_BYTES_PER_ENTRY / MB + n_ctx * facts.kv_bytes_per_token / MB
    if strategy == "early-exit":
        weights = facts.n_params * 4 / MB
        return (
            TORCH_RUNTIME_MB + weights,
            f"PyTorch {TORCH_RUNTIME_MB:.0f} MB and the float32 reference weights {weights:.0f} MB",
        )
    if strategy == "anchors-tuned":
        return engine_mb, f"a second engine for the anchor-tuned GGUF, about {engine_mb:.0f} MB"
    if strategy.startswith("kv-prediction"):
        return engine_mb, f"the auxiliary engine (its GGUF, vocabulary and KV cache), at most {engine_mb:.0f} MB"
    return 0.0, "nothing"


def check_lab_strategy(strategy: str, facts: ModelFacts, *, n_ctx: int, memory_mb: int, rss_mb: float) -> None:
    """Raise MemoryRefused, with the numbers, when loading ``strategy`` would take the board past its budget."""
    if not memory_mb:
        return  # memory not registered: as before, the strategy loads
    needed, what = lab_strategy_mb(strategy, facts, n_ctx)
    budget = budget_mb(memory_mb)
    if needed and rss_mb + needed > budget:
        raise MemoryRefused(
            f"this board cannot run {strategy}: it needs about {needed:.0f} MB more ({what}), and the board holds "
            f"{rss_mb:.0f} MB of the {budget:.0f} MB its {memory_mb} MB allow; run it on a board with at least "
            f"{(rss_mb + needed) / RSS_SHARE:.0f} MB, or use the exact strategy"
        )
