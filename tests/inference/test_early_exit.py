"""Early exit with KV fill (seed 002): a deeper token after an exited one finds a complete cache,
a batch exits only when all its sequences are confident, a policy that never exits is full depth
exactly, and the board strategy is labelled and never touches the cache box."""

from __future__ import annotations

import numpy as np
import pytest

from inference.lab.early_exit import (
    DEFAULT_EXITS,
    ExitLens,
    ExitPolicy,
    LensFileError,
    strategy_name,
)
from inference.serving.strategies import StrategySpec, parse_strategy
from tests.conftest import assert_exact_serving_ignores_lab_runs, require

torch = require("torch", "the lab extra installs torch")

from dashboard.lab.fitting import fit_lens  # noqa: E402  (needs torch)
from inference.lab.early_exit import EarlyExitDecoder, SequenceCache  # noqa: E402
from inference.lab.reference import Gemma3Config, ReferenceModel  # noqa: E402

N_LAYER = 4


# -- names -----------------------------------------------------------------------------------------
def test_strategy_strings_parse_to_policies_and_other_strategies_are_not_ours():
    assert ExitPolicy.of(parse_strategy("early-exit:top-prob:0.9")) == ExitPolicy("top-prob", 0.9)
    assert ExitPolicy.of(parse_strategy("early-exit:similarity:0.98:lens")) == ExitPolicy(
        "similarity", 0.98, head="lens"
    )
    assert all(parse_strategy(text).name != "early-exit" for text in ("", "exact", "kv-prediction:6"))
    for bad in ("early-exit", "early-exit:entropy:0.5", "early-exit:top-prob:1.5", "early-exit:top-prob:0.5:lenses"):
        with pytest.raises(ValueError, match="early-exit:MEASURE:THRESHOLD"):
            parse_strategy(bad)


def test_every_run_of_the_strategy_names_how_it_exited():
    assert strategy_name(ExitPolicy("top-prob", 0.9)) == "early-exit(top-prob>=0.9)"
    assert (
        strategy_name(ExitPolicy("similarity", 0.98, head="lens", kv_fill=False))
        == "early-exit(similarity>=0.98, lens, no KV fill)"
    )
    assert strategy_name(ExitPolicy("top-prob", 0.5, exits=(2, 3))) == "early-exit(top-prob>=0.5, exits 2/3)"
    with pytest.raises(ValueError, match="ascending"):
        ExitPolicy("top-prob", 0.5, exits=(3, 2))


def test_the_request_accepts_exactly_the_strategies_the_board_parses():
    import uuid

    from inference.contract.messages import RunRequest

    for text in (
        "early-exit:top-prob:0.9",
        "early-exit:similarity:1",
        "early-exit:similarity:0.975:lens",
        "kv-prediction:6",
        "exact",
    ):
        assert RunRequest(request_id=str(uuid.uuid4()), segments=["Hi"], strategy=text).strategy == text
    for text in ("early-exit:top-prob:0.9", "early-exit:similarity:1", "early-exit:similarity:0.975:lens"):
        assert ExitPolicy.of(parse_strategy(text)).measure in ("top-prob", "similarity")
    for text in ("early-exit:top-prob:1.5", "early-exit:entropy:0.5", "early-exit:top-prob:0.5:lenses"):
        with pytest.raises(ValueError, match="strategy"):
            RunRequest(request_id=str(uuid.uuid4()), segments=["Hi"], strategy=text)
        with pytest.raises(ValueError, match="early-exit:MEASURE:THRESHOLD"):
            parse_strategy(text)


