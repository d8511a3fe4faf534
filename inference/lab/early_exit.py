"""Early exit with KV fill (seed 002) on the reference engine, and as a board strategy.

While decoding, a token may leave the network after an intermediate layer once a confidence
measure passes a threshold. The keys and values of the layers it skipped are then filled from
the exit layer's hidden state, so a later token that goes deeper still finds every position in
every layer's cache. Sequences decoded together exit at a layer only when every one of them is
confident (batch-synchronised exit).

Here, training-free, on Gemma-3 270M (18 layers):
- exits after a few layers (``DEFAULT_EXITS``); the exit head is the model's own final norm and
  tied output embedding applied to the exit layer's residual stream (head ``plain``, no training),
  or the same head after a small linear adapter per exit (head ``lens``: x + [x, 1] W, W of
  641 x 640 fitted by closed-form ridge regression on the lab's calibration text so that it
  predicts the last layer's residual stream; a "tuned lens"). Plain exits before layer 12 agree
  with the full model's token almost never on this model; the lens lifts layer 12 from ~0.44 to
  ~0.69 agreement (teacher-forced, 8 MMLU prompts);
- confidence ``top-prob``: the exit head's largest softmax probability; ``similarity``: cosine
  between the residual stream entering and leaving the exit layer. As in the paper, a sequence
  that was confident at one exit stays confident for the rest of the step;
- KV fill: each skipped layer's K and V from the exit hidden state through that layer's own
  attention norm, k/v projections, k-norm and RoPE (one projection pair per skipped layer).
  ``kv_fill=False`` leaves those cells out instead: a later, deeper token cannot see the exited
  position at those layers (what the paper's fill is for);
- prefill is full depth over every prompt token but the last; the last prompt token is the first
  decode step, so every answer token (the first one, an MMLU letter, too) may exit, as every
  output token of the paper's decoder may.

Costs (float32, CPU, one token): the 18 blocks read ~0.4 GB of weights, the exit/output head
~0.67 GB (262k-word vocabulary x 640). The head costs more than every layer an exit can skip:
``similarity`` costs a dot product per exit tried, ``top-prob`` a whole head per exit tried (the
one that exits doubles as the output head; each one that does not is pure overhead).

An exited state is approximate: the strategy runs on the reference engine only, never touches
the board's llama.cpp context, and never reads or writes the cache box.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from inference.serving.run import FirstToken, RunResult, RunState, ServingStrategy, Tokens, ms_since, prompt_tokens
from inference.serving.strategies import StrategySpec

from .array_file import load_arrays, save_arrays
from .kv_prediction import lab_dir

try:  # the lab extra; without it this module still imports (a run then says what to install)
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - depends on the optional extra
    torch = F = None

MEASURES = ("top-prob", "similarity")
HEADS = ("plain", "lens")
DEFAULT_EXITS = (12, 14, 16)  # exits after this many of the 18 layers (plain exits below 12 are useless here)
STRATEGY_PREFIX = "early-exit"
LENS_FORMAT = "edgecache-exit-lens-1"


@dataclass(frozen=True)
class ExitPolicy:
    """When a decode step may stop early. ``exits``: depths (layers run) where confidence is
    checked, ascending, each below the model's depth; ``threshold``: a sequence is confident at
    an exit when its measure reaches it."""

    measure: str
    threshold: float
    exits: tuple[int, ...] = DEFAULT_EXITS
    kv_fill: bool = True
    head: str = "plain"

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise ValueError(f"unknown confidence measure {self.measure!r}: use {' or '.join(MEASURES)}")
        if self.head not in HEADS:
            raise ValueError(f"unknown exit head {self.head!r}: use {' or '.join(HEADS)}")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"the threshold is a probability or a cosine in [0, 1], got {self.threshold}")
        if not self.exits or list(self.exits) != sorted(set(self.exits)) or self.exits[0] < 1:
            raise ValueError(f"exits must be distinct depths >= 1 in ascending order, got {self.exits}")

    @property
    def label(self) -> str:
        return strategy_name(self)

    @classmethod
    def of(cls, spec: StrategySpec) -> "ExitPolicy":
        """The policy an ``early-exit:MEASURE:THRESHOLD[:lens]`` strategy names (``inference.serving.strategies``)."""
        return cls(spec.measure, spec.threshold, head=spec.head)


def strategy_name(policy: ExitPolicy) -> str:
    """How a run names the strategy that answered it, e.g. ``early-exit(similarity>=0.98)``."""
    head = ", lens" if policy.head == "lens" else ""
    exits = "" if policy.exits == DEFAULT_EXITS else f", exits {'/'.join(map(str, policy.exits))}"
    fill = "" if policy.kv_fill else ", no KV fill"
    return f"{STRATEGY_PREFIX}({policy.measure}>={policy.threshold:g}{head}{exits}{fill})"


def _need_torch() -> None:
    if torch is None:
        raise ImportError("early exit runs on the lab's reference engine: pip install -e '.[lab]' (torch, gguf)")


class StrategyUnavailable(ValueError):
    """This board cannot run early exit (no lab extra: torch, gguf)."""


class LensFileError(ValueError):
    """An exit-adapter file that is missing, damaged, or made for another model or other exits."""


@dataclass
class ExitLens:
    """Per exit depth, a linear adapter on the residual stream: ``x + [x, 1] @ weights[depth]``
    ((n_embd + 1) x n_embd, float32), fitted to predict the last layer's residual stream."""

    fingerprint: str  # SHA-256 of the GGUF it was fitted for
    weights: dict[int, np.ndarray]
    calibration: dict

    @property
    def depths(self) -> tuple[int, ...]:
        return tuple(sorted(self.weights))

    def apply(self, depth: int, x: "torch.Tensor") -> "torch.Tensor":
        if depth not in self.weights:
            raise LensFileError(f"no exit adapter for depth {depth} (fitted for {self.depths})")
        w = self._tensors()[depth]
        return x + x @ w[:-1] + w[-1]

    def _tensors(self) -> dict:
        if getattr(self, "_cached", None) is None:
            self._cached = {depth: torch.from_numpy(array) for depth, array in self.weights.items()}
        return self._cached

    def save(self, path: str | Path) -> Path:
        depths = self.depths
        return save_arrays(
            path,
            format=np.array(LENS_FORMAT),
            fingerprint=np.array(self.fingerprint),
            depths=np.array(depths, dtype=np.int64),
            weights=np.stack([self.weights[d] for d in depths]).astype(np.float32),
            calibration=np.array(json.dumps(self.calibration)),
        )

    @classmethod
    def load(cls, path: str | Path, *, fingerprint: str) -> "ExitLens":
        """Read and check an adapter file; refuses (LensFileError) anything it cannot trust."""
        arrays = load_arrays(
            path,
            error=LensFileError,
            what="exit-adapter file",
            fit_hint="fit them with `python manage.py bench lab-exit` (needs the lab extra)",
            format=LENS_FORMAT,
            fingerprint=fingerprint,
            needed={"depths", "weights", "calibration"},
        )
        depths, weights = arrays["depths"], arrays["weights"]
        if (
            depths.dtype != np.int64
            or depths.ndim != 1
            or weights.dtype != np.float32
            or weights.ndim != 3
            or weights.shape[0] != depths.shape[0]
            or weights.shape[1] != weights.shape[2] + 1
        ):
            raise LensFileError(
                f"{path}: depths {depths.dtype} {depths.shape} and weights {weights.dtype} {weights.shape} do not fit together"
            )
        if not np.all(np.isfinite(weights)):
            raise LensFileError(f"{path}: weights hold NaN or infinite values")
        calibration = arrays["calibration"]
        return cls(fingerprint, {int(d): weights[i] for i, d in enumerate(depths)}, calibration)


