"""A thin wrapper over llama.cpp's low-level API: one model per process, one context
with several sequences, explicit positions, and per-sequence state export/import.

Costs, so a reader knows which calls move megabytes:
- ``prefill``: the heavy call (P-decode); runs the model over every token given.
- ``decode_one``: one token through the model (R-decode).
- ``export_range``: copies the KV cells of ``[p0, p1)`` out of the context
  (about 18.4 KB per token for Gemma-3 270M with f16 KV). No model work.
- ``import_range``: copies state bytes back into the context. No model work.
- ``tokenize``/``detokenize``: microseconds to a millisecond.
Never uses ``Llama.save_state()``: it copies n_tokens x vocab floats of logits.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from cachebox.keys import ModelIdentity
from inference.engine.bindings import amx_build, kernel_class
from inference.engine.bindings import llama_cpp as _bindings
from inference.engine.compute_profile import Pacer
from inference.engine.memory_plan import ModelFacts
from inference.engine.model_file import ModelFile

llama_cpp = _bindings()  # the ctypes functions alone (the high-level half of the package loads only if something asks)
LLAMA_BUILD = f"llama-cpp-python {llama_cpp.__version__}"

KV_TYPES = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
    "f32": llama_cpp.GGML_TYPE_F32,
}
KV_BYTES_PER_VALUE = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "f32": 4.0}  # ggml's block sizes
QUANTIZED_KV = frozenset({"q8_0", "q4_0"})  # llama.cpp stores a quantized V cache only with flash attention

# Sequence ids inside the one context: 0 holds the prompt being served; the last
# one is scratch space for moving ranges in and out; those between are work space
# (encoding a prompt module, computing a parameter value with its context).
MAIN_SEQ = 0
WORK_SEQ = 1
CONTEXT_SEQ = 2

# Chat templates llama.cpp has built in, for GGUFs that carry none.
_BUILTIN_TEMPLATES = {"gemma3": b"gemma", "gemma2": b"gemma", "gemma": b"gemma", "llama": b"llama3", "qwen2": b"chatml"}


def batch_spans(start: int, count: int, n_batch: int, cuts=()) -> list[tuple[int, int]]:
    """(offset, size) of each batch that prefills ``count`` tokens from position ``start``:
    a batch ends at every position in ``cuts`` and after at most ``n_batch`` tokens. Pure."""
    ends = sorted({cut - start for cut in cuts if start < cut < start + count})
    spans, offset = [], 0
    for end in ends + [count]:
        while offset < end:
            size = min(n_batch, end - offset)
            spans.append((offset, size))
            offset += size
    return spans


class EngineError(RuntimeError):
    """llama.cpp refused an operation (context full, bad state bytes, ...)."""


_backend_lock = threading.Lock()
_backend_ready = False
_quiet_callback = None


def _quiet_llama() -> None:
    """Route llama.cpp/ggml logging away from the terminal (set before loading anything)."""
    global _backend_ready, _quiet_callback
    with _backend_lock:
        if _backend_ready:
            return
        verbose = os.environ.get("EDGECACHE_LLAMA_LOG") == "1"

        @llama_cpp.llama_log_callback
        def _callback(level, text, user_data):  # pragma: no cover - C callback
            if verbose:
                os.write(2, text)

        _quiet_callback = _callback  # keep a reference for as long as the process lives
        llama_cpp.llama_log_set(_quiet_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        _backend_ready = True


@dataclass(frozen=True)
class EngineConfig:
    n_ctx: int = 4096
    n_batch: int = 512  # the most tokens one llama_decode call takes
    n_threads: int = 0  # 0: every core
    n_seq_max: int = 4
    kv_type: str = "f16"
    n_ubatch: int = 0  # the most tokens llama.cpp computes at once (0: n_batch); sizes its compute buffer
    # llama.cpp's repacked copies of some weights (other kernels, ~5% of the file more memory). Off:
    # they change the bits (the last logits of a 300-token prefill differed by up to 1.29 with and
    # without them, AVX2 build), so boards with and without them would share states that are not
    # each other's cold run; and they saved ~1% of a prefill here. On, the fingerprint says so.
    repack: bool = False

    def threads(self) -> int:
        return self.n_threads or max(1, os.cpu_count() or 1)


class Vocabulary:
    """Tokenizer and chat template of a GGUF (cheap calls). ``Vocabulary.load`` reads the
    vocabulary alone, without the weights: what the control plane needs to lay out schemas."""

    _model = None
    _vocab = None

    @classmethod
    def load(cls, model: ModelFile) -> "Vocabulary":
        _quiet_llama()
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        vocabulary = cls()
        vocabulary._model = llama_cpp.llama_model_load_from_file(str(model.path).encode(), params)
        if not vocabulary._model:
            raise EngineError(f"llama.cpp could not read the vocabulary of {model.path}")
        vocabulary._vocab = llama_cpp.llama_model_get_vocab(vocabulary._model)
        vocabulary.model_file = model
        return vocabulary

    @functools.cached_property
    def digest(self) -> str:
        """16 hex characters naming what tokenizes here: the model file (its vocabulary and chat
        template) and the llama.cpp that reads it. Two vocabularies of one digest give the same
        tokens for every text (``RunRequest.tokenized`` travels under it); the kernels and KV
        type, which change the model's bits and not its tokens, are not part of it."""
        canonical = f"{self.model_file.sha256}\n{LLAMA_BUILD}".encode()
        return hashlib.blake2b(canonical, digest_size=8).hexdigest()

    def tokenize(self, text: str, *, add_bos: bool, special: bool = False) -> list[int]:
        """Token ids of ``text``; ``add_bos`` for the first segment of a prompt only.

        ``special`` parses control tokens such as ``<start_of_turn>``: only for text that
        comes from the chat template, never for what a user wrote.
        """
        raw = text.encode("utf-8")
        capacity = len(raw) + 8
        buffer = (llama_cpp.llama_token * capacity)()
        count = llama_cpp.llama_tokenize(self._vocab, raw, len(raw), buffer, capacity, add_bos, special)
        if count < 0:  # pragma: no cover - capacity is always enough for SentencePiece/BPE
            raise EngineError("tokenizer buffer too small")
        return list(buffer[:count])

    def detokenize(self, tokens: list[int]) -> str:
        if not tokens:
            return ""
        array = (llama_cpp.llama_token * len(tokens))(*tokens)
        capacity = 16 * len(tokens) + 64
        out = ctypes.create_string_buffer(capacity)
        count = llama_cpp.llama_detokenize(self._vocab, array, len(tokens), out, capacity, False, False)
        if count < 0:
            out = ctypes.create_string_buffer(-count)
            count = llama_cpp.llama_detokenize(self._vocab, array, len(tokens), out, -count, False, False)
        return out.raw[:count].decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    @property
    def bos(self) -> int | None:
        """The beginning-of-sequence token, when the model adds one."""
        if not llama_cpp.llama_vocab_get_add_bos(self._vocab):
            return None
        return llama_cpp.llama_vocab_bos(self._vocab)

    def chat_template(self) -> bytes:
        """The model's chat template; a built-in one named after its architecture when it has none."""
        template = llama_cpp.llama_model_chat_template(self._model, None)
        if template:
            return template
        buffer = ctypes.create_string_buffer(64)
        llama_cpp.llama_model_meta_val_str(self._model, b"general.architecture", buffer, 64)
        return _BUILTIN_TEMPLATES.get(buffer.value.decode(errors="replace"), b"chatml")

    def render_chat(self, messages: list[tuple[str, str]], add_generation_prompt: bool) -> str | None:
        """``messages`` through the chat template; None when the template refuses them."""
        array = (llama_cpp.llama_chat_message * len(messages))()
        keep = []
        for index, (role, content) in enumerate(messages):
            role_bytes, content_bytes = role.encode(), content.encode()
            keep += [role_bytes, content_bytes]
            array[index].role = role_bytes
            array[index].content = content_bytes
        size = 1024 + 2 * sum(len(content) for _, content in messages)
        out = ctypes.create_string_buffer(size)
        count = llama_cpp.llama_chat_apply_template(
            self.chat_template(), array, len(messages), add_generation_prompt, out, size
        )
        return out.raw[:count].decode("utf-8", errors="replace") if count > 0 else None


