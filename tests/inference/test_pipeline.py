"""The cached-inference pipeline with the real model and real cache boxes."""

import json
import time

import pytest

from cachebox import embedded
from cachebox.entry import EntryHeader, decode_header, encode_entry, open_entry
from cachebox.events import JsonLineFormatter
from cachebox.keys import entry_key_name, prefix_keys, range_boundaries, tokens_digest
from cachebox.store import CacheBox
from dashboard.mmlu import build_prompts
from inference.serving.run import PromptError
from tests.conftest import run_manage

pytestmark = [pytest.mark.model, pytest.mark.cachebox]


@pytest.fixture(scope="module")
def prompts():
    return build_prompts("astronomy", shots=2, count=3)


def segment_ends(board, prompt):
    return board.prefix.tokenize(prompt.segments)[1]


def entry_names(board, prompt, namespace):
    tokens, cuts = board.prefix.layout(prompt.segments)
    boundaries = range_boundaries(len(tokens), board.config.chunk_tokens, cuts)  # the question begins a batch
    keys = prefix_keys(
        namespace, board.engine.fingerprint, tokens, boundaries, grid=board.config.chunk_tokens, extra=cuts
    )
    return tokens, {end: entry_key_name(namespace, board.engine.fingerprint, key) for end, key in zip(boundaries, keys)}


def test_miss_then_full_hit_gives_the_same_greedy_answer(valkey_url, namespace, make_board, prompts):
    board = make_board(valkey_url, namespace)
    cold = board.run(prompts[0].segments, max_tokens=8)
    assert cold.breakdown.case == "miss" and cold.breakdown.decision == "catalog-miss"
    assert cold.breakdown.uploaded_bytes > 0 and cold.breakdown.cachebox == "ok"
    hit = board.run(prompts[0].segments, max_tokens=8)
    b = hit.breakdown
    assert b.case == "full" and b.matched_tokens == b.prompt_tokens == cold.breakdown.prompt_tokens
    assert b.prefill_ms < 1.0  # nothing was prefilled: the first token came from stored logits
    assert hit.tokens == cold.tokens and hit.text == cold.text
    assert b.fetched_bytes > 0 and b.state_bytes == b.fetched_bytes
    # f16 KV of Gemma-3 270M: about 18.4 KB a token, plus small entry headers.
    assert 17_000 < b.fetched_bytes / b.matched_tokens < 19_000


def test_another_process_hits_what_this_board_uploaded(valkey_url, namespace, make_board, prompts, tmp_path):
    board = make_board(valkey_url, namespace)
    cold = board.run(prompts[1].text, max_tokens=6)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(prompts[1].text, encoding="utf-8")
    done = run_manage(
        "infer",
        "--prompt-file",
        str(prompt_file),
        "--max-tokens",
        "6",
        "--json",
        env={"REDIS_URL": valkey_url, "EDGECACHE_NAMESPACE": namespace, "EDGECACHE_N_CTX": "2048"},
    )
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["case"] == "full" and result["cachebox"] == "ok"
    assert result["text"] == cold.text


def test_partial_hit_restores_the_longest_cached_range_and_answers_as_cold(valkey_url, namespace, make_board, prompts):
    board = make_board(valkey_url, namespace, chunk_tokens=64)
    other, prompt = prompts[1], prompts[0]
    assert other.segments[:-1] == prompt.segments[:-1]  # the same instruction and examples, another question
    ends = segment_ends(board, prompt)  # instruction, example 1, example 2, question
    board.run(prompt.segments[:1], max_tokens=1)  # instruction alone: shorter than one grid cell
    board.run(other.segments, max_tokens=1)
    result = board.run(prompt.segments, max_tokens=32)
    assert result.breakdown.case == "partial"
    # Batches end on the grid and where the last segment (the question) begins: the shared
    # instruction and examples are reused whole.
    assert result.breakdown.matched_tokens == ends[2]
    cold = make_board(None, namespace, chunk_tokens=64).run(prompt.segments, max_tokens=32)
    assert result.tokens == cold.tokens  # 32 greedy tokens, bit-exact reuse


