"""Anchor tokens (seed 004): anchor pruning on llama.cpp removes cells and keeps positions, it
is the very mask the fine-tune trains with, the tuned weights reach a GGUF llama.cpp serves,
and no anchor state ever becomes an exact cache entry."""

from __future__ import annotations

import fnmatch
import uuid

import numpy as np
import pytest

from cachebox.keys import entry_key_pattern, parse_entry_key_name
from dashboard.lab.texts import evaluation_prompts
from inference.lab import state_blob
from inference.lab.anchors import (
    STRATEGIES,
    AnchorServing,
    TunedModelMissing,
    anchor_mask,
    anchor_positions,
    anchor_prefill,
    kept_positions,
    prefix_entry,
    prompt_sequences,
    pruned_ranges,
    sequence_spans,
    split_sequences,
    strategy_label,
)
from inference.serving.strategies import parse_strategy
from tests.conftest import assert_exact_serving_ignores_lab_runs, require


# -- pure parts ---------------------------------------------------------------------------------
def test_a_text_splits_into_sentences_and_paragraphs_that_add_up_to_it():
    text = "First sentence. Second one? Third!\n\nA new paragraph. Its end.\n\nLast"
    pieces = split_sequences(text)
    assert "".join(pieces) == text
    assert pieces == ["First sentence.", " Second one?", " Third!\n\n", "A new paragraph.", " Its end.\n\n", "Last"]
    assert split_sequences("no end at all") == ["no end at all"]


def test_kept_and_pruned_positions_cover_the_prompt_once():
    spans = sequence_spans([5, 3, 1, 4, 6])
    assert spans == [(0, 5), (5, 8), (8, 9), (9, 13), (13, 19)]
    assert anchor_positions(spans) == [4, 7, 8, 12]
    kept = kept_positions(spans, bos=True)
    assert kept == [0, 4, 7, 8, 12, *range(13, 19)]
    removed = [p for p0, p1 in pruned_ranges(spans, bos=True) for p in range(p0, p1)]
    assert sorted(kept + removed) == list(range(19)) and not set(kept) & set(removed)
    with pytest.raises(ValueError):
        sequence_spans([3, 0])


def test_the_anchor_mask_shows_a_token_its_sequence_earlier_anchors_and_bos():
    spans = sequence_spans([3, 2, 3])  # anchors at 2 and 4; the last sequence is 5..7
    mask = anchor_mask(spans, bos=True)
    assert not np.any(mask & ~np.tri(8, dtype=bool)), "never a later token"
    assert [j for j in range(8) if mask[6, j]] == [0, 2, 4, 5, 6]  # BOS, two anchors, its own sequence so far
    assert [j for j in range(8) if mask[3, j]] == [0, 2, 3]
    assert [j for j in range(8) if mask[4, j]] == [
        0,
        2,
        3,
        4,
    ]  # an anchor sees the anchor before it (llama.cpp's batches)
    paper = anchor_mask(spans, bos=True, anchors_see_anchors=False)
    assert [j for j in range(8) if paper[4, j]] == [0, 3, 4]  # the paper's anchor: its own sequence only
    assert np.array_equal(paper[6], mask[6])


def test_the_request_accepts_exactly_the_anchor_strategies_the_board_parses():
    from inference.contract.messages import RunRequest

    for text in STRATEGIES:
        assert parse_strategy(text).name == text
        assert RunRequest(request_id=str(uuid.uuid4()), segments=["Hi"], strategy=text).strategy == text
    assert strategy_label("anchors") == "anchors(base)" and strategy_label("anchors-tuned") == "anchors(tuned)"
    for text in ("anchors:3", "anchor", "anchors-tuned-q8"):
        with pytest.raises(ValueError, match="unknown strategy"):
            parse_strategy(text)
        with pytest.raises(ValueError, match="strategy"):
            RunRequest(request_id=str(uuid.uuid4()), segments=["Hi"], strategy=text)


def test_the_bench_writes_anchor_entries_outside_the_exact_entry_key_space():
    from dashboard.bench.anchors import lab_entry_names

    for name in lab_entry_names(3):
        with pytest.raises(ValueError):
            parse_entry_key_name(name)
        assert not fnmatch.fnmatchcase(name, entry_key_pattern())


# -- on the served model (llama.cpp) --------------------------------------------------------------
MMLU = evaluation_prompts(2, shots=5, topics=["astronomy", "virology"])