def lens_path(directory: str | Path, fingerprint: str) -> Path:
    return Path(directory) / f"exit-lens-{fingerprint[:16]}.npz"


class SequenceCache:
    """One sequence's keys (norm and RoPE applied, float16-rounded) and values per layer, each
    layer with the positions it holds and which of them a KV fill wrote (approximate cells).

    Layers may hold different positions: an exit without KV fill leaves deeper layers without the
    exited position. Buffers grow by doubling; ``view`` copies nothing."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, capacity: int = 64):
        _need_torch()
        self.k = [torch.empty(capacity, n_head_kv, head_dim) for _ in range(n_layer)]
        self.v = [torch.empty(capacity, n_head_kv, head_dim) for _ in range(n_layer)]
        self.pos = [torch.empty(capacity, dtype=torch.int64) for _ in range(n_layer)]
        self.fill = [torch.zeros(capacity, dtype=torch.bool) for _ in range(n_layer)]
        self.length = [0] * n_layer
        self.next_position = 0  # where this sequence's next token goes

    @classmethod
    def from_kv(cls, cache, spare: int = 64) -> "SequenceCache":
        """From the reference engine's ``KVCache`` (every layer at every position), with room for ``spare`` more."""
        first = next(layer for layer in cache.layers if layer is not None)
        n = len(cache)
        made = cls(len(cache.layers), first.k.shape[1], first.k.shape[2], n + spare)
        for layer, held in enumerate(cache.layers):
            made.k[layer][:n] = held.k
            made.v[layer][:n] = held.v
            made.pos[layer][:n] = cache.positions
            made.length[layer] = n
        made.next_position = int(cache.positions.max()) + 1 if n else 0
        return made

    @property
    def n_layer(self) -> int:
        return len(self.k)

    def append(self, layer: int, k: "torch.Tensor", v: "torch.Tensor", position: int, filled: bool) -> None:
        """One cell (k and v: (n_head_kv, head_dim)) at ``position``."""
        at = self.length[layer]
        if at == self.k[layer].shape[0]:
            self._grow(layer)
        self.k[layer][at] = k
        self.v[layer][at] = v
        self.pos[layer][at] = position
        self.fill[layer][at] = filled
        self.length[layer] = at + 1

    def _grow(self, layer: int) -> None:
        for buffers in (self.k, self.v, self.pos, self.fill):
            old = buffers[layer]
            grown = torch.zeros((2 * old.shape[0], *old.shape[1:]), dtype=old.dtype)
            grown[: old.shape[0]] = old
            buffers[layer] = grown

    def view(self, layer: int):
        """(keys, values, positions) held by ``layer``: views, no copy."""
        n = self.length[layer]
        return self.k[layer][:n], self.v[layer][:n], self.pos[layer][:n]

    def positions(self, layer: int) -> list[int]:
        return self.pos[layer][: self.length[layer]].tolist()

    def filled_positions(self, layer: int) -> list[int]:
        n = self.length[layer]
        return self.pos[layer][:n][self.fill[layer][:n]].tolist()

    def clone(self) -> "SequenceCache":
        made = object.__new__(SequenceCache)
        made.k, made.v = [t.clone() for t in self.k], [t.clone() for t in self.v]
        made.pos, made.fill = [t.clone() for t in self.pos], [t.clone() for t in self.fill]
        made.length, made.next_position = list(self.length), self.next_position
        return made


