"""llama.cpp's per-sequence state bytes (``llama_state_seq_get_data``), parsed and written.

Layout of this build (llama-cpp-python 0.3.36), all little-endian:

    u32 magic 0xaf143cd8, i32 seq_id
    then one section per KV cache: for a sliding-window model (Gemma-3) two, the cache of
    the global layers first, then the cache of the sliding-window layers; each section:
        u32 n_stream; per stream: u32 cell_count, and when it is not 0:
            per cell: i32 pos, u32 n_seq_id (1 for one sequence), i32 seq_id
            u32 v_trans, u32 n_layer
            per layer: i32 k_type, u64 k_row_bytes, cell_count rows of K
            v_trans == 0: per layer: i32 v_type, u64 v_row_bytes, cell_count rows of V
            v_trans == 1: per layer: i32 v_type, u32 v_element_bytes, u32 n_embd_v,
                          then n_embd_v runs of cell_count elements (V transposed)

Keys are stored after their norm and RoPE; rows of an f16 cache are float16 vectors of
n_head_kv x head_dim. Pure: bytes in, numpy arrays out, and back (no llama.cpp calls), so a
state can be taken apart, changed and put together again for ``Engine.import_range``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np

MAGIC = 0xAF143CD8
GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1


class StateFormatError(ValueError):
    """Bytes that are not a sequence state of the layout above (or of another model)."""


@dataclass
class LayerRows:
    """One layer's K and V for every cell of a section: (cells, row_bytes) uint8 each."""

    k_type: int
    k: np.ndarray
    v_type: int
    v: np.ndarray

    def k_f16(self) -> np.ndarray:
        return _as_f16(self.k_type, self.k)

    def v_f16(self) -> np.ndarray:
        return _as_f16(self.v_type, self.v)

    @classmethod
    def from_f16(cls, k: np.ndarray, v: np.ndarray) -> "LayerRows":
        """Rows from float arrays (cells, n_embd); stored as float16."""
        k16 = np.ascontiguousarray(k, dtype=np.float16)
        v16 = np.ascontiguousarray(v, dtype=np.float16)
        return cls(
            GGML_TYPE_F16,
            k16.view(np.uint8).reshape(k16.shape[0], -1),
            GGML_TYPE_F16,
            v16.view(np.uint8).reshape(v16.shape[0], -1),
        )


def _as_f16(ggml_type: int, rows: np.ndarray) -> np.ndarray:
    if ggml_type != GGML_TYPE_F16:
        raise StateFormatError(f"rows of ggml type {ggml_type} are not float16 (the lab needs an f16 KV cache)")
    return rows.view(np.float16)


@dataclass
class Section:
    """One KV cache's cells (a single stream) and its layers' rows."""

    positions: np.ndarray  # (cells,) int32
    seq_ids: np.ndarray  # (cells,) int32
    v_trans: bool = False
    layers: list[LayerRows] = field(default_factory=list)

    @property
    def cell_count(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class SequenceState:
    seq_id: int
    sections: list[Section]

    @property
    def positions(self) -> np.ndarray:
        return self.sections[-1].positions if self.sections else np.zeros(0, np.int32)


class _Reader:
    def __init__(self, blob: bytes):
        self.view = memoryview(blob)
        self.offset = 0

    def take(self, size: int) -> memoryview:
        if self.offset + size > len(self.view):
            raise StateFormatError(f"state ends at byte {len(self.view)}, {size} more bytes expected at {self.offset}")
        chunk = self.view[self.offset : self.offset + size]
        self.offset += size
        return chunk

    def unpack(self, fmt: str):
        values = struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))
        return values if len(values) > 1 else values[0]

    def array(self, dtype, count: int) -> np.ndarray:
        dtype = np.dtype(dtype)
        return np.frombuffer(self.take(dtype.itemsize * count), dtype=dtype).copy()