@pytest.mark.model
def test_anchor_pruning_removes_the_cells_and_keeps_every_position(engine):
    sequences = prompt_sequences(engine, MMLU[0].segments)
    assert len(sequences) == 7 and sequences[0][0] == engine.bos  # instruction, 5 demonstrations, the question
    engine.clear()
    done = anchor_prefill(engine, sequences)
    n = done.spans[-1][1]
    expected = kept_positions(done.spans, bos=True)
    assert done.kept == len(expected) and done.removed == n - len(expected)
    assert engine.positions() == (0, n - 1)
    state = state_blob.parse(engine.export_range(0, n), 2)
    for section in state.sections:  # global and sliding-window layers alike: the cells are gone, the rest unmoved
        assert sorted(section.positions.tolist()) == expected
    # The answer continues at the next position, as after a full prefill.
    logits = engine.decode_one(int(np.argmax(done.logits)), n)
    assert np.all(np.isfinite(logits))
    engine.clear()


@pytest.mark.model
def test_an_anchor_entry_holds_only_anchor_cells_and_restores_the_pruned_state(engine):
    sequences = prompt_sequences(engine, MMLU[1].segments)
    prefix_end = sum(len(tokens) for tokens in sequences[:-1])
    n = prefix_end + len(sequences[-1])
    engine.clear()
    engine.prefill([t for tokens in sequences[:-1] for t in tokens], 0)
    full = prefix_entry(engine, prefix_end)
    engine.clear()
    done = anchor_prefill(engine, sequences)
    pruned = prefix_entry(engine, prefix_end)
    engine.clear()
    anchors = [p for p in kept_positions(done.spans, bos=True) if p < prefix_end]
    assert len(anchors) == 7  # BOS and the six anchors
    assert sum(map(len, pruned)) * 20 < sum(map(len, full)), (
        "the anchor entry should be a small fraction of the full one"
    )
    assert sorted(state_blob.parse(pruned[0], 2).sections[0].positions.tolist()) == anchors
    for blob in pruned:
        engine.import_range(blob)
    restored = engine.prefill(sequences[-1], prefix_end, logits_at={n - 1})[n - 1].copy()
    engine.clear()
    assert int(np.argmax(restored)) == int(np.argmax(done.logits))
    # Cell layout and batch shapes only: without repacked weights (AVX2 build) other batch shapes
    # alone move logits by up to ~1.3 (a 2-token batch against two 1-token ones: 1.0-1.07).
    assert float(np.max(np.abs(restored - done.logits))) < 2.0


@pytest.mark.model
def test_past_the_sliding_window_the_global_layers_keep_every_anchor(engine):
    """Gemma-3's sliding-window layers see 512 positions: llama.cpp reuses their cells further
    back than that once holes appear (no later token can see them), so a long pruned prompt keeps
    every anchor in the global layers and, in the sliding-window layers, every kept cell a
    later token can still see."""
    segments = [MMLU[0].segments[0], *MMLU[0].segments[1:-1], *MMLU[1].segments[1:-1], MMLU[1].segments[-1]]
    sequences = prompt_sequences(engine, segments)
    engine.clear()
    done = anchor_prefill(engine, sequences)
    n = done.spans[-1][1]
    assert n > 600
    kept = kept_positions(done.spans, bos=True)
    glob, swa = state_blob.parse(engine.export_range(0, n), 2).sections
    assert sorted(glob.positions.tolist()) == kept
    visible = [p for p in kept if p > n - 1 - engine.n_swa]
    assert set(visible) <= set(swa.positions.tolist()) <= set(kept)
    engine.clear()


@pytest.mark.model
def test_pruning_on_llama_cpp_is_the_anchor_mask_the_fine_tune_trains_with(engine, reference):
    import torch

    text = "The Moon orbits the Earth once a month.\n\nMars has two small moons, Phobos and Deimos.\n\nThe largest moon of Jupiter is"
    sequences = prompt_sequences(engine, [text])
    assert len(sequences) == 3
    tokens = [t for part in sequences for t in part]
    engine.clear()
    pruned = anchor_prefill(engine, sequences).logits.copy()
    engine.clear()
    full = engine.prefill(tokens, 0, logits_at={len(tokens) - 1})[len(tokens) - 1].copy()
    engine.clear()
    mask = torch.from_numpy(anchor_mask(sequence_spans([len(s) for s in sequences]), bos=True))
    masked = reference.forward(tokens, mask=mask).logits[0].numpy()
    to_pruned, to_full = float(np.max(np.abs(masked - pruned))), float(np.max(np.abs(masked - full)))
    assert to_pruned < 1.5 and to_pruned < to_full / 2, (
        f"masked reference vs pruned llama.cpp {to_pruned:.2f}, vs full {to_full:.2f}"
    )
    assert pruned[np.argmax(masked)] >= pruned.max() - 0.5