@dataclass
class Step:
    """One decode step of a batch: each sequence's logits (B, n_vocab), the depth the batch ran
    (n_layer: no exit), and for each sequence the first depth it was confident at (n_layer: never)."""

    logits: "torch.Tensor"
    depth: int
    ready: list[int]
    scores: dict[int, list[float]] = field(default_factory=dict)  # exit depth -> each sequence's measure there


@dataclass
class Generation:
    """Greedy tokens of a batch, step by step, with each step's depth and the decode time."""

    tokens: list[list[int]]  # per sequence
    depths: list[int]  # per step (the batch's)
    ready: list[list[int]]  # per step, per sequence: first confident depth
    decode_s: float  # wall clock
    decode_cpu_s: float  # this process's CPU time: what the decoding cost, whoever else shares the core


class EarlyExitDecoder:
    """Batched decoding with early exits on a ``ReferenceModel`` (float32, CPU).

    ``step`` runs one token for each of B sequences (their own caches, any lengths): the matrix
    products are shared by the batch (its weights are read once), attention runs per sequence."""

    def __init__(self, reference, lens: ExitLens | None = None):
        _need_torch()
        self.model = reference
        self.config = reference.config
        self.lens = lens

    def check(self, policy: ExitPolicy | None) -> None:
        """Refuse a policy this decoder cannot run (exits past the model, adapters it lacks)."""
        if policy is None:
            return
        if policy.exits[-1] >= self.config.n_layer:
            raise ValueError(f"exits must be below the model's {self.config.n_layer} layers, got {policy.exits}")
        if policy.head == "lens":
            if self.lens is None:
                raise LensFileError(
                    "this policy exits through fitted adapters (':lens') and none are loaded: fit them with `python manage.py bench lab-exit`"
                )
            if missing := set(policy.exits) - set(self.lens.depths):
                raise LensFileError(
                    f"the exit adapters were fitted for depths {self.lens.depths}, not {sorted(missing)}"
                )

    def exit_logits(self, x: "torch.Tensor", depth: int, policy: ExitPolicy) -> "torch.Tensor":
        """The exit head at ``depth``: final norm and output embedding, after the adapter for ``lens``."""
        if policy.head == "lens":
            x = self.lens.apply(depth, x)
        return self.model.output_logits(x)

    # -- prefill --------------------------------------------------------------------------
    def prefill(self, tokens: Sequence[int], spare: int = 64) -> SequenceCache:
        """Full-depth prefill of ``tokens`` (every layer, every position): the cache decoding starts from."""
        if not tokens:
            raise ValueError("prefill needs at least one token (the BOS)")
        result = self.model.forward(list(tokens), logits_at=[])
        return SequenceCache.from_kv(result.cache, spare)

    # -- one step --------------------------------------------------------------------------
    def step(self, tokens: Sequence[int], caches: Sequence[SequenceCache], policy: ExitPolicy | None) -> Step:
        """One token per sequence. ``policy`` None: full depth, no confidence computed at all."""
        self.check(policy)
        with torch.no_grad():
            return self._step(tokens, caches, policy)

    def _step(self, tokens: Sequence[int], caches: Sequence[SequenceCache], policy: ExitPolicy | None) -> Step:
        m, c = self.model, self.config
        batch = len(tokens)
        if batch != len(caches) or batch == 0:
            raise ValueError(f"{batch} tokens for {len(caches)} caches")
        q_pos = torch.tensor([cache.next_position for cache in caches], dtype=torch.int64)
        x = m.embed(torch.as_tensor(list(tokens), dtype=torch.int64))
        exits = set(policy.exits) if policy is not None else set()
        confident = torch.zeros(batch, dtype=torch.bool)
        ready = [c.n_layer] * batch
        scores: dict[int, list[float]] = {}
        logits = None
        depth = c.n_layer
        for layer in range(c.n_layer):
            entering = x
            x = m.block(layer, x, q_pos, self._attend_each(layer, caches, q_pos))
            reached = layer + 1
            if reached not in exits or reached >= c.n_layer:
                continue
            score, logits = self.confidence(entering, x, reached, policy)
            scores[reached] = score.tolist()
            now = score >= policy.threshold
            for index in torch.nonzero(now & ~confident).flatten().tolist():
                ready[index] = reached
            confident |= now  # once confident, a sequence stays so for this step (as the paper)
            if bool(confident.all()):
                depth = reached
                break
            logits = None
        if depth < c.n_layer and policy.kv_fill:
            for layer in range(depth, c.n_layer):
                k, v = self.fill_keys_values(x, q_pos, layer)
                for index, cache in enumerate(caches):
                    cache.append(layer, k[index], v[index], int(q_pos[index]), filled=True)
        if logits is None:
            logits = self.exit_logits(x, depth, policy) if depth < c.n_layer else m.output_logits(x)
        for cache in caches:
            cache.next_position += 1
        return Step(logits, depth, ready, scores)

    def confidence(self, entering: "torch.Tensor", x: "torch.Tensor", depth: int, policy: ExitPolicy):
        """Each sequence's confidence at exit ``depth`` (B,), and the exit head's logits when the
        measure needed them (top-prob; None for similarity). ``entering``/``x``: the residual
        stream into and out of the exit layer."""
        if policy.measure == "top-prob":
            logits = self.exit_logits(x, depth, policy)
            return torch.exp(logits.amax(-1) - torch.logsumexp(logits, -1)), logits
        return F.cosine_similarity(entering, x, dim=-1), None

    def fill_keys_values(self, x: "torch.Tensor", q_pos: "torch.Tensor", layer: int):
        """KV fill: ``layer``'s keys (norm, RoPE) and values computed from the exit hidden state
        ``x`` (B, n_embd) through the layer's own attention norm and k/v projections."""
        m = self.model
        _, k_normed, v = m.key_value(layer, m.rms_norm(x, m.w(layer, "attn_norm")))
        return m.f16(m.rope(k_normed, q_pos, layer)), m.f16(v)

    def _attend_each(self, layer: int, caches: Sequence[SequenceCache], q_pos: "torch.Tensor"):
        m = self.model

        def attend(q, k, v):
            out = []
            for index, cache in enumerate(caches):
                cache.append(layer, k[index], v[index], int(q_pos[index]), filled=False)
                keys, values, positions = cache.view(layer)
                allowed = m.allowed(layer, q_pos[index : index + 1], positions)
                out.append(m._attention(q[index : index + 1], keys, values, allowed))
            return torch.cat(out)

        return attend

    # -- greedy generation (benchmarks, tests) -------------------------------------------------
    def decode(
        self, caches: Sequence[SequenceCache], first: Sequence[int], steps: int, policy: ExitPolicy | None
    ) -> Generation:
        """``steps`` greedy tokens for each sequence, fed ``first`` (each prompt's last token)
        first. Fixed length: an end-of-generation token is just another token here."""
        tokens = [[] for _ in caches]
        depths, ready = [], []
        current = list(first)
        started, started_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            step = self.step(current, caches, policy)
            current = step.logits.argmax(-1).tolist()
            for index, token in enumerate(current):
                tokens[index].append(token)
            depths.append(step.depth)
            ready.append(step.ready)
        return Generation(tokens, depths, ready, time.perf_counter() - started, time.process_time() - started_cpu)

    def generate(self, prompts: Sequence[Sequence[int]], steps: int, policy: ExitPolicy | None) -> Generation:
        """Prefill each prompt but its last token (full depth), then decode the batch together."""
        caches = [self.prefill(prompt[:-1], spare=steps + 1) for prompt in prompts]
        return self.decode(caches, [prompt[-1] for prompt in prompts], steps, policy)