def parse(blob: bytes, sections: int) -> SequenceState:
    """Take apart the bytes of ``Engine.export_range`` for a model whose memory has ``sections``
    KV caches (2 for Gemma-3: global layers, then sliding-window layers)."""
    reader = _Reader(blob)
    magic, seq_id = reader.unpack("Ii")
    if magic != MAGIC:
        raise StateFormatError(f"not a llama.cpp sequence state (magic {magic:#x})")
    parsed = [_parse_section(reader) for _ in range(sections)]
    if reader.offset != len(blob):
        raise StateFormatError(
            f"{len(blob) - reader.offset} bytes left after {sections} sections: another model's state?"
        )
    return SequenceState(seq_id, parsed)


def _parse_section(reader: _Reader) -> Section:
    n_stream = reader.unpack("I")
    if n_stream != 1:
        raise StateFormatError(f"{n_stream} streams: the lab reads states of a unified KV cache (one stream)")
    cells = reader.unpack("I")
    if cells == 0:
        return Section(np.zeros(0, np.int32), np.zeros(0, np.int32))
    meta = reader.array(np.int32, 3 * cells).reshape(cells, 3)
    if np.any(meta[:, 1] != 1):
        raise StateFormatError("cells that belong to several sequences: export one sequence")
    v_trans, n_layer = reader.unpack("II")
    section = Section(meta[:, 0].copy(), meta[:, 2].copy(), bool(v_trans))
    k_parts = []
    for _ in range(n_layer):
        k_type, row = reader.unpack("iQ")
        k_parts.append((k_type, reader.array(np.uint8, row * cells).reshape(cells, row)))
    for k_type, k_rows in k_parts:
        if not v_trans:
            v_type, row = reader.unpack("iQ")
            v_rows = reader.array(np.uint8, row * cells).reshape(cells, row)
        else:
            v_type, element, n_embd = reader.unpack("iII")
            columns = reader.array(np.uint8, element * n_embd * cells).reshape(n_embd, cells, element)
            v_rows = np.ascontiguousarray(columns.transpose(1, 0, 2)).reshape(cells, n_embd * element)
        section.layers.append(LayerRows(k_type, k_rows, v_type, v_rows))
    return section


def encode(state: SequenceState) -> bytes:
    """The bytes llama.cpp reads back (``Engine.import_range``); inverse of ``parse``."""
    out = [struct.pack("<Ii", MAGIC, state.seq_id)]
    for section in state.sections:
        cells = section.cell_count
        out.append(struct.pack("<II", 1, cells))
        if cells == 0:
            continue
        meta = np.stack(
            [section.positions.astype(np.int32), np.ones(cells, np.int32), section.seq_ids.astype(np.int32)], axis=1
        )
        out.append(meta.tobytes())
        out.append(struct.pack("<II", int(section.v_trans), len(section.layers)))
        for layer in section.layers:
            _check_rows(layer.k, cells, "K")
            out.append(struct.pack("<iQ", layer.k_type, layer.k.shape[1]))
            out.append(np.ascontiguousarray(layer.k).tobytes())
        for layer in section.layers:
            _check_rows(layer.v, cells, "V")
            if not section.v_trans:
                out.append(struct.pack("<iQ", layer.v_type, layer.v.shape[1]))
                out.append(np.ascontiguousarray(layer.v).tobytes())
            else:
                element = 2 if layer.v_type == GGML_TYPE_F16 else 4 if layer.v_type == GGML_TYPE_F32 else 0
                if not element:
                    raise StateFormatError("a transposed V cache must be f16 or f32")
                n_embd = layer.v.shape[1] // element
                out.append(struct.pack("<iII", layer.v_type, element, n_embd))
                out.append(np.ascontiguousarray(layer.v.reshape(cells, n_embd, element).transpose(1, 0, 2)).tobytes())
    return b"".join(out)


def _check_rows(rows: np.ndarray, cells: int, what: str) -> None:
    if rows.dtype != np.uint8 or rows.ndim != 2 or rows.shape[0] != cells:
        raise StateFormatError(f"{what} rows must be (cells={cells}, bytes) uint8, got {rows.dtype} {rows.shape}")


def section_layers(n_layer: int, is_swa) -> list[list[int]]:
    """Model layer indices held by each section, in blob order: global layers, then sliding-window ones."""
    return [[i for i in range(n_layer) if not is_swa(i)], [i for i in range(n_layer) if is_swa(i)]]
