"""A reference implementation of the served model (Gemma-3) in PyTorch, loaded from the very
same GGUF file llama.cpp serves (weights dequantized with the ``gguf`` package).

What llama.cpp does not expose and the lab needs: a layer-by-layer forward with a KV cache,
every layer's hidden state, its keys and values before and after their norm and rotation, and
custom attention masks on top of the model's own (causal, sliding window on local layers).
It is a lab tool, never a serving path: float32 on the CPU, about as fast as llama.cpp for
short prompts and slower for long ones.

Gemma-3 as llama.cpp computes it (and as this module does):
embeddings x sqrt(n_embd); per layer: RMSNorm -> q, k, v projections -> per-head RMSNorm of
q and k -> NeoX RoPE (base 10k on sliding-window layers, 1M on global ones) -> q scaled by
1/sqrt(query_pre_attn_scalar) -> grouped attention -> output projection -> RMSNorm -> residual;
RMSNorm -> GELU(tanh)(gate) * up -> down -> RMSNorm -> residual; final RMSNorm, logits from
the tied embedding matrix, optional soft-capping. llama.cpp's converter stores Gemma's norm
weights with the +1 already added, so the norms here multiply by the stored weight as is.
Costs: loading dequantizes ~270 M parameters (about 1 GB of float32, a few seconds); a
forward over n tokens costs ~0.2 GFLOP per token plus 0.34 GFLOP per position whose logits
are asked for (the 262k-word vocabulary).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

try:
    import gguf
    import torch
    import torch.nn.functional as F
except ImportError as exc:  # pragma: no cover - depends on the optional extra
    raise ImportError("the lab needs the optional extra: pip install -e '.[lab]' (torch, gguf)") from exc


class ReferenceError(RuntimeError):
    """The GGUF holds a model this reference does not implement, or is missing a tensor."""


@dataclass(frozen=True)
class Gemma3Config:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    rms_eps: float
    rope_base: float  # global layers
    rope_base_swa: float  # sliding-window layers
    rope_scale: float  # positions are multiplied by it (linear scaling; 1: none)
    n_swa: int  # sliding window (a query at p sees keys at p - n_swa < q <= p)
    swa_pattern: int  # every swa_pattern-th layer is global
    attn_scale: float  # q is multiplied by it before q.k
    final_softcap: float  # 0: none

    def is_swa(self, layer: int) -> bool:
        """llama.cpp's pattern for Gemma-3: layers 0..4 local, 5 global, 6..10 local, ..."""
        return self.n_swa > 0 and layer % self.swa_pattern < self.swa_pattern - 1

    def rope_base_of(self, layer: int) -> float:
        return self.rope_base_swa if self.is_swa(layer) else self.rope_base


def _field(reader: "gguf.GGUFReader", key: str, default=None):
    found = reader.fields.get(key)
    if found is None:
        return default
    value = found.contents()
    return value


