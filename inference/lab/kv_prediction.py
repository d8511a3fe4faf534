"""KV Prediction (seed 001) as a board strategy: a cheap auxiliary model reads the prompt, linear
predictors turn its KV cache into an approximation of the base model's, and the base model
answers from that approximation.

Here, honestly minimal:
- auxiliary model = the base model's own first k blocks (``truncate``), run by llama.cpp, so
  its keys and values for layers < k are the base model's (exact up to kernel rounding);
- predictor = for each base layer i >= k, one linear map (with bias) from the auxiliary's last
  layer's keys (norm applied, RoPE undone) and values to layer i's keys (before their norm)
  and values, fitted by ridge regression in closed form on calibration text with the
  reference engine (no distillation loss, no training of the auxiliary model: the paper trains
  both end to end with a base-loss + consistency loss);
- serving: auxiliary prefill of the prompt's first n-1 tokens -> its state parsed
  (``state_blob``) -> predicted K (k-norm, RoPE applied) and V for layers >= k, written as
  f16 rows next to the exact ones -> imported into the base context -> the base model decodes
  the last prompt token (the first answer token) and the rest of the answer as usual.

A predicted state is approximate: this strategy never uploads, never reads the cache box and
clears the base context before and after each run, so no exact run restores a predicted cell.
Serving needs numpy and llama.cpp only; fitting needs the lab extra (torch, gguf).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from inference.board.config import edgecache_home
from inference.engine.llama import MAIN_SEQ, Engine, EngineConfig
from inference.engine.model_file import ModelFile, _cached_sha256
from inference.serving.breakdown import Breakdown
from inference.serving.run import FirstToken, RunState, ServingStrategy, Tokens, ms_since, prompt_tokens
from inference.serving.strategies import StrategySpec

from . import state_blob
from .array_file import load_arrays, save_arrays
from .truncate import ensure_truncated

FORMAT = "edgecache-kv-predictor-1"
SECTIONS = 2  # Gemma-3's memory: the global layers' cache, then the sliding-window layers'
_SWA_PATTERN = 6


class PredictorFileError(ValueError):
    """A predictor file that is missing, damaged, or made for another model or k."""


def strategy_name(k: int) -> str:
    return f"kv-prediction({k})"


def rope_np(x: np.ndarray, positions: np.ndarray, base: float, inverse: bool = False) -> np.ndarray:
    """NeoX rotation of ``x`` (cells, heads, d) at ``positions`` in float32 (numpy twin of reference.rope)."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-np.arange(0, half, dtype=np.float64) * 2 / d)
    angles = positions.astype(np.float64)[:, None] * inv_freq[None, :]
    cos = np.cos(angles).astype(np.float32)[:, None, :]
    sin = np.sin(angles).astype(np.float32)[:, None, :]
    if inverse:
        sin = -sin
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