@pytest.mark.model
@pytest.mark.cachebox
def test_an_anchor_run_is_labelled_and_never_stored_or_reused_as_an_exact_entry(
    engine, make_board, valkey_url, namespace
):
    from cachebox.store import CacheBox

    board = make_board(valkey_url, namespace)
    prompt = MMLU[0].segments
    anchored = AnchorServing(engine).run(prompt, max_tokens=3)
    b = anchored.breakdown
    assert b.strategy == "anchors(base)" and b.cachebox == "off" and anchored.uploaded == [] and b.uploaded_bytes == 0
    assert b.prompt_tokens == sum(len(s) for s in prompt_sequences(engine, prompt)) and 1 <= b.generated_tokens <= 3
    assert engine.positions() == (-1, -1), "the pruned state must not stay in the context"
    assert list(CacheBox(valkey_url).scan_entries(namespace)) == []
    # A dispatched run names the strategy (inference/board/serve.py serve).
    from inference.board import serve
    from inference.contract.messages import RunRequest

    report = serve(
        board,
        RunRequest(
            request_id=str(uuid.uuid4()), segments=prompt, max_tokens=3, namespace=namespace, strategy="anchors"
        ),
    )
    assert report.error == "" and report.breakdown.strategy == "anchors(base)" and report.uploaded == []
    assert report.text == anchored.text
    assert list(CacheBox(valkey_url).scan_entries(namespace)) == []
    assert_exact_serving_ignores_lab_runs(board, engine, prompt)


@pytest.mark.model
def test_the_tuned_strategy_without_a_tuned_model_says_how_to_make_one(engine, tmp_path):
    with pytest.raises(TunedModelMissing, match="anchor_tune"):
        AnchorServing.open(engine, "anchors-tuned", tmp_path)
    with pytest.raises(ValueError, match="unknown anchor strategy"):
        AnchorServing(engine, "anchors-everywhere")


@pytest.mark.model
@pytest.mark.cachebox
def test_the_bench_measures_every_variant_and_leaves_no_entry_behind(engine, valkey_url):
    from cachebox.link import LINK_PRESETS
    from cachebox.store import CacheBox
    from dashboard.bench.anchors import LAB_KEY_SPACE, run_anchors

    store = CacheBox(valkey_url)
    shaped = CacheBox(valkey_url, link=LINK_PRESETS["fast-ethernet"])
    doc = run_anchors({"base": engine}, MMLU[:1], decode_tokens=2, store=store, shaped_store=shaped, link_prompts=1)
    rows = {row["variant"]: row for row in doc["rows"]}
    assert list(rows) == ["base-full", "base-pruned"] and doc["baselines"][0]["variant"] == "base-no-demos"
    full, pruned = rows["base-full"], rows["base-pruned"]
    assert (
        full["agreement"] == 1.0 and full["kv_reduction"] == 0.0 and not full["approximate"] and pruned["approximate"]
    )
    assert pruned["kv_bytes"] < full["kv_bytes"] / 3 and pruned["entry_bytes"] * 20 < full["entry_bytes"]
    assert 0 < pruned["kv_reduction"] < 1 and pruned["wifi4_ttft_ms"] > 0 and pruned["decode_tokens_per_s"] > 0
    assert list(store.redis.scan_iter(match=f"{LAB_KEY_SPACE}:*")) == []


# -- the fine-tune: mask, a few steps, export and quantize (a tiny Gemma-3 GGUF) -------------------
TINY_VOCAB = 1024  # the served tokenizer's first tokens: BOS, EOS, the chat-turn markers are among them
EMBD_SCALE = 0.1  # small against the attention and FFN outputs, so the next token depends on the context