@functools.cache
def _repack_unsafe() -> bool:
    """A llama.cpp compiled with AMX kernels puts weights in AMX buffers with the extra buffer
    types, which crashed it (``inference.engine.bindings.X86_CMAKE_ARGS``): such a build loads without."""
    if not amx_build():
        return False
    logging.getLogger("inference.engine.llama").warning(
        "llama.cpp here was compiled with AMX kernels, which crashed it on the first batch: models load without "
        "repacked weights (slower prefill). Rebuild it without them: `make install` (it checks the build)."
    )
    return True


class Engine(Vocabulary):
    """One model and one context. Not thread-safe: callers serialize (``lock``)."""

    def __init__(
        self,
        model: ModelFile,
        config: EngineConfig = EngineConfig(),
        size: Callable[[ModelFacts], EngineConfig] | None = None,
    ):
        """Load ``model`` (mapped: its pages are the file's) and make its context.

        ``size(facts)``, when given, is called once the model is loaded and before the context
        is made (the KV cache and compute buffers are most of the memory that follows); it
        returns the config to use, or raises (a board refuses a model its memory cannot hold).
        """
        if config.kv_type not in KV_TYPES:
            raise ValueError(f"unknown KV type {config.kv_type!r}; choose one of {', '.join(KV_TYPES)}")
        _quiet_llama()
        if config.repack and _repack_unsafe():
            config = replace(config, repack=False)
        self.model_file = model
        self.lock = threading.RLock()
        self.generation = 0  # counts clear(): a strategy that keeps its context checks it is still there
        self.pacer: Pacer | None = None  # a compute profile slowing model work to a board class (emulation)

        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = config.repack
        self._model = llama_cpp.llama_model_load_from_file(str(model.path).encode(), model_params)
        if not self._model:
            raise EngineError(f"llama.cpp could not load {model.path}")
        self._vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self._vocab)
        self.facts = self._model_facts(config)
        if size is not None:
            try:
                sized = size(self.facts)
            except BaseException:
                llama_cpp.llama_model_free(self._model)
                raise
            if sized.repack and _repack_unsafe():
                sized = replace(sized, repack=False)
            if (
                sized.repack != config.repack
            ):  # repacking happens at load: load again without it (cheap: the file is mapped)
                llama_cpp.llama_model_free(self._model)
                model_params.use_extra_bufts = sized.repack
                self._model = llama_cpp.llama_model_load_from_file(str(model.path).encode(), model_params)
                if not self._model:
                    raise EngineError(f"llama.cpp could not load {model.path}")
                self._vocab = llama_cpp.llama_model_get_vocab(self._model)
            config = sized
        self.config = config
        self.scratch_seq = config.n_seq_max - 1

        params = llama_cpp.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = config.n_batch
        params.n_ubatch = config.n_ubatch or config.n_batch
        params.n_seq_max = config.n_seq_max
        params.n_threads = params.n_threads_batch = config.threads()
        params.type_k = params.type_v = KV_TYPES[config.kv_type]
        if config.kv_type in QUANTIZED_KV:
            params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.kv_unified = True  # sequences share cells: seq_cp tags cells, it does not copy them
        params.swa_full = True  # keep every position of sliding-window layers, so any range can be exported
        params.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, params)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise EngineError("llama.cpp could not create a context (not enough memory for n_ctx?)")
        self.n_ctx = llama_cpp.llama_n_ctx(self._ctx)
        self.n_swa = llama_cpp.llama_model_n_swa(self._model)  # sliding-window size (0: none)
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        self._batch = llama_cpp.llama_batch_init(config.n_batch, 0, config.n_seq_max)
        self.kernels = kernel_class()  # the code that computes this board's bits: part of its identity
        self.identity = ModelIdentity(
            gguf_sha256=model.sha256,
            kv_type=config.kv_type,
            llama_build=LLAMA_BUILD,
            repacked=config.repack,
            kernels=self.kernels.identity,
        )
        self.fingerprint = self.identity.fingerprint()
        self.state_bytes_per_token = self._measure_state_bytes()

    def _model_facts(self, config: EngineConfig) -> ModelFacts:
        """What this model's memory depends on: file size, parameters, vocabulary, KV bytes per position."""
        arch = self._meta("general.architecture")
        n_layer = llama_cpp.llama_model_n_layer(self._model)
        n_head_kv = llama_cpp.llama_model_n_head_kv(self._model)
        head = llama_cpp.llama_model_n_embd(self._model) // max(1, llama_cpp.llama_model_n_head(self._model))
        k_len = int(self._meta(f"{arch}.attention.key_length") or head)
        v_len = int(self._meta(f"{arch}.attention.value_length") or head)
        return ModelFacts(
            file_bytes=os.path.getsize(self.model_file.path),
            n_params=llama_cpp.llama_model_n_params(self._model),
            n_vocab=self.n_vocab,
            kv_bytes_per_token=int(n_layer * n_head_kv * (k_len + v_len) * KV_BYTES_PER_VALUE[config.kv_type]),
            n_seq_max=config.n_seq_max,
        )

    def _meta(self, key: str) -> str:
        buffer = ctypes.create_string_buffer(128)
        length = llama_cpp.llama_model_meta_val_str(self._model, key.encode(), buffer, len(buffer))
        return buffer.value.decode(errors="replace") if length >= 0 else ""

    def _measure_state_bytes(self) -> float:
        """Bytes one token's state takes (the KV of every layer), from two tiny scratch prefills
        (a few ms, at start, while the context is empty)."""
        sizes = []
        token = self.bos if self.bos is not None else 1
        for count in (4, 12):
            self.remove(self.scratch_seq)
            self.prefill([token] * count, 0, seq=self.scratch_seq)
            sizes.append(llama_cpp.llama_state_seq_get_size(self._ctx, self.scratch_seq))
        self.clear()
        return (sizes[1] - sizes[0]) / 8

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self._ctx)
            llama_cpp.llama_model_free(self._model)
            self._ctx = None

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass

    # -- model work ---------------------------------------------------------------------
    def prefill(
        self,
        tokens: list[int],
        start: int,
        seq: int = MAIN_SEQ,
        logits_at: set[int] | frozenset = frozenset(),
        on_batch=None,
        cuts=(),
    ) -> dict[int, np.ndarray]:
        """Run ``tokens`` at positions ``start..`` of ``seq`` (P-decode, the heavy call).

        Returns a copy of the logits at each position in ``logits_at`` (1 MB each for a
        262k vocabulary). A non-empty sequence must continue at its last position + 1.
        A batch ends at every absolute position in ``cuts`` (and after ``n_batch`` tokens):
        llama.cpp's CPU kernels round differently for different batch shapes, so a prefill
        that resumes at a cut gives the very bits of one that ran from 0 with the same cuts.
        ``on_batch(next_position)`` runs after each batch: the moment to export ranges
        before later batches reuse the sliding-window cells they no longer see.
        """
        out: dict[int, np.ndarray] = {}
        batch = self._batch
        token_view = np.ctypeslib.as_array(batch.token, shape=(self.config.n_batch,))
        pos_view = np.ctypeslib.as_array(batch.pos, shape=(self.config.n_batch,))
        nseq_view = np.ctypeslib.as_array(batch.n_seq_id, shape=(self.config.n_batch,))
        logits_view = np.ctypeslib.as_array(batch.logits, shape=(self.config.n_batch,))
        for offset, size in batch_spans(start, len(tokens), self.config.n_batch, cuts):
            chunk = tokens[offset : offset + size]
            first = start + offset
            positions = np.arange(first, first + size, dtype=np.int32)
            token_view[:size] = chunk
            pos_view[:size] = positions
            nseq_view[:size] = 1
            wanted = np.isin(positions, np.fromiter(logits_at, dtype=np.int32, count=len(logits_at)))
            logits_view[:size] = wanted
            for index in range(size):
                batch.seq_id[index][0] = seq
            batch.n_tokens = size
            mark = time.perf_counter()
            status = llama_cpp.llama_decode(self._ctx, batch)
            if status != 0:
                raise EngineError(f"llama_decode failed with status {status} at positions {first}..{first + size - 1}")
            if self.pacer is not None:
                self.pacer.after_prefill(size, (time.perf_counter() - mark) * 1000.0)
            for index in np.flatnonzero(wanted):
                out[int(positions[index])] = self.logits(int(index)).copy()
            if on_batch is not None:
                on_batch(first + size)
        return out

    def decode_one(self, token: int, position: int, seq: int = MAIN_SEQ) -> np.ndarray:
        """Run one token (R-decode); returns a view of its logits, valid until the next model call."""
        batch = self._batch
        batch.token[0] = token
        batch.pos[0] = position
        batch.n_seq_id[0] = 1
        batch.seq_id[0][0] = seq
        batch.logits[0] = 1
        batch.n_tokens = 1
        mark = time.perf_counter()
        status = llama_cpp.llama_decode(self._ctx, batch)
        if status != 0:
            raise EngineError(f"llama_decode failed with status {status} at position {position}")
        if self.pacer is not None:
            self.pacer.after_decode((time.perf_counter() - mark) * 1000.0)
        return self.logits(0)

    def logits(self, batch_index: int) -> np.ndarray:
        """View (no copy) of the logits of one output of the last batch."""
        pointer = llama_cpp.llama_get_logits_ith(self._ctx, batch_index)
        if not pointer:
            raise EngineError(f"no logits for batch index {batch_index}")
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    # -- sequences and states (no model work) ------------------------------------------
    def clear(self) -> None:
        """Forget every sequence (cheap: marks cells free, leaves the buffers as they are)."""
        llama_cpp.llama_memory_clear(self._memory, False)  # metadata only: no 75 MB memset
        self.generation += 1  # whoever kept a context in the main sequence sees it is gone

    def claim_main(self) -> int:
        """A stamp for what the main sequence holds now; any later clear() or claim changes it."""
        self.generation += 1
        return self.generation

    def remove(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Drop positions ``[p0, p1)`` of ``seq`` (-1: open end)."""
        llama_cpp.llama_memory_seq_rm(self._memory, seq, p0, p1)

    def copy_sequence(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share the cells of ``src`` in ``[p0, p1)`` (unified KV: no data copied)."""
        llama_cpp.llama_memory_seq_cp(self._memory, src, dst, p0, p1)

    def positions(self, seq: int = MAIN_SEQ) -> tuple[int, int]:
        """(first, last) position held by ``seq``; (-1, -1) when empty."""
        return (
            llama_cpp.llama_memory_seq_pos_min(self._memory, seq),
            llama_cpp.llama_memory_seq_pos_max(self._memory, seq),
        )

    def export_range(self, p0: int, p1: int, seq: int = MAIN_SEQ) -> bytes:
        """State bytes of positions ``[p0, p1)`` of ``seq`` (copies ~18 KB per token)."""
        scratch = self.scratch_seq
        self.remove(scratch)
        self.copy_sequence(seq, scratch, p0, p1)
        try:
            size = llama_cpp.llama_state_seq_get_size(self._ctx, scratch)
            buffer = (ctypes.c_uint8 * size)()
            written = llama_cpp.llama_state_seq_get_data(self._ctx, buffer, size, scratch)
            if written != size:
                raise EngineError(f"state export wrote {written} of {size} bytes")
            return bytes(buffer)
        finally:
            self.remove(scratch)

    def import_range(self, blob: bytes, offset: int = 0, seq: int = MAIN_SEQ) -> None:
        """Add the cells in ``blob[offset:]`` (bytes from ``export_range``) to ``seq``.

        Reads straight from ``blob`` (no Python-side copy); llama.cpp copies the cells
        into its KV buffers. Goes through the scratch sequence because loading a state
        replaces the destination sequence; the cells are then shared into ``seq``.
        """
        if not isinstance(blob, bytes) or not 0 <= offset <= len(blob):
            raise EngineError("import_range needs bytes and an offset inside them")
        size = len(blob) - offset
        address = ctypes.cast(ctypes.c_char_p(blob), ctypes.c_void_p).value + offset
        source = ctypes.cast(address, ctypes.POINTER(ctypes.c_uint8))
        scratch = self.scratch_seq
        self.remove(scratch)
        read = llama_cpp.llama_state_seq_set_data(self._ctx, source, size, scratch)
        try:
            if read == 0:
                raise EngineError("llama.cpp rejected the state bytes")
            self.copy_sequence(scratch, seq)
        finally:
            self.remove(scratch)

    def export_context(self) -> bytes:
        """The whole context's state (every cell of every sequence), as the paper's prototype
        stores it with ``llama_state_get_data``. For comparison only; this llama.cpp build
        leaves the logits out, so callers that need them store them beside it."""
        size = llama_cpp.llama_state_get_size(self._ctx)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_get_data(self._ctx, buffer, size)
        return bytes(buffer[:written])

    def import_context(self, state: bytes) -> None:
        """Load a whole-context state from ``export_context`` (copies it in)."""
        source = ctypes.cast(ctypes.c_char_p(state), ctypes.POINTER(ctypes.c_uint8))
        if llama_cpp.llama_state_set_data(self._ctx, source, len(state)) == 0:
            raise EngineError("llama.cpp rejected the context state")

    def shift(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Move the positions of ``seq``'s cells in ``[p0, p1)`` by ``delta`` (RoPE re-rotation at the next decode).

        Only for cells no other sequence shares: a cell has one position for all of them.
        """
        llama_cpp.llama_memory_seq_add(self._memory, seq, p0, p1, delta)