@dataclass
class Predictor:
    """Linear maps from the auxiliary's last-layer K/V to every later layer's K/V."""

    fingerprint: str  # SHA-256 of the base GGUF the maps were fitted for
    k: int  # auxiliary layers (layers < k are exact)
    n_layer: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_base: np.ndarray  # (n_layer,) float64: each layer's RoPE base
    weights: np.ndarray  # (n_layer - k, features + 1, 2 * n_embd_kv) float32; the last input row is the bias
    k_norm: np.ndarray  # (n_layer - k, head_dim) float32: the k-norm weights of each predicted layer
    calibration: dict  # what the maps were fitted on (text source, tokens, ridge)

    @property
    def n_embd_kv(self) -> int:
        return self.n_head_kv * self.head_dim

    @property
    def feature_layer(self) -> int:
        return self.k - 1

    def is_swa(self, layer: int) -> bool:
        return layer % _SWA_PATTERN < _SWA_PATTERN - 1

    # -- features and prediction (pure numpy) -------------------------------------------------
    def features(self, k_roped: np.ndarray, v: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """(cells, 2 * n_embd_kv + 1): the auxiliary's last-layer keys with RoPE undone, values, and 1."""
        cells = k_roped.shape[0]
        k = rope_np(
            k_roped.reshape(cells, self.n_head_kv, self.head_dim).astype(np.float32),
            positions,
            float(self.rope_base[self.feature_layer]),
            inverse=True,
        )
        return np.concatenate(
            [k.reshape(cells, -1), v.reshape(cells, -1).astype(np.float32), np.ones((cells, 1), np.float32)], axis=1
        )

    def predict(self, features: np.ndarray, positions: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """layer -> (K with k-norm and RoPE, V), each (cells, n_embd_kv) float32, for layers k..n_layer-1.

        One matrix product for every layer (features x all maps side by side), one norm, and the
        rotation computed once per RoPE base (Gemma-3 has two)."""
        e, h, d = self.n_embd_kv, self.n_head_kv, self.head_dim
        layers = list(range(self.k, self.n_layer))
        cells = features.shape[0]
        stacked = self.weights.transpose(1, 0, 2).reshape(self.weights.shape[1], -1)
        kv = (features @ stacked).reshape(cells, len(layers), 2 * e)
        k_raw = kv[:, :, :e].reshape(cells, len(layers), h, d)
        k = (
            k_raw
            / np.sqrt(np.mean(k_raw * k_raw, axis=-1, keepdims=True) + self.rms_eps)
            * self.k_norm[None, :, None, :]
        )
        out = {}
        for base in sorted({float(self.rope_base[layer]) for layer in layers}):
            chosen = [index for index, layer in enumerate(layers) if float(self.rope_base[layer]) == base]
            roped = rope_np(k[:, chosen].reshape(cells, len(chosen) * h, d), positions, base).reshape(
                cells, len(chosen), e
            )
            for position, index in enumerate(chosen):
                out[layers[index]] = (roped[:, position], kv[:, index, e:])
        return dict(sorted(out.items()))

    # -- file -----------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        return save_arrays(
            path,
            format=np.array(FORMAT),
            fingerprint=np.array(self.fingerprint),
            shape=np.array([self.k, self.n_layer, self.n_head_kv, self.head_dim], dtype=np.int64),
            rms_eps=np.array(self.rms_eps, dtype=np.float64),
            rope_base=self.rope_base.astype(np.float64),
            weights=self.weights.astype(np.float32),
            k_norm=self.k_norm.astype(np.float32),
            calibration=np.array(json.dumps(self.calibration)),
        )

    @classmethod
    def load(cls, path: str | Path, *, fingerprint: str, k: int) -> "Predictor":
        """Read and check a predictor file; refuses (PredictorFileError) anything it cannot trust."""
        arrays = load_arrays(
            path,
            error=PredictorFileError,
            what="predictor file",
            fit_hint="fit one with `python manage.py bench lab` (needs the lab extra)",
            format=FORMAT,
            fingerprint=fingerprint,
            needed={"shape", "rms_eps", "rope_base", "weights", "k_norm", "calibration"},
        )
        shape = arrays["shape"]
        if shape.dtype != np.int64 or shape.shape != (4,):
            raise PredictorFileError(f"{path}: bad shape record")
        file_k, n_layer, n_head_kv, head_dim = (int(v) for v in shape)
        if file_k != k:
            raise PredictorFileError(f"{path} predicts from {file_k} auxiliary layers, not {k}")
        e = n_head_kv * head_dim
        expected = {
            "weights": ((n_layer - k, 2 * e + 1, 2 * e), np.float32),
            "k_norm": ((n_layer - k, head_dim), np.float32),
            "rope_base": ((n_layer,), np.float64),
        }
        for name, (want_shape, want_dtype) in expected.items():
            array = arrays[name]
            if array.shape != want_shape or array.dtype != want_dtype:
                raise PredictorFileError(
                    f"{path}: {name} is {array.dtype} {array.shape}, expected {np.dtype(want_dtype)} {want_shape}"
                )
            if not np.all(np.isfinite(array)):
                raise PredictorFileError(f"{path}: {name} holds NaN or infinite values")
        calibration = arrays["calibration"]
        return cls(
            fingerprint=fingerprint,
            k=k,
            n_layer=n_layer,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            rms_eps=float(arrays["rms_eps"]),
            rope_base=arrays["rope_base"],
            weights=arrays["weights"],
            k_norm=arrays["k_norm"],
            calibration=calibration,
        )


def lab_dir() -> Path:
    """Where a board keeps its auxiliary GGUFs and predictor files (``$EDGECACHE_HOME/lab``)."""
    return edgecache_home() / "lab"


def predictor_path(directory: str | Path, fingerprint: str, k: int) -> Path:
    return Path(directory) / f"kvp-{fingerprint[:16]}-k{k}.npz"


# -- serving ------------------------------------------------------------------------------------
def export_prefix(engine: Engine, end: int, window: int) -> list[state_blob.SequenceState]:
    """The main sequence's cells of [0, end), as parsed states of at most ``window`` positions
    each (a sliding-window cache only exports the cells its last position still sees)."""
    step = window if window > 0 else end
    return [state_blob.parse(engine.export_range(p0, min(end, p0 + step)), SECTIONS) for p0 in range(0, end, step)]


def merge_sections(
    parts: list[state_blob.SequenceState], section: int
) -> tuple[np.ndarray, list[state_blob.LayerRows]]:
    """One section's positions and per-layer rows, concatenated over consecutive range exports."""
    chosen = [part.sections[section] for part in parts if part.sections[section].cell_count]
    if not chosen:
        return np.zeros(0, np.int32), []
    positions = np.concatenate([s.positions for s in chosen])
    layers = []
    for index in range(len(chosen[0].layers)):
        rows = [s.layers[index] for s in chosen]
        layers.append(
            state_blob.LayerRows(
                rows[0].k_type, np.concatenate([r.k for r in rows]), rows[0].v_type, np.concatenate([r.v for r in rows])
            )
        )
    return positions, layers


def predicted_state(predictor: Predictor, aux_parts: list[state_blob.SequenceState]) -> tuple[bytes, float]:
    """The base model's state for the cells the auxiliary exported: its own rows for layers < k,
    predicted rows for the others. Returns (bytes for ``Engine.import_range``, prediction ms)."""
    started = time.perf_counter()
    groups = state_blob.section_layers(predictor.n_layer, predictor.is_swa)
    aux_groups = state_blob.section_layers(predictor.k, predictor.is_swa)
    merged = [merge_sections(aux_parts, s) for s in range(SECTIONS)]
    # Features come from the auxiliary's last layer, in the section that holds it.
    feature_section = 1 if predictor.is_swa(predictor.feature_layer) else 0
    positions, rows = merged[feature_section]
    feature_rows = rows[aux_groups[feature_section].index(predictor.feature_layer)]
    features = predictor.features(feature_rows.k_f16(), feature_rows.v_f16(), positions)
    predicted = predictor.predict(features, positions)
    prediction_ms = ms_since(started)
    sections = []
    for s in range(SECTIONS):
        aux_positions, aux_rows = merged[s]
        layers = []
        for layer in groups[s]:
            if layer < predictor.k:
                if not np.array_equal(aux_positions, positions):
                    raise state_blob.StateFormatError("auxiliary sections hold different cells")
                layers.append(aux_rows[aux_groups[s].index(layer)])
            else:
                k, v = predicted[layer]
                layers.append(state_blob.LayerRows.from_f16(k, v))
        sections.append(state_blob.Section(positions.copy(), np.zeros_like(positions), False, layers))
    return state_blob.encode(state_blob.SequenceState(0, sections)), prediction_ms


class KVPredictionServing(ServingStrategy[Tokens]):
    """Serves prompts on the base engine from a KV cache predicted from ``k`` auxiliary layers.

    A predicted state is never exchanged, and the base context is cleared before and after each run."""

    approximate = True
    clears_context = True  # no exact run may keep or find predicted cells

    def __init__(self, engine: Engine, predictor: Predictor, aux: Engine):
        if predictor.fingerprint != engine.model_file.sha256:
            raise PredictorFileError("the predictor was fitted for another model")
        if engine.config.kv_type != "f16" or aux.config.kv_type != "f16":
            raise PredictorFileError("KV prediction writes f16 rows: run the board with EDGECACHE_KV_TYPE=f16")
        self.engine, self.predictor, self.aux = engine, predictor, aux
        self.k = predictor.k
        self.label = strategy_name(self.k)

    @classmethod
    def open(cls, engine: Engine, k: int, lab_dir: str | Path) -> "KVPredictionServing":
        """Load the auxiliary GGUF (written on first use) and the predictor file for ``k``."""
        model = engine.model_file
        predictor = Predictor.load(predictor_path(lab_dir, model.sha256, k), fingerprint=model.sha256, k=k)
        aux = open_auxiliary(engine, k, lab_dir)
        return cls(engine, predictor, aux)

    def close(self) -> None:
        self.aux.close()

    def prepare(self, run: RunState) -> Tokens:
        return Tokens(prompt_tokens(self.engine, run.prompt))

    def first_token(self, run: RunState, prompt: Tokens) -> FirstToken:
        """The auxiliary prefill, the predicted state imported, the base model's last prompt token."""
        return FirstToken(self._prefill(prompt.tokens, run.breakdown), position=prompt.prompt_tokens)

    def prefill_logits(self, tokens: Sequence[int]) -> tuple[np.ndarray, Breakdown]:
        """The base model's logits after the prompt, from the predicted cache (benchmarks)."""
        with self.engine.lock:
            breakdown = Breakdown(strategy=strategy_name(self.k))
            self.engine.clear()
            try:
                logits = self._prefill(list(tokens), breakdown).copy()
            finally:
                self.engine.clear()
            return logits, breakdown

    def _prefill(self, tokens: list[int], breakdown: Breakdown) -> np.ndarray:
        """Aux prefill of tokens[:-1] -> predicted state imported -> base decodes the last token."""
        engine, aux = self.engine, self.aux
        n = len(tokens)
        if n > 1:
            mark = time.perf_counter()
            aux.clear()
            aux.prefill(tokens[:-1], 0, logits_at=frozenset())
            parts = export_prefix(aux, n - 1, engine.n_swa)
            aux.clear()
            breakdown.aux_prefill_ms = ms_since(mark)
            blob, breakdown.predict_ms = predicted_state(self.predictor, parts)
            mark = time.perf_counter()
            engine.import_range(blob, seq=MAIN_SEQ)
            breakdown.restore_ms = breakdown.kv_import_ms = ms_since(mark)
            breakdown.state_bytes = len(blob)
        mark = time.perf_counter()
        logits = engine.decode_one(tokens[-1], n - 1)
        base_ms = ms_since(mark)
        breakdown.prefill_ms = breakdown.aux_prefill_ms + base_ms
        return logits


def open_strategy(board, spec: StrategySpec) -> KVPredictionServing:
    """The board's KV prediction strategy with ``spec.aux_layers`` auxiliary layers (opened on first
    use: the auxiliary GGUF and the predictor file from ``$EDGECACHE_HOME/lab``)."""
    return board.opened(spec, lambda: KVPredictionServing.open(board.engine, spec.aux_layers, lab_dir()))


def open_auxiliary(engine: Engine, k: int, lab_dir: str | Path) -> Engine:
    """A llama.cpp engine of the base model's first ``k`` blocks (the GGUF written on first use)."""
    model = engine.model_file
    path = ensure_truncated(model.path, model.sha256, k, Path(lab_dir))
    config = engine.config
    return Engine(
        ModelFile(path, _cached_sha256(path)),
        EngineConfig(
            n_ctx=config.n_ctx, n_batch=config.n_batch, n_threads=config.n_threads, n_seq_max=2, kv_type="f16"
        ),
    )
