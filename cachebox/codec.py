"""How an entry's state bytes are stored: lossless codecs, chosen per entry and named in its
signed header. Pure functions over bytes (no I/O).

A KV state is mostly f16 numbers. Their high bytes (sign, exponent, top mantissa bits)
repeat a lot; their low bytes are close to noise. ``zstd-shuffle`` splits every pair of
bytes into a high-byte stream and a low-byte stream (a byte shuffle, as Blosc does) and
runs zstd (the ``zstandard`` package) over the result: 1.16x smaller on Gemma-3 270M's
f16 states against 1.09x for zstd on the raw bytes (``bench kv`` measures it). That pays
only where the link is slow: decompressing costs ~2.3 ms per MB on the development
machine, while a Wi-Fi 4 link takes ~380 ms per MB.

A board reads an entry only after its signature and the digest of the *stored* bytes were
checked, so a corrupted compressed state is refused before the decompressor or llama.cpp
sees a byte. Decompression is bounded by the signed raw size (no zip bomb).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from .errors import EntryError

RAW = "raw"
ZSTD = "zstd"
ZSTD_SHUFFLE = "zstd-shuffle"
CODECS = (RAW, ZSTD, ZSTD_SHUFFLE)
ZSTD_LEVEL = 3  # levels up to 19 gain under 1% on these states and cost 10x the time


def _compressor() -> zstandard.ZstdCompressor:
    # A frame checksum too: bytes damaged after signing (or by a bug) fail to decode, not decode wrong.
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True, write_content_size=True)


class UnknownCodec(EntryError):
    """An entry stored with a codec this board does not know: a miss here, not a forgery."""


def shuffle(data: bytes | memoryview, width: int = 2) -> bytes:
    """Byte ``i`` of every ``width``-byte word together, then byte ``i + 1``, ...; a tail
    shorter than a word stays at the end as it is."""
    array = np.frombuffer(data, dtype=np.uint8)
    whole = len(array) - len(array) % width
    words = array[:whole].reshape(-1, width)
    return words.T.tobytes() + array[whole:].tobytes()


def unshuffle(data: bytes | memoryview, width: int = 2) -> bytes:
    """The inverse of ``shuffle``."""
    array = np.frombuffer(data, dtype=np.uint8)
    whole = len(array) - len(array) % width
    streams = array[:whole].reshape(width, -1)
    return streams.T.tobytes() + array[whole:].tobytes()


def encode(state: bytes, codec: str) -> bytes:
    """The stored bytes of ``state`` under ``codec``."""
    if codec == RAW:
        return state
    if codec == ZSTD:
        return _compressor().compress(state)
    if codec == ZSTD_SHUFFLE:
        return _compressor().compress(shuffle(state))
    raise UnknownCodec(f"unknown state codec {codec!r}; this board knows {', '.join(CODECS)}")


def decode(stored: bytes | memoryview, codec: str, raw_bytes: int) -> bytes:
    """The state bytes back from ``stored``; EntryError when they do not decode to exactly
    ``raw_bytes`` bytes (the signed size), UnknownCodec for a codec this board lacks."""
    if codec == RAW:
        state = bytes(stored)
    elif codec in (ZSTD, ZSTD_SHUFFLE):
        try:
            # max_output_size bounds the work: a forged size cannot make this allocate more.
            state = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_bytes)
        except zstandard.ZstdError as exc:
            raise EntryError(f"entry state does not decompress ({codec}): {exc}") from exc
        if codec == ZSTD_SHUFFLE and len(state) == raw_bytes:
            state = unshuffle(state)
    else:
        raise UnknownCodec(
            f"entry state is stored as {codec!r}, which this board cannot read (it knows {', '.join(CODECS)})"
        )
    if len(state) != raw_bytes:
        raise EntryError(f"entry state decodes to {len(state)} bytes, its header says {raw_bytes}")
    return state


@dataclass(frozen=True)
class CodecChoice:
    """Which codec an uploading board uses, from what it knows of its link.

    Compressing pays when the transfer time it saves exceeds the time a reader spends
    decompressing: with ``ratio`` the expected size reduction (e.g. 1.18) and
    ``decode_ms_per_mb`` the decompression cost, the link must be slower than
    ``(1 - 1/ratio) * 1000 / decode_ms_per_mb`` MB/s. Pure arithmetic.
    """

    ratio: float = 1.16  # bench kv, f16 states
    decode_ms_per_mb: float = 2.3  # bench kv: zstd-shuffle, on the development machine

    def break_even_mb_per_s(self) -> float:
        return (1 - 1 / self.ratio) * 1000.0 / self.decode_ms_per_mb

    def choose(self, link_bytes_per_second: float | None) -> str:
        """``zstd-shuffle`` on links slower than the break-even rate; raw otherwise (and unshaped)."""
        if link_bytes_per_second is None:
            return RAW
        return ZSTD_SHUFFLE if link_bytes_per_second / 1e6 < self.break_even_mb_per_s() else RAW