def _tiny_gguf(source, target, seed: int = 0):
    """A 2-layer Gemma-3 with the first ``TINY_VOCAB`` tokens of the served tokenizer and random
    weights: 2-D weights float32 but the embedding (Q8_0), file type Q8_0. Quantized in a blink."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    sizes = {
        "gemma3.block_count": 2,
        "gemma3.embedding_length": 64,
        "gemma3.feed_forward_length": 128,
        "gemma3.attention.head_count": 2,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 32,
        "gemma3.attention.value_length": 32,
        "general.file_type": 7,
    }
    writer = gguf.GGUFWriter(str(target), "gemma3")
    for name, found in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value_type = found.types[0]
        value = sizes.get(name, found.contents())
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
            value = value[:TINY_VOCAB]
        writer.add_key_value(
            name, value, value_type, sub_type=found.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        )
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.2):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    embd = w(TINY_VOCAB, 64, scale=EMBD_SCALE)
    writer.add_tensor(
        "token_embd.weight",
        gguf.quants.quantize(embd, gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.add_tensor("output_norm.weight", 1 + w(64, scale=0.1))
    for layer in range(2):
        for name, shape in (
            ("attn_norm", (64,)),
            ("attn_q", (64, 64)),
            ("attn_q_norm", (32,)),
            ("attn_k", (32, 64)),
            ("attn_k_norm", (32,)),
            ("attn_v", (32, 64)),
            ("attn_output", (64, 64)),
            ("post_attention_norm", (64,)),
            ("ffn_norm", (64,)),
            ("ffn_gate", (128, 64)),
            ("ffn_up", (128, 64)),
            ("ffn_down", (64, 128)),
            ("post_ffw_norm", (64,)),
        ):
            writer.add_tensor(f"blk.{layer}.{name}.weight", 1 + w(*shape, scale=0.1) if len(shape) == 1 else w(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


@pytest.mark.model
def test_a_few_anchor_tuning_steps_export_to_a_gguf_llama_cpp_serves(tmp_path):
    torch = require("torch", "the lab extra installs torch")
    from dashboard.lab.anchor_tune import LoRA, distillation_loss, export_tuned, loss_positions
    from inference.engine.llama import Engine, EngineConfig
    from inference.engine.model_file import ModelFile, _cached_sha256, resolve_model
    from inference.lab.reference import ReferenceModel

    base_path = _tiny_gguf(resolve_model().path, tmp_path / "tiny.gguf")
    reference = ReferenceModel.load(base_path, threads=1)
    lora = LoRA.attach(reference, rank=4, alpha=8)
    sequences = [[2, 300, 301, 302, 303], [400, 401, 402], [500, 501, 502, 503]]
    spans = sequence_spans([len(s) for s in sequences])
    positions = loss_positions(spans, 6, __import__("random").Random(0))
    assert all(p >= spans[0][1] for p in positions) and len(positions) == 6
    optimizer = torch.optim.AdamW(lora.parameters(), lr=0.01)
    losses = []
    for _ in range(3):
        loss = distillation_loss(reference, lora, sequences, positions)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[0] > 0 and losses[-1] < losses[0], "the adapters should pull the masked model towards the full one"
    assert any(float(b.detach().abs().max()) > 0 for b in lora.b.values())
    tokens = [t for s in sequences for t in s]
    with torch.no_grad():
        tuned_logits = reference.forward(tokens).logits[0].numpy()
        lora.enabled = False
        base_logits = reference.forward(tokens).logits[0].numpy()
        lora.enabled = True
    exported = export_tuned(base_path, tmp_path / "tuned.gguf", lora.merged(reference), threads=1, adapted_type="Q8_0")
    import gguf

    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(exported["path"]).tensors}
    assert {types[f"blk.{layer}.attn_{name}.weight"] for layer in range(2) for name in ("q", "k", "v", "output")} == {
        "Q8_0"
    }
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_norm.weight"] == "F32"
    served = Engine(
        ModelFile(tmp_path / "tuned.gguf", _cached_sha256(tmp_path / "tuned.gguf")),
        EngineConfig(n_ctx=64, n_threads=1, n_seq_max=2),
    )
    try:
        served.clear()
        logits = served.prefill(tokens, 0, logits_at={len(tokens) - 1})[len(tokens) - 1]
    finally:
        served.close()
    assert np.max(np.abs(logits - tuned_logits)) < np.max(np.abs(base_logits - tuned_logits)) / 3, (
        "llama.cpp should compute the tuned weights"
    )