def read_config(reader: "gguf.GGUFReader") -> Gemma3Config:
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise ReferenceError(f"the reference engine implements Gemma-3 only; this GGUF is {arch!r}")
    a = arch
    n_embd = int(_field(reader, f"{a}.embedding_length"))
    n_head = int(_field(reader, f"{a}.attention.head_count"))
    head_dim = int(_field(reader, f"{a}.attention.key_length", n_embd // n_head))
    vocab = _field(reader, "tokenizer.ggml.tokens")
    n_vocab = len(vocab) if vocab is not None else 0
    scaling = _field(reader, f"{a}.rope.scaling.type", "none")
    factor = float(_field(reader, f"{a}.rope.scaling.factor", 1.0) or 1.0)
    # llama.cpp: f_attention_scale = 1/sqrt(n_embd_head_k) for every Gemma-3 size but 27B
    # (query_pre_attn_scalar in the original config; 256 = head_dim for the 270M model).
    n_layer = int(_field(reader, f"{a}.block_count"))
    return Gemma3Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=int(_field(reader, f"{a}.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_ff=int(_field(reader, f"{a}.feed_forward_length")),
        n_vocab=n_vocab,
        rms_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(_field(reader, f"{a}.rope.freq_base", 1_000_000.0)),
        rope_base_swa=float(_field(reader, f"{a}.rope.freq_base_swa", 10_000.0)),
        rope_scale=1.0 / factor if scaling == "linear" else 1.0,
        n_swa=int(_field(reader, f"{a}.attention.sliding_window", 0) or 0),
        swa_pattern=6,
        attn_scale=1.0 / math.sqrt(head_dim),
        final_softcap=float(_field(reader, f"{a}.final_logit_softcapping", 0.0) or 0.0),
    )


def tensor_types(reader: "gguf.GGUFReader") -> dict[str, str]:
    """Each tensor's quantization type name (Q8_0, Q4_K, F32, ...)."""
    return {tensor.name: tensor.tensor_type.name for tensor in reader.tensors}


def load_tensors(reader: "gguf.GGUFReader") -> dict[str, np.ndarray]:
    """Every tensor of the GGUF dequantized to float32, in numpy's (rows, columns) order."""
    tensors = {}
    for tensor in reader.tensors:
        if tensor.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            data = _dequantize_q8_0(np.asarray(tensor.data))
        else:
            data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        array = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
        tensors[tensor.name] = (
            array if array.flags.writeable else array.copy()
        )  # float32 tensors are read-only file maps
    return tensors


def _dequantize_q8_0(rows: np.ndarray) -> np.ndarray:
    """Q8_0 blocks (a float16 scale, then 32 int8) to float32: the 262k-row embedding in about
    half the time of the gguf package's generic path (same values)."""
    blocks = rows.reshape(-1, 34)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return (blocks[:, 2:].view(np.int8) * scale).reshape(rows.shape[0], -1)


@dataclass
class LayerCache:
    """One layer's keys (after norm and RoPE) and values: (positions, n_head_kv, head_dim)."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class KVCache:
    """Keys and values of every layer for positions ``positions`` (ascending, not necessarily 0..n-1)."""

    layers: list[LayerCache | None]
    positions: torch.Tensor  # (n,) int64

    @classmethod
    def empty(cls, n_layer: int) -> "KVCache":
        return cls([None] * n_layer, torch.zeros(0, dtype=torch.int64))

    def __len__(self) -> int:
        return int(self.positions.numel())


@dataclass
class Trace:
    """What a forward saw, per layer: the residual stream entering each layer (and the last
    layer's output), and each layer's keys before their norm, after it (before RoPE) and values."""

    hidden: list[torch.Tensor] = field(default_factory=list)  # n_layer + 1 tensors of (n, n_embd)
    k_raw: list[torch.Tensor] = field(default_factory=list)  # (n, n_head_kv, head_dim) projection output
    k_normed: list[torch.Tensor] = field(default_factory=list)  # after k-norm, before RoPE
    v: list[torch.Tensor] = field(default_factory=list)


@dataclass
class ForwardResult:
    logits: torch.Tensor | None  # (len(logits_at), n_vocab) float32
    cache: KVCache
    trace: Trace | None


class ReferenceModel:
    """The served GGUF in PyTorch. ``forward`` runs tokens at positions after the cache's."""

    def __init__(
        self,
        config: Gemma3Config,
        tensors: dict[str, np.ndarray],
        threads: int = 0,
        types: dict[str, str] | None = None,
        emulate: bool = False,
    ):
        self.config = config
        # llama.cpp's CPU numerics, emulated: a matrix product with a quantized weight first
        # quantizes its input (to Q8_0 blocks of 32, or Q8_K blocks of 256 for k-quants); the
        # KV cache holds float16; GELU reads a float16 table. Off (default): plain float32. On
        # three MMLU prompts it changed the largest logit difference by +-0.2, no closer: that
        # difference is llama.cpp's own batch-shape noise (it differs from itself by up to ~0.8).
        self.emulate = emulate
        self._input_block: dict[str, int] = {}
        for name, kind in (types or {}).items():
            if kind.endswith("_K"):
                self._input_block[name] = 256
            elif kind.startswith("Q"):
                self._input_block[name] = 32
        if threads:
            torch.set_num_threads(threads)
        self._w: dict[str, torch.Tensor] = {}
        for name, array in tensors.items():
            self._w[name] = torch.from_numpy(array)
        for name in ("token_embd.weight", "output_norm.weight"):
            if name not in self._w:
                raise ReferenceError(f"the GGUF has no tensor {name}")
        self.output_name = "output.weight" if "output.weight" in self._w else "token_embd.weight"  # tied on Gemma

    @classmethod
    def load(cls, path: str | os.PathLike, threads: int = 0, emulate: bool = False) -> "ReferenceModel":
        reader = gguf.GGUFReader(str(Path(path)))
        return cls(
            read_config(reader), load_tensors(reader), threads=threads, types=tensor_types(reader), emulate=emulate
        )

    # -- pieces ----------------------------------------------------------------------
    def w(self, layer: int, name: str) -> torch.Tensor:
        return self._w[f"blk.{layer}.{name}.weight"]

    def matmul(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x @ W.T`` for the weight tensor ``name``, with llama.cpp's input quantization when emulating."""
        block = self._input_block.get(name) if self.emulate else None
        if block:
            x = quantize_rows(x, block)
        return x @ self._w[name].T

    def lin(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, f"blk.{layer}.{name}.weight")

    def f16(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float16).to(torch.float32) if self.emulate else x

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_eps) * weight

    def rope(self, x: torch.Tensor, positions: torch.Tensor, layer: int, inverse: bool = False) -> torch.Tensor:
        """NeoX rotation of ``x`` (n, heads, head_dim) at ``positions``; ``inverse`` undoes it."""
        return rope(x, positions, self.config.rope_base_of(layer), self.config.rope_scale, inverse)

    def key_value(self, layer: int, normed_input: torch.Tensor):
        """(k before its norm, k after it, v) of one layer for the normed residual ``normed_input``."""
        c = self.config
        n = normed_input.shape[0]
        k_raw = self.lin(layer, "attn_k", normed_input).view(n, c.n_head_kv, c.head_dim)
        v = self.lin(layer, "attn_v", normed_input).view(n, c.n_head_kv, c.head_dim)
        return k_raw, self.rms_norm(k_raw, self.w(layer, "attn_k_norm")), v

    def allowed(self, layer: int, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(n_q, n_k) booleans: causal, and inside the window on sliding-window layers."""
        diff = q_pos[:, None] - k_pos[None, :]
        ok = diff >= 0
        if self.config.is_swa(layer):
            ok &= diff < self.config.n_swa
        return ok

    # -- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tokens: list[int] | torch.Tensor,
        cache: KVCache | None = None,
        *,
        start: int | None = None,
        logits_at: list[int] | None = None,
        mask: torch.Tensor | None = None,
        trace: bool = False,
        layers: int | None = None,
    ) -> ForwardResult:
        """Run ``tokens`` at positions ``start..`` (default: after the cache's last position).

        ``logits_at``: indices into ``tokens`` whose logits to return (default: the last one;
        ``[]``: none). ``mask``: (len(tokens), len(cache) + len(tokens)) booleans, True where a
        query may attend a key, applied on top of the model's own masks. ``layers``: stop after
        this many layers (an early exit; logits then come from that hidden state). ``trace``:
        keep every layer's hidden state, keys and values (``ForwardResult.trace``).
        """
        c = self.config
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        n = int(ids.numel())
        cache = cache if cache is not None else KVCache.empty(c.n_layer)
        if start is None:
            start = int(cache.positions.max()) + 1 if len(cache) else 0
        q_pos = torch.arange(start, start + n, dtype=torch.int64)
        k_pos = torch.cat([cache.positions, q_pos])
        if mask is not None and tuple(mask.shape) != (n, len(k_pos)):
            raise ValueError(f"mask must be ({n}, {len(k_pos)}), got {tuple(mask.shape)}")
        keep = Trace() if trace else None
        depth = c.n_layer if layers is None else layers

        x = self.embed(ids)
        new_layers: list[LayerCache | None] = list(cache.layers)
        for layer in range(depth):
            if keep is not None:
                keep.hidden.append(x)

            def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int = layer) -> torch.Tensor:
                past = cache.layers[layer]
                k_all = torch.cat([past.k, k]) if past is not None else k
                v_all = torch.cat([past.v, v]) if past is not None else v
                new_layers[layer] = LayerCache(k_all, v_all)
                allowed = self.allowed(layer, q_pos, k_pos)
                if mask is not None:
                    allowed = allowed & mask
                return self._attention(q, k_all, v_all, allowed)

            x = self.block(layer, x, q_pos, attend, keep)
        if keep is not None:
            keep.hidden.append(x)

        wanted = [n - 1] if logits_at is None else list(logits_at)
        logits = self.output_logits(x[wanted]) if wanted else None
        return ForwardResult(logits=logits, cache=KVCache(new_layers, k_pos), trace=keep)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream entering layer 0 for token ids (n,): (n, n_embd)."""
        return self._w["token_embd.weight"][ids] * math.sqrt(self.config.n_embd)

    def output_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and the output embedding on residual rows (n, n_embd): (n, n_vocab). About
        0.34 GFLOP and a read of the whole 262k-row matrix per call: more than all 18 blocks."""
        out = self.matmul(self.rms_norm(x, self._w["output_norm.weight"]), self.output_name)
        if self.config.final_softcap:
            out = torch.tanh(out / self.config.final_softcap) * self.config.final_softcap
        return out

    def block(
        self, layer: int, x: torch.Tensor, q_pos: torch.Tensor, attend, keep: Trace | None = None
    ) -> torch.Tensor:
        """One transformer block on residual rows ``x`` (n, n_embd) at positions ``q_pos`` (n,).

        ``attend(q, k, v)`` gets this block's queries (scaled, float16-rounded like the cache), new
        keys (norm and RoPE applied) and values, keeps the keys and values where its caller caches
        them, and returns the attention output (n, n_head * head_dim). ``keep``: a trace to extend."""
        c = self.config
        n = x.shape[0]
        h = self.rms_norm(x, self.w(layer, "attn_norm"))
        q = self.lin(layer, "attn_q", h).view(n, c.n_head, c.head_dim)
        q = self.rope(self.rms_norm(q, self.w(layer, "attn_q_norm")), q_pos, layer)
        k_raw, k_normed, v = self.key_value(layer, h)
        k = self.f16(self.rope(k_normed, q_pos, layer))  # the cache holds float16
        v = self.f16(v)
        if keep is not None:
            keep.k_raw.append(k_raw)
            keep.k_normed.append(k_normed)
            keep.v.append(v)
        attn = self.lin(layer, "attn_output", attend(self.f16(q * c.attn_scale), k, v))
        x = x + self.rms_norm(attn, self.w(layer, "post_attention_norm"))
        h = self.rms_norm(x, self.w(layer, "ffn_norm"))
        gate = F.gelu(self.f16(self.lin(layer, "ffn_gate", h)), approximate="tanh")
        ff = self.lin(layer, "ffn_down", self.f16(gate) * self.lin(layer, "ffn_up", h))
        return x + self.rms_norm(ff, self.w(layer, "post_ffw_norm"))

    def _attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """Grouped attention: q (n, n_head, d), k and v (m, n_head_kv, d), allowed (n, m)."""
        c = self.config
        group = c.n_head // c.n_head_kv
        qh = q.permute(1, 0, 2)  # (n_head, n, d)
        kh = k.permute(1, 0, 2).repeat_interleave(group, dim=0)
        vh = v.permute(1, 0, 2).repeat_interleave(group, dim=0)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, scale=1.0)
        return out.permute(1, 0, 2).reshape(q.shape[0], c.n_head * c.head_dim)


def quantize_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` rounded as llama.cpp quantizes a matrix product's input: blocks of ``block`` values
    along the last axis, each to 8-bit integers times max|x|/127."""
    shape = x.shape
    blocks = x.reshape(-1, shape[-1] // block, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    if block == 32:
        scale = scale.to(torch.float16).to(torch.float32)  # Q8_0 keeps its scale in float16
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (torch.round(blocks / safe) * scale).reshape(shape)


def rope(
    x: torch.Tensor, positions: torch.Tensor, base: float, scale: float = 1.0, inverse: bool = False
) -> torch.Tensor:
    """NeoX-style rotary embedding (halves rotated together) of ``x`` (n, heads, d) at ``positions``."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = base ** (-torch.arange(0, half, dtype=torch.float64) * 2 / d)
    angles = (positions.to(torch.float64) * scale)[:, None] * inv_freq[None, :]  # (n, half)
    cos = torch.cos(angles).to(x.dtype)[:, None, :]
    sin = torch.sin(angles).to(x.dtype)[:, None, :]
    if inverse:
        sin = -sin
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