# -- a tiny random Gemma-3 (fast, exact arithmetic of the real code paths) -------------------------
def _tiny_model(seed: int = 0) -> ReferenceModel:
    n_embd, n_head, head_dim, n_ff, vocab = 32, 2, 16, 64, 50
    config = Gemma3Config(
        n_layer=N_LAYER,
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=1,
        head_dim=head_dim,
        n_ff=n_ff,
        n_vocab=vocab,
        rms_eps=1e-6,
        rope_base=1e6,
        rope_base_swa=1e4,
        rope_scale=1.0,
        n_swa=512,
        swa_pattern=6,
        attn_scale=head_dim**-0.5,
        final_softcap=0.0,
    )
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.3):
        return (rng.normal(size=shape) * scale).astype(np.float32)

    tensors = {"token_embd.weight": w(vocab, n_embd), "output_norm.weight": 1 + w(n_embd, scale=0.1)}
    for layer in range(N_LAYER):
        block = {
            "attn_norm": 1 + w(n_embd, scale=0.1),
            "attn_q": w(n_head * head_dim, n_embd),
            "attn_q_norm": 1 + w(head_dim, scale=0.1),
            "attn_k": w(head_dim, n_embd),
            "attn_k_norm": 1 + w(head_dim, scale=0.1),
            "attn_v": w(head_dim, n_embd),
            "attn_output": w(n_embd, n_head * head_dim),
            "post_attention_norm": 1 + w(n_embd, scale=0.1),
            "ffn_norm": 1 + w(n_embd, scale=0.1),
            "ffn_gate": w(n_ff, n_embd),
            "ffn_up": w(n_ff, n_embd),
            "ffn_down": w(n_embd, n_ff),
            "post_ffw_norm": 1 + w(n_embd, scale=0.1),
        }
        tensors.update({f"blk.{layer}.{name}.weight": value for name, value in block.items()})
    return ReferenceModel(
        config, tensors, threads=1
    )  # one torch thread: tiny tensors, and no spinning on a busy machine


@pytest.fixture(scope="module")
def tiny():
    return _tiny_model()


PROMPT = [1, 7, 3, 9, 4, 12, 5]


class Scripted(EarlyExitDecoder):
    """The real decoder with its confidence read from a script: depth -> one score per sequence."""

    script: dict[int, list[float]] = {}

    def confidence(self, entering, x, depth, policy):
        return torch.tensor(self.script.get(depth, [0.0] * x.shape[0])), None


def test_a_deeper_token_after_an_exited_one_finds_every_layer_filled_from_the_exit_state(tiny):
    decoder = EarlyExitDecoder(tiny)
    cache = decoder.prefill(PROMPT[:-1])
    n = len(PROMPT) - 1
    exiting = ExitPolicy("top-prob", 0.0, exits=(1, 2, 3))  # threshold 0: every token leaves after layer 1
    before = cache.clone()
    step = decoder.step([PROMPT[-1]], [cache], exiting)
    assert step.depth == 1
    # The skipped layers hold the exited position, written by the fill from the exit hidden state.
    x_exit = tiny.forward([PROMPT[-1]], _as_kv(before), layers=1, trace=True, logits_at=[]).trace.hidden[1]
    for layer in range(N_LAYER):
        assert cache.positions(layer) == list(range(n + 1))
        k, v, _ = cache.view(layer)
        if layer >= 1:
            assert cache.filled_positions(layer) == [n]
            want_k, want_v = decoder.fill_keys_values(x_exit, torch.tensor([n]), layer)
            assert torch.allclose(k[n], want_k[0], atol=1e-6) and torch.allclose(v[n], want_v[0], atol=1e-6)
        else:
            assert cache.filled_positions(layer) == []  # layer 0 ran: its cell is exact
    # The next token goes the whole way down and attends the filled cell at every layer.
    token = int(step.logits.argmax())
    deeper = decoder.step([token], [cache], None)
    assert deeper.depth == N_LAYER
    assert all(cache.positions(layer) == list(range(n + 2)) for layer in range(N_LAYER))


def test_without_kv_fill_the_deeper_token_finds_the_exited_position_missing_and_answers_otherwise(tiny):
    decoder = EarlyExitDecoder(tiny)
    filled, empty = decoder.prefill(PROMPT[:-1]), decoder.prefill(PROMPT[:-1])
    n = len(PROMPT) - 1
    a = decoder.step([PROMPT[-1]], [filled], ExitPolicy("top-prob", 0.0, exits=(1, 2, 3)))
    b = decoder.step([PROMPT[-1]], [empty], ExitPolicy("top-prob", 0.0, exits=(1, 2, 3), kv_fill=False))
    assert torch.equal(a.logits, b.logits)  # the exit itself is the same
    assert empty.positions(0) == list(range(n + 1))
    assert all(empty.positions(layer) == list(range(n)) for layer in range(1, N_LAYER))  # a hole at n
    after_fill = decoder.step([5], [filled], None)
    after_hole = decoder.step([5], [empty], None)
    assert empty.positions(N_LAYER - 1) == list(range(n)) + [n + 1]
    assert not torch.allclose(after_fill.logits, after_hole.logits)