# -- the board strategy ------------------------------------------------------------------------
class _ExitEngine:
    """What ``decode_answer`` needs of an engine, decoding through the early-exit decoder; the
    tokenizer is the board's (llama.cpp), which holds no state."""

    def __init__(self, engine, decoder: EarlyExitDecoder, cache: SequenceCache, policy: ExitPolicy):
        self.engine, self.decoder, self.cache, self.policy = engine, decoder, cache, policy
        self.depths: list[int] = []

    def decode_one(self, token: int, position: int) -> np.ndarray:
        if position != self.cache.next_position:
            raise RuntimeError(f"decode at {position}, the cache ends at {self.cache.next_position}")
        step = self.decoder.step([token], [self.cache], self.policy)
        self.depths.append(step.depth)
        return step.logits[0].numpy()

    def is_end_of_generation(self, token: int) -> bool:
        return self.engine.is_end_of_generation(token)

    def detokenize(self, tokens: list[int]) -> str:
        return self.engine.detokenize(tokens)


class EarlyExitServing:
    """Early exits on the reference engine of the board's model (lab, approximate). Loads ~1 GB of
    float32 weights once; ``with_policy`` gives the strategy that serves with one policy. The
    board's llama.cpp context and the cache box are never touched, so no exited state can be
    stored or reused as an exact entry."""

    def __init__(self, engine, reference, lens: ExitLens | None = None):
        self.engine = engine
        self.decoder = EarlyExitDecoder(reference, lens)
        self.last_depths: list[int] = []  # the last run's depth per answer token (tests, reports)

    @classmethod
    def open(cls, engine, directory: str | Path | None = None) -> "EarlyExitServing":
        """The reference engine of ``engine``'s GGUF (dequantized: ~15 s, ~1 GB), on the board's
        threads, with the exit adapters fitted for it when ``bench lab-exit`` left them in
        ``directory`` (default ``$EDGECACHE_HOME/lab``)."""

        try:
            # lazy: the lab extra (torch) is optional on a board: refused below without it
            from inference.lab.reference import ReferenceModel
        except ImportError as exc:  # a board without the lab extra: the run says so, the board goes on
            raise StrategyUnavailable(str(exc)) from None
        model = engine.model_file
        path = lens_path(directory or lab_dir(), model.sha256)
        lens = ExitLens.load(path, fingerprint=model.sha256) if path.exists() else None
        return cls(engine, ReferenceModel.load(model.path, threads=engine.config.threads()), lens)

    def close(self) -> None:
        pass  # nothing but memory

    def with_policy(self, policy: ExitPolicy) -> "PolicyRunner":
        """The strategy that serves with ``policy`` (refused now if this decoder cannot run it)."""
        self.decoder.check(policy)
        return PolicyRunner(self, policy)