def test_a_prefix_stored_as_a_prompt_of_its_own_serves_up_to_its_own_last_cut(
    valkey_url, namespace, make_board, prompts
):
    board = make_board(valkey_url, namespace, chunk_tokens=64)
    prompt = prompts[0]
    ends = segment_ends(board, prompt)
    board.run(
        prompt.segments[:3], max_tokens=1
    )  # its last segment (example 2) began a batch: the full prompt's cold run has no cut there
    result = board.run(prompt.segments, max_tokens=32)
    assert result.breakdown.case == "partial" and result.breakdown.matched_tokens == ends[1] // 64 * 64
    assert result.tokens == make_board(None, namespace, chunk_tokens=64).run(prompt.segments, max_tokens=32).tokens


def test_unstructured_prompts_share_fixed_chunks(valkey_url, namespace, make_board):
    board = make_board(valkey_url, namespace, chunk_tokens=32)
    shared = "Edge boards share prompt states through a cache box. " * 12
    board.run(shared + "First question: what is a Bloom filter?", max_tokens=2)
    result = board.run(shared + "Second question: why share the KV cache?", max_tokens=2)
    assert result.breakdown.case == "partial"
    assert result.breakdown.matched_tokens >= 64 and result.breakdown.matched_tokens % 32 == 0


def test_catalog_false_positive_costs_a_fetch_but_not_the_answer(valkey_url, namespace, make_board, prompts):
    board = make_board(valkey_url, namespace)
    tokens, cuts = board.prefix.layout(prompts[2].segments)
    keys = prefix_keys(
        namespace, board.engine.fingerprint, tokens, [len(tokens)], grid=board.config.chunk_tokens, extra=cuts
    )
    catalog = board.catalogs.get(namespace).catalog
    catalog.add(keys[-1])  # the catalog now says "maybe" for a state nobody stored
    result = board.run(prompts[2].segments, max_tokens=4)
    assert result.breakdown.false_positives == 1 and result.breakdown.case == "miss"
    assert result.breakdown.decision == "no-usable-entry"
    assert catalog.stats.false_positives == 1
    assert result.tokens == make_board(None, namespace).run(prompts[2].segments, max_tokens=4).tokens


def test_corrupted_state_is_evicted_and_answered_by_prefill(valkey_url, namespace, make_board, prompts):
    board = make_board(valkey_url, namespace)
    cold = board.run(prompts[0].segments, max_tokens=4)
    tokens, names = entry_names(board, prompts[0], namespace)
    store = CacheBox(valkey_url)
    last = names[len(tokens)]
    header, offset = decode_header(store.read_prefixes([last], 4096)[0])
    store.redis.setrange(last, offset + 1000, b"\x00\xff\x00\xff")  # flip bytes inside the state
    result = board.run(prompts[0].segments, max_tokens=4)
    assert result.breakdown.rejected_entries == 1
    assert result.breakdown.case == "partial"  # the chain up to the bad range still served
    assert result.breakdown.matched_tokens == header.start
    assert result.tokens == cold.tokens
    assert store.redis.exists(last) == 1  # evicted, then uploaded again by this run's own prefill
    again = board.run(prompts[0].segments, max_tokens=4)
    assert again.breakdown.case == "full" and again.breakdown.rejected_entries == 0