def _as_kv(cache: SequenceCache):
    from inference.lab.reference import KVCache, LayerCache

    layers = []
    for layer in range(cache.n_layer):
        k, v, positions = cache.view(layer)
        layers.append(LayerCache(k.clone(), v.clone()))
    return KVCache(layers, positions.clone())


@pytest.mark.parametrize("measure", ["top-prob", "similarity"])
def test_a_threshold_that_never_exits_is_full_depth_exactly(tiny, measure):
    decoder = EarlyExitDecoder(tiny)
    prompts = [PROMPT, [1, 4, 4, 8, 2], [1, 30, 31]]
    full = decoder.generate(prompts, 6, None)
    never = decoder.generate(prompts, 6, ExitPolicy(measure, 1.0, exits=(1, 2, 3)))
    assert never.depths == [N_LAYER] * 6 and full.depths == [N_LAYER] * 6
    assert never.tokens == full.tokens
    caches = [decoder.prefill(prompt[:-1]) for prompt in prompts]
    copies = [cache.clone() for cache in caches]
    last = [prompt[-1] for prompt in prompts]
    assert torch.equal(
        decoder.step(last, caches, ExitPolicy(measure, 1.0, exits=(1, 2, 3))).logits,
        decoder.step(last, copies, None).logits,
    )
    # And the batched decoder is the reference engine's own greedy decoding, sequence by sequence.
    for prompt, tokens in zip(prompts, full.tokens):
        assert tokens == _reference_greedy(tiny, prompt, 6)


def _reference_greedy(model: ReferenceModel, prompt: list[int], steps: int) -> list[int]:
    result = model.forward(prompt[:-1], logits_at=[])
    cache, token, out = result.cache, prompt[-1], []
    for _ in range(steps):
        result = model.forward([token], cache)
        cache, token = result.cache, int(result.logits[0].argmax())
        out.append(token)
    return out


def test_a_batch_exits_at_a_layer_only_when_every_sequence_is_confident(tiny):
    decoder = Scripted(tiny)
    policy = ExitPolicy("similarity", 0.5, exits=(1, 2, 3))
    caches = [decoder.prefill(PROMPT[:-1]) for _ in range(3)]
    p = len(PROMPT) - 1
    # Depth 1: only the first is confident; depth 2: the second too; depth 3: the third.
    decoder.script = {1: [0.9, 0.1, 0.1], 2: [0.1, 0.9, 0.1], 3: [0.1, 0.1, 0.9]}
    step = decoder.step([3, 4, 5], caches, policy)
    assert step.depth == 3  # the first stays confident at 2 and 3 although its score fell (as the paper)
    assert step.ready == [1, 2, 3]
    # One sequence that is never confident keeps the whole batch at full depth.
    decoder.script = {1: [0.9, 0.9, 0.1], 2: [0.9, 0.9, 0.1], 3: [0.9, 0.9, 0.4]}
    step = decoder.step([3, 4, 5], caches, policy)
    assert step.depth == N_LAYER and step.ready == [1, 1, N_LAYER]
    # All confident at the first exit: the batch leaves there, every sequence's skipped layers filled.
    decoder.script = {1: [0.6, 0.7, 0.8]}
    step = decoder.step([3, 4, 5], caches, policy)
    assert step.depth == 1
    for cache in caches:
        assert cache.filled_positions(3) == [p, p + 2]  # step 1 left after layer 3, step 3 after layer 1
        assert cache.filled_positions(1) == cache.filled_positions(2) == [p + 2]
        assert cache.filled_positions(0) == []
        assert all(cache.positions(layer) == list(range(p + 3)) for layer in range(N_LAYER))


def test_a_batch_decodes_each_sequence_as_it_would_alone(tiny):
    decoder = EarlyExitDecoder(tiny)
    prompts = [PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 44]]
    together = decoder.generate(prompts, 5, None)
    assert together.tokens == [decoder.generate([prompt], 5, None).tokens[0] for prompt in prompts]


def test_the_sequence_cache_grows_clones_and_reports_filled_cells():
    cache = SequenceCache(2, 1, 4, capacity=2)
    for position in range(5):
        cache.append(0, torch.full((1, 4), float(position)), torch.zeros(1, 4), position, filled=position == 3)
    copy = cache.clone()
    copy.append(0, torch.zeros(1, 4), torch.zeros(1, 4), 5, filled=True)
    assert cache.positions(0) == [0, 1, 2, 3, 4] and copy.positions(0) == [0, 1, 2, 3, 4, 5]
    assert cache.filled_positions(0) == [3] and copy.filled_positions(0) == [3, 5]
    assert float(cache.view(0)[0][4, 0, 0]) == 4.0 and cache.positions(1) == []