class PolicyRunner(ServingStrategy[Tokens]):
    """Early exit with one ``ExitPolicy``: prefill at full depth on the reference engine, then every
    answer token (the first one too: the prompt's last token is the first decode step) may exit."""

    approximate = True

    def __init__(self, serving: EarlyExitServing, policy: ExitPolicy):
        self.serving, self.policy = serving, policy
        self.engine = (
            serving.engine
        )  # its tokenizer (llama.cpp's, which holds no state) and its lock: one run at a time
        self.label = strategy_name(policy)

    def prepare(self, run: RunState) -> Tokens:
        return Tokens(prompt_tokens(self.engine, run.prompt))

    def first_token(self, run: RunState, prompt: Tokens) -> FirstToken:
        decoder, tokens, n = self.serving.decoder, prompt.tokens, prompt.prompt_tokens
        mark = time.perf_counter()
        cache = (
            decoder.prefill(tokens[:-1], spare=run.options.max_tokens + 1)
            if n > 1
            else SequenceCache(decoder.config.n_layer, decoder.config.n_head_kv, decoder.config.head_dim)
        )
        run.breakdown.prefill_ms = ms_since(mark)
        exiting = _ExitEngine(self.engine, decoder, cache, self.policy)
        mark = time.perf_counter()
        logits = exiting.decode_one(tokens[-1], n - 1)  # the first answer token is a decode step: it may exit
        run.breakdown.decode_ms = ms_since(mark)
        return FirstToken(logits, position=n, decoder=exiting)

    def finish(self, run: RunState, prompt: Tokens, first: FirstToken, result: RunResult) -> None:
        self.serving.last_depths = first.decoder.depths


def open_strategy(board, spec: StrategySpec) -> PolicyRunner:
    """Early exit under the policy ``spec`` names, decoding on the reference engine of this board's
    model (loaded on first use: ~15 s, ~1 GB, shared by every policy), with the exit adapters
    ``bench lab-exit`` fitted if present. Never touches the context or the cache box."""
    serving = board.opened(StrategySpec(STRATEGY_PREFIX), lambda: EarlyExitServing.open(board.engine))
    return serving.with_policy(ExitPolicy.of(spec))