def test_forged_truncated_and_swapped_entries_never_reach_llama_cpp(valkey_url, namespace, make_board, prompts, caplog):
    """Whoever can write to the cache box but lacks the namespace's key cannot plant a state."""
    from cachebox.signing import derive_keyring, shared_producer_ring

    board = make_board(valkey_url, namespace)
    cold = board.run(prompts[0].segments, max_tokens=4)
    tokens, names = entry_names(board, prompts[0], namespace)
    store = CacheBox(valkey_url)
    first = names[sorted(names)[0]]
    genuine = store.read_entries([first])[0]
    header, offset = decode_header(genuine)
    header.open_private(board.keys.ring(namespace))
    attacks = {
        # a header and state of the forger's own, signed and sealed with a key it made up
        "signature": encode_entry(
            header, bytes(header.plain_bytes), shared_producer_ring(derive_keyring(b"not the key" * 3, namespace, 1))
        ),
        # the genuine signed header over a state cut short (an interrupted write)
        "bytes": genuine[:-1000],
        # the genuine signed header over another state of the same size
        "authenticate": genuine[:offset] + bytes(len(genuine) - offset),
    }
    for reason, blob in attacks.items():
        store.redis.set(first, blob)
        caplog.clear()
        with caplog.at_level("WARNING", logger="edgecache.security"):
            result = board.run(prompts[0].segments, max_tokens=4)
        assert result.breakdown.rejected_entries == 1, reason
        assert result.breakdown.case == "miss" and result.tokens == cold.tokens, reason
        event = json.loads(
            JsonLineFormatter().format(next(r for r in caplog.records if r.getMessage() == "entry_rejected"))
        )
        assert event["event"] == "entry_rejected" and event["entry"] == first and reason in event["reason"]
        # evicted, then stored again, signed, by the local prefill
        stored, _ = open_entry(store.read_entries([first])[0], board.keys.ring(namespace), 1 << 30)
        assert (stored.start, stored.end, stored.tokens_digest) == (header.start, header.end, header.tokens_digest)
    assert board.run(prompts[0].segments, max_tokens=4).breakdown.case == "full"


def test_a_board_without_keys_neither_reads_nor_writes(valkey_url, namespace, make_board, prompts):
    from cachebox.signing import Keychain

    board = make_board(valkey_url, namespace)
    board.run(prompts[1].segments, max_tokens=2)
    keyless = make_board(valkey_url, namespace, device="stranger", keys=Keychain(lambda ns: None))
    keyless.catalogs.sync_all()
    result = keyless.run(prompts[1].segments, max_tokens=2)
    assert (result.breakdown.cachebox, result.breakdown.decision, result.breakdown.case) == (
        "no-key",
        "no-signing-key",
        "miss",
    )


def test_garbage_entry_and_forged_positions_are_rejected(valkey_url, namespace, make_board, prompts):
    board = make_board(valkey_url, namespace)
    cold = board.run(prompts[1].segments, max_tokens=4)
    tokens, names = entry_names(board, prompts[1], namespace)
    store = CacheBox(valkey_url)
    ends = sorted(names)
    # 1. The first range's entry replaced by garbage: nothing chains, plain miss.
    store.redis.set(names[ends[0]], b"not an entry at all")
    result = board.run(prompts[1].segments, max_tokens=4)
    assert result.breakdown.rejected_entries >= 1 and result.breakdown.case == "miss"
    assert result.tokens == cold.tokens
    # 2. A well-formed entry whose state holds other positions than its header claims.
    header, state = open_entry(store.read_entries([names[ends[1]]])[0], board.keys.ring(namespace), 1 << 30)
    forged = EntryHeader(
        fingerprint=header.fingerprint,
        namespace=namespace,
        start=0,
        end=ends[0],
        tokens_digest=tokens_digest(tokens[: ends[0]]),
        state_bytes=0,
    )
    store.redis.set(names[ends[0]], encode_entry(forged, state, board.keys.ring(namespace)))  # even when signed
    result = board.run(prompts[1].segments, max_tokens=4)
    assert result.breakdown.rejected_entries == 1 and result.breakdown.case == "miss"
    assert result.tokens == cold.tokens
    assert board.engine.positions()[0] == 0  # nothing of the forged state stayed behind


def test_cache_box_down_still_answers_without_hanging(namespace, make_board, prompts, tmp_path):
    data_dir = tmp_path / "valkey"
    url = embedded.ensure_running(data_dir, maxmemory="256mb")
    board = make_board(url, namespace)
    cold = board.run(prompts[2].segments, max_tokens=4)
    embedded.stop(data_dir)
    started = time.monotonic()
    result = board.run(prompts[2].segments, max_tokens=4)
    assert time.monotonic() - started < 10
    assert result.breakdown.cachebox == "unavailable" and result.breakdown.case == "miss"
    assert result.tokens == cold.tokens
    never_up = make_board("redis://127.0.0.1:9/0", namespace).run(prompts[2].segments, max_tokens=4)
    assert never_up.breakdown.cachebox == "unavailable" and never_up.tokens == cold.tokens