# -- exit adapters (the optional trained "lens") ----------------------------------------------------
def test_exit_adapters_fit_save_load_and_refuse_other_models(tiny, tmp_path):
    lens = fit_lens(tiny, [PROMPT, [1, 5, 9, 13, 17, 21]], [1, 2], "ab" * 32)
    path = lens.save(tmp_path / "lens.npz")
    loaded = ExitLens.load(path, fingerprint="ab" * 32)
    assert loaded.depths == (1, 2) and np.array_equal(loaded.weights[2], lens.weights[2])
    with pytest.raises(LensFileError, match="fitted for model"):
        ExitLens.load(path, fingerprint="cd" * 32)
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    with pytest.raises(LensFileError, match="not a readable"):
        ExitLens.load(tmp_path / "bad.npz", fingerprint="ab" * 32)
    with pytest.raises(LensFileError, match="bench lab-exit"):
        ExitLens.load(tmp_path / "none.npz", fingerprint="ab" * 32)
    # A lens policy needs adapters at every exit it uses.
    with pytest.raises(LensFileError, match="none are loaded"):
        EarlyExitDecoder(tiny).check(ExitPolicy("top-prob", 0.5, exits=(1, 2), head="lens"))
    with pytest.raises(LensFileError, match="not \\[3\\]"):
        EarlyExitDecoder(tiny, loaded).check(ExitPolicy("top-prob", 0.5, exits=(1, 3), head="lens"))
    # On its own training text the adapter brings the exit state nearer the last layer's.
    trace = tiny.forward([1, 5, 9, 13, 17, 21], logits_at=[], trace=True).trace
    plain = (trace.hidden[1] - trace.hidden[N_LAYER]).norm()
    adapted = (loaded.apply(1, trace.hidden[1]) - trace.hidden[N_LAYER]).norm()
    assert adapted < plain


# -- the real model -----------------------------------------------------------------------------------
@pytest.mark.model
def test_on_the_served_model_full_depth_decoding_is_the_reference_engines_and_a_never_exit_policy_changes_nothing(
    engine, reference
):
    from dashboard.lab.texts import evaluation_prompts

    prompt = engine.tokenize(evaluation_prompts(1, shots=0, topics=["astronomy"])[0].text, add_bos=True)
    decoder = EarlyExitDecoder(reference)
    full = decoder.generate([prompt], 4, None)
    assert full.tokens[0] == _reference_greedy(reference, prompt, 4)
    never = decoder.generate([prompt], 4, ExitPolicy("similarity", 1.0))
    assert never.tokens == full.tokens and never.depths == [reference.config.n_layer] * 4
    exiting = decoder.generate([prompt], 4, ExitPolicy("similarity", 0.0))
    assert exiting.depths == [DEFAULT_EXITS[0]] * 4  # cosine >= 0 everywhere: out at the first exit


@pytest.mark.model
@pytest.mark.cachebox
def test_the_board_strategy_is_labelled_and_never_reads_or_writes_the_cache_box(
    engine, reference, make_board, valkey_url, namespace
):
    from dashboard.lab.texts import evaluation_prompts
    from inference.lab.early_exit import EarlyExitServing

    board = make_board(valkey_url, namespace)
    store = board.store
    prompt = evaluation_prompts(1, shots=1, topics=["virology"])[0].text
    keys_before = sorted(store.redis.keys("*"))
    context_before = engine.positions()
    strategy = EarlyExitServing(board.engine, reference)
    policy = ExitPolicy.of(parse_strategy("early-exit:top-prob:0.5"))
    result = strategy.with_policy(policy).run(prompt, max_tokens=3)
    b = result.breakdown
    assert b.strategy == "early-exit(top-prob>=0.5)" and b.cachebox == "off" and b.decision == "no-cache"
    assert result.uploaded == [] and result.fetched == [] and b.uploaded_bytes == b.fetched_bytes == 0
    assert 1 <= b.generated_tokens <= 3 and len(strategy.last_depths) == b.generated_tokens and b.ttft_ms > 0
    assert sorted(store.redis.keys("*")) == keys_before  # nothing written
    assert engine.positions() == context_before  # the board's llama.cpp context was not touched
    assert_exact_serving_ignores_lab_runs(board, engine, prompt)


