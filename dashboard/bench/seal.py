"""`bench seal`: what sealing entries under their namespace's key costs, in ms per MB.

An entry's state is encrypted and authenticated (``cachebox.entry``, ECE3) where it used to be
signed through a BLAKE3 digest only. This measures, on states of a real prompt's size, side by
side in one run, with the allocator set as a board sets it (``proc_memory.tune_malloc``: every
large buffer mapped on its own, so each pays its page faults, as on a board):

- ``seal``: an entry made from a state (the upload side, after the answer);
- ``open``: an entry checked and decrypted into a new buffer (the TTFT path of a hit);
- ``decrypt only``: the cipher alone, into a buffer that already exists;
- the BLAKE3 digest the earlier format computed instead, and the allocation of a state-sized
  buffer (what every fetch pays to receive the bytes at all), for scale.
"""

from __future__ import annotations

import os
import statistics
import time

from cachebox import codec as codecs
from cachebox.entry import EntryHeader, decode_header, encode_entry, open_entry
from cachebox.signing import AES_GCM, CHACHA20, CIPHERS, SALT_BYTES, _item_key, derive_keyring, shared_producer_ring
from dashboard.bench.base import BenchError, Benchmark
from dashboard.bench.html_report import write_report
from inference.engine.proc_memory import tune_malloc

FORMAT = 1
BYTES_PER_TOKEN = 18_457  # Gemma-3 270M, f16 KV (docs: llama-cpp-findings)


def add_arguments(parser) -> None:
    parser.add_argument(
        "--tokens", type=int, default=467, help="tokens of state per entry (default 467: a 5-shot MMLU prompt, ~8.6 MB)"
    )
    parser.add_argument("--repeats", type=int, default=20, help="rounds per measure (default 20)")


def _median_ms(call, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(times)


def run(ctx, *, tokens: int, repeats: int, **options) -> dict:
    if tokens < 1 or repeats < 1:
        raise BenchError("--tokens and --repeats must be at least 1")
    from blake3 import blake3

    tuned = tune_malloc()
    state = os.urandom(tokens * BYTES_PER_TOKEN)
    megabytes = len(state) / 1e6
    ring = shared_producer_ring(derive_keyring(os.urandom(32), "bench-seal", 1))
    rows = {}
    with ctx.progress(total=3, desc="bench seal", unit="measure") as bar:
        for cipher in (AES_GCM, CHACHA20):
            header = EntryHeader("f" * 16, "bench-seal", 0, tokens, "d" * 32, 0, codec=codecs.RAW, cipher=cipher)
            blob = encode_entry(header, state, ring)
            seal_ms = _median_ms(
                lambda: encode_entry(
                    EntryHeader("f" * 16, "bench-seal", 0, tokens, "d" * 32, 0, cipher=cipher), state, ring
                ),
                repeats,
            )
            open_ms = _median_ms(lambda: open_entry(blob, ring, len(state) * 2), repeats)
            sealed = memoryview(blob)[len(blob) - len(state) - SALT_BYTES - 16 :]
            aead = CIPHERS[cipher](_item_key(ring.data_key(1), bytes(sealed[:SALT_BYTES])))
            target = bytearray(len(state))
            parsed, _ = decode_header(blob)  # its signed bytes are the state's associated data
            decrypt_ms = _median_ms(
                lambda: aead.decrypt_into(bytes(12), sealed[SALT_BYTES:], parsed.signed_bytes, target), repeats
            )
            rows[cipher] = {
                "seal_ms": round(seal_ms, 3),
                "open_ms": round(open_ms, 3),
                "decrypt_only_ms": round(decrypt_ms, 3),
                "seal_ms_per_mb": round(seal_ms / megabytes, 4),
                "open_ms_per_mb": round(open_ms / megabytes, 4),
                "decrypt_only_ms_per_mb": round(decrypt_ms / megabytes, 4),
            }
            bar.update()
        digest_ms = _median_ms(lambda: blake3(state).hexdigest(), repeats)
        rows["blake3-digest (ECE2)"] = {
            "open_ms": round(digest_ms, 3),
            "open_ms_per_mb": round(digest_ms / megabytes, 4),
        }
        allocate_ms = _median_ms(lambda: bytes(bytearray(len(state))), repeats)
        rows["a state-sized buffer"] = {
            "open_ms": round(allocate_ms, 3),
            "open_ms_per_mb": round(allocate_ms / megabytes, 4),
        }
        bar.update()
    return {
        "tokens": tokens,
        "state_mb": round(megabytes, 3),
        "repeats": repeats,
        "malloc_as_a_board": tuned,
        "ciphers": rows,
        "summary": f"opening a {megabytes:.1f} MB state: {rows[AES_GCM]['open_ms']} ms with AES-256-GCM, {rows[CHACHA20]['open_ms']} ms with ChaCha20-Poly1305, "
        f"against {rows['blake3-digest (ECE2)']['open_ms']} ms for the BLAKE3 digest alone",
    }


def lines(doc: dict) -> list[str]:
    out = [
        f"\n{doc['state_mb']} MB state ({doc['tokens']} tokens), medians of {doc['repeats']}:",
        f"{'':24}{'seal ms':>10}{'open ms':>10}{'decrypt':>10}{'seal ms/MB':>12}{'open ms/MB':>12}{'decrypt/MB':>12}",
    ]
    for name, row in doc["ciphers"].items():
        out.append(
            f"{name:24}{row.get('seal_ms', '-'):>10}{row['open_ms']:>10}{row.get('decrypt_only_ms', '-'):>10}"
            f"{row.get('seal_ms_per_mb', '-'):>12}{row['open_ms_per_mb']:>12}{row.get('decrypt_only_ms_per_mb', '-'):>12}"
        )
    return out


def report(path, doc: dict):
    import plotly.graph_objects as go

    names = list(doc["ciphers"])
    figure = go.Figure()
    figure.add_bar(name="open (ms per MB)", x=names, y=[doc["ciphers"][name]["open_ms_per_mb"] for name in names])
    figure.add_bar(name="seal (ms per MB)", x=names, y=[doc["ciphers"][name].get("seal_ms_per_mb") for name in names])
    figure.update_layout(
        title="Sealing entries: cost per MB of state", yaxis_title="ms per MB", template="plotly_white", barmode="group"
    )
    table = [{"cipher": name, **row} for name, row in doc["ciphers"].items()]
    return write_report(path, "bench seal", doc["summary"], [figure], {"Per cipher": table}, doc)


BENCH = Benchmark(
    name="seal",
    format=FORMAT,
    help="what sealing entries costs: encrypt and open a state with each cipher, in ms per MB, beside the BLAKE3 digest it replaced",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=report,
    headline=lambda doc: doc.get("summary", ""),
)