def test_catalog_sync_between_two_boards(valkey_url, namespace, make_board, prompts):
    board_a = make_board(valkey_url, namespace, device="zero")
    board_b = make_board(valkey_url, namespace, device="pi5")
    board_a.run(prompts[1].segments, max_tokens=2)
    before = board_b.run(prompts[1].segments[:1] + ["Unrelated question?"], max_tokens=1)
    assert before.breakdown.decision == "catalog-miss"  # b has not pulled yet: no network at all
    board_b.catalogs.sync_all()
    after = board_b.run(prompts[1].segments, max_tokens=2)
    assert after.breakdown.case == "full"
    header, _ = decode_header(
        CacheBox(valkey_url).read_prefixes(
            [entry_names(board_a, prompts[1], namespace)[1][after.breakdown.prompt_tokens]], 4096
        )[0]
    )
    assert header.device == ""  # the creator is sealed: only the namespace's key shows it
    header.open_private(board_b.keys.ring(namespace))
    assert header.device == "zero"


def test_no_cache_neither_reads_nor_writes(valkey_url, namespace, make_board, prompts):
    board = make_board(valkey_url, namespace)
    result = board.run(prompts[0].segments, max_tokens=2, use_cache=False)
    assert result.breakdown.cachebox == "off" and result.breakdown.uploaded_bytes == 0
    assert list(CacheBox(valkey_url).scan_entries(namespace)) == []


def test_bad_prompts_get_clear_errors(make_board, namespace, engine):
    board = make_board(None, namespace)
    with pytest.raises(PromptError, match="empty"):
        board.run("   \n")
    with pytest.raises(PromptError, match="context holds"):
        board.run("word " * (engine.n_ctx + 10))
    with pytest.raises(PromptError, match="max_tokens"):
        board.run("hello", max_tokens=0)


def test_a_full_hit_without_stored_logits_computes_the_last_batch_as_cold_does(
    valkey_url, namespace, make_board, prompts
):
    board = make_board(valkey_url, namespace, chunk_tokens=64)
    cold = board.run(prompts[2].segments, max_tokens=8)
    tokens, names = entry_names(board, prompts[2], namespace)
    store = CacheBox(valkey_url)
    last = names[len(tokens)]
    header, state = open_entry(store.read_entries([last])[0], board.keys.ring(namespace), 1 << 30)
    header.top_ids = header.top_logits = None  # as for a range that ends at a grid point of a longer prompt
    store.redis.set(last, encode_entry(header, state, board.keys.ring(namespace)))
    result = board.run(prompts[2].segments, max_tokens=8, upload=False)
    # Recomputing the last token alone would round differently: the cold run's last batch is recomputed.
    assert result.breakdown.case == "partial" and result.breakdown.matched_tokens == header.start
    assert result.breakdown.rejected_entries == 0 and result.tokens == cold.tokens


def test_prompts_longer_than_the_sliding_window_are_cached_whole(valkey_url, namespace, make_board):
    # Over 1024 tokens: three prefill batches, and Gemma-3's 512-position sliding window.
    board = make_board(valkey_url, namespace)
    prompt = "".join(f"Fact {i}: the number {i} follows {i - 1}. " for i in range(1, 120))
    cold = board.run(prompt, max_tokens=3)
    assert cold.breakdown.prompt_tokens > 1100 and cold.breakdown.case == "miss"
    hit = board.run(prompt, max_tokens=3)
    assert hit.breakdown.case == "full" and hit.breakdown.rejected_entries == 0
    assert hit.tokens == cold.tokens
    longer = board.run(prompt + "Fact 120: the number", max_tokens=8)
    assert longer.breakdown.case == "partial" and longer.breakdown.rejected_entries == 0
    assert longer.breakdown.matched_tokens == cold.breakdown.prompt_tokens // 128 * 128  # the last grid point
    assert longer.tokens == board.run(prompt + "Fact 120: the number", max_tokens=8, use_cache=False).tokens