@pytest.mark.model
@pytest.mark.cachebox
def test_a_dispatched_early_exit_run_is_labelled_and_stores_nothing(
    engine, reference, make_board, valkey_url, namespace
):
    import uuid

    from inference.board import serve
    from inference.contract.messages import RunRequest
    from inference.lab.early_exit import EarlyExitServing

    board = make_board(valkey_url, namespace)
    board._opened[StrategySpec("early-exit")] = EarlyExitServing(
        board.engine, reference
    )  # the session's reference engine, not a second copy
    keys_before = sorted(board.store.redis.keys("*"))
    request = RunRequest(
        request_id=str(uuid.uuid4()),
        segments=["The capital of France is"],
        max_tokens=3,
        namespace=namespace,
        strategy="early-exit:similarity:0.98",
    )
    report = serve(board, request)
    assert (
        report.error == ""
        and report.breakdown.strategy == "early-exit(similarity>=0.98)"
        and report.breakdown.cachebox == "off"
    )
    assert report.uploaded == [] and report.fetched == []
    assert sorted(board.store.redis.keys("*")) == keys_before
    board._opened.pop(StrategySpec("early-exit"))


# -- the study's document (the dashboard's Lab page reads these names) --------------------------------
class _Vocabulary:
    """Text to a few ids of the tiny model, and ids to letters (so MMLU answers parse)."""

    def tokenize(self, text, add_bos):
        return [1] + [2 + (ord(ch) % 40) for ch in text[-12:]]

    def detokenize(self, tokens):
        return "".join(" " + "ABCD"[t % 4] for t in tokens)


def test_the_exit_study_document_has_the_curve_the_lab_page_reads(tiny, tmp_path):
    from dashboard.bench.early_exit import _configs, exit_report, run_exit_study, summary
    from dashboard.lab.texts import evaluation_prompts

    prompts = evaluation_prompts(3, shots=0, topics=["astronomy"])
    configs = _configs({"top-prob": [0.0], "similarity": [1.0]}, (1, 2), lens=False)
    run = run_exit_study(EarlyExitDecoder(tiny), _Vocabulary(), prompts[:2], prompts[2:], configs, batch=2, tokens=3)
    assert set(run["full_depth"]) >= {"tokens_per_s", "mmlu_accuracy"} and run["full_depth"]["tokens_per_s"] > 0
    rows = {row["label"]: row for row in run["curve"]}
    assert set(rows) == {
        "early-exit(top-prob>=0, exits 1/2)",
        "early-exit(top-prob>=0, exits 1/2, no KV fill)",
        "early-exit(similarity>=1, exits 1/2)",
        "early-exit(similarity>=1, exits 1/2, no KV fill)",
    }
    for row in run["curve"]:
        assert {
            "measure",
            "threshold",
            "kv_fill",
            "batch",
            "tokens_per_s",
            "speedup",
            "exit_rate_by_layer",
            "agreement_token",
            "exact_match_32",
            "mmlu_accuracy",
        } <= set(row)
        assert (
            set(row["exit_rate_by_layer"]) == {"1", "2", str(N_LAYER)}
            and abs(sum(row["exit_rate_by_layer"].values()) - 1) < 1e-3
        )
    always, never = rows["early-exit(top-prob>=0, exits 1/2)"], rows["early-exit(similarity>=1, exits 1/2)"]
    assert always["exit_rate_by_layer"]["1"] == 1.0 and never["exit_rate_by_layer"][str(N_LAYER)] == 1.0
    assert never["agreement_token"] == 1.0 and never["exact_match_32"] == 1.0  # never exiting is full depth
    doc = {
        "bench": "lab-exit",
        "machine": {"date": "today"},
        "prompts": 2,
        "mmlu_prompts": 3,
        "tokens": 3,
        "exits": [1, 2],
        "n_layer": N_LAYER,
        "full_depth": run["full_depth"],
        "full_depth_by_batch": {"2": run["full_depth"]},
        "curve": run["curve"],
        "differs_from_paper": ["x"],
    }
    doc["summary"] = summary(doc)
    html = exit_report(tmp_path / "lab-exit.html", doc).read_text()
    assert "Speed-quality curve" in html and "plotly" in html.lower() and "Differs from the paper" in html