# -- a cached answer is the cold answer ----------------------------------------------------------
LONG_CONTEXT = "".join(f"Note {i}: the lighthouse keeper logs wind {i % 7} and tide {i % 5}.\n" for i in range(60))


@pytest.mark.parametrize("resume", [64, 128, 256, 640])
def test_cold_and_resumed_logits_are_bitwise_identical_on_the_grid(engine, resume):
    """Restore [0, resume) and prefill the rest on the grid: the very logits of the cold prefill."""
    import numpy as np

    from cachebox.keys import grid_cuts
    from inference.engine.llama import MAIN_SEQ

    tokens = engine.tokenize(LONG_CONTEXT + "Question: what did the keeper log last?", add_bos=True)
    assert len(tokens) > 700  # past one 512 batch and Gemma-3's 512-position window
    last = len(tokens) - 1
    with engine.lock:
        engine.clear()
        cold = engine.prefill(tokens, 0, logits_at={last}, cuts=grid_cuts(len(tokens), 64))[last]
        state = engine.export_range(0, resume)
        engine.clear()
        engine.import_range(state)
        warm = engine.prefill(tokens[resume:], resume, logits_at={last}, cuts=grid_cuts(len(tokens), 64, resume))[last]
        # The same resume without the grid (one batch for the rest) rounds differently: why the grid.
        engine.clear()
        engine.import_range(state)
        uncut = engine.prefill(tokens[resume:], resume, logits_at={last})[last]
        engine.remove(MAIN_SEQ)
    assert np.array_equal(cold, warm)
    assert not np.array_equal(cold, uncut)


def test_a_state_is_the_same_bits_on_any_thread_count(engine, prompts):
    """Boards share states whatever their thread counts (one fingerprint): a grid prefill's state and
    logits are the same bits on 1 and 2 threads, so a state another board computed continues as this
    board's own cold prefill would. A decode step is not (its logits differed by up to 0.84 between
    1, 2 and 3 threads here), so a board's answer is compared with its own cold run."""
    import numpy as np

    from cachebox.keys import grid_cuts
    from inference.engine.llama import Engine, EngineConfig

    tokens = engine.tokenize("".join(prompts[0].segments), add_bos=True)
    last = len(tokens) - 1
    seen = []
    for threads in (1, 2):
        other = Engine(engine.model_file, EngineConfig(n_ctx=1024, n_threads=threads, n_seq_max=2))
        try:
            logits = other.prefill(tokens, 0, logits_at={last}, cuts=grid_cuts(len(tokens), 128))[last]
            state = other.export_range(0, len(tokens))
            seen.append((other.fingerprint, logits, state))
        finally:
            other.close()
    (fingerprint_1, logits_1, state_1), (fingerprint_2, logits_2, state_2) = seen
    assert fingerprint_1 == fingerprint_2
    assert np.array_equal(logits_1, logits_2) and state_1 == state_2


def test_questions_sharing_a_context_answer_as_cold_after_partial_and_full_hits(valkey_url, namespace, make_board):
    """The probe of the issue: a shared instruction + examples, six questions split on blank lines,
    each a partial hit after another stored the shared ranges; every answer was different from cold."""
    board = make_board(valkey_url, namespace)
    questions = [
        "the wind on day 3",
        "the tide on day 4",
        "who keeps the light",
        "the longest note",
        "the first note",
        "what the sea did",
    ]
    served = [board.run([LONG_CONTEXT, f"\nQuestion: {q}?\nAnswer:"], max_tokens=32) for q in questions]
    again = [board.run([LONG_CONTEXT, f"\nQuestion: {q}?\nAnswer:"], max_tokens=32) for q in questions]
    cold = [board.run([LONG_CONTEXT, f"\nQuestion: {q}?\nAnswer:"], max_tokens=32, use_cache=False) for q in questions]
    assert [r.breakdown.case for r in served] == ["miss"] + ["partial"] * 5
    assert all(r.breakdown.case == "full" for r in again)
    assert [r.tokens for r in served] == [r.tokens for r in cold] == [r.tokens for r in again]
