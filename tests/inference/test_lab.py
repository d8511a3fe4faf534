"""The lab: the PyTorch reference engine agrees with llama.cpp, llama.cpp's state bytes are
parsed and written exactly, and KV prediction runs as a labelled, approximate strategy that
never touches exact cache entries."""

from __future__ import annotations

import numpy as np
import pytest

from dashboard import mmlu
from dashboard.lab.texts import (
    CALIBRATION_PER_TOPIC,
    calibration_questions,
    evaluation_limit,
    evaluation_prompts,
    heldout_questions,
)
from inference.lab import state_blob
from inference.lab.kv_prediction import (
    FORMAT,
    KVPredictionServing,
    Predictor,
    PredictorFileError,
    predicted_state,
    predictor_path,
    rope_np,
)
from inference.serving.strategies import StrategySpec, parse_strategy

K = 6


# -- pure parts ---------------------------------------------------------------------------------
def test_strategy_names_parse_and_bad_ones_say_what_to_write():
    assert parse_strategy("").exact and parse_strategy("exact").exact
    assert parse_strategy("kv-prediction:6") == StrategySpec("kv-prediction", aux_layers=6)
    with pytest.raises(ValueError, match="kv-prediction:K"):
        parse_strategy("kv-prediction")
    with pytest.raises(ValueError, match="unknown strategy"):
        parse_strategy("speculative:3")


def test_rope_inverse_undoes_rope():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(7, 1, 256)).astype(np.float32)
    positions = np.arange(100, 107)
    roped = rope_np(x, positions, 10_000.0)
    assert not np.allclose(roped, x)
    assert np.allclose(rope_np(roped, positions, 10_000.0, inverse=True), x, atol=1e-4)


def test_calibration_heldout_and_evaluation_text_never_overlap():
    for topic in mmlu.topics()[:10]:
        questions = mmlu.load_questions()[topic]
        limit = evaluation_limit(topic)
        calibration = set(calibration_questions(topic))
        heldout = set(heldout_questions(topic))
        assert len(calibration) == CALIBRATION_PER_TOPIC and not calibration & heldout
        assert not (calibration | heldout) & set(questions[:limit])
    prompts = evaluation_prompts(120, shots=5)
    used = {q for p in prompts for q in [p.target]}
    reserved = {q for topic in mmlu.topics() for q in (*calibration_questions(topic), *heldout_questions(topic))}
    assert len(prompts) == 120 and not used & reserved


def _tiny_predictor(fingerprint: str = "ab" * 32, k: int = 6, n_layer: int = 18) -> Predictor:
    e = 256
    return Predictor(
        fingerprint,
        k,
        n_layer,
        1,
        256,
        1e-6,
        np.full(n_layer, 10_000.0),
        np.zeros((n_layer - k, 2 * e + 1, 2 * e), np.float32),
        np.ones((n_layer - k, 256), np.float32),
        {"source": "test"},
    )


def test_predictor_file_round_trips(tmp_path):
    predictor = _tiny_predictor()
    predictor.weights[0, 0, 0] = 1.5
    path = predictor.save(tmp_path / "p.npz")
    loaded = Predictor.load(path, fingerprint=predictor.fingerprint, k=6)
    assert loaded.weights[0, 0, 0] == 1.5 and loaded.calibration == {"source": "test"}


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p, path: path.write_bytes(b"not a zip at all"), "not a readable predictor file"),
        (lambda p, path: p.save(path), "fitted for model"),  # saved for another model (fingerprint below)
        (lambda p, path: (setattr(p, "weights", p.weights[:, :10]), p.save(path)), "weights is float32"),
        (lambda p, path: (p.weights.__setitem__((0, 0, 0), np.nan), p.save(path)), "NaN"),
        (
            lambda p, path: np.savez(path, format=np.array(FORMAT), weights=np.array([object()], dtype=object)),
            "not a readable predictor file|lacks",
        ),
    ],
)
def test_bad_predictor_files_are_refused_with_a_clear_error(tmp_path, damage, message):
    path = tmp_path / "p.npz"
    predictor = _tiny_predictor()
    damage(predictor, path)
    fingerprint = "cd" * 32 if message == "fitted for model" else predictor.fingerprint
    with pytest.raises(PredictorFileError, match=message):
        Predictor.load(path, fingerprint=fingerprint, k=6)


def test_a_missing_predictor_file_says_how_to_make_one(tmp_path):
    with pytest.raises(PredictorFileError, match="bench lab"):
        Predictor.load(tmp_path / "none.npz", fingerprint="ab" * 32, k=6)


def test_predictor_for_another_k_is_refused(tmp_path):
    path = _tiny_predictor().save(tmp_path / "p.npz")
    with pytest.raises(PredictorFileError, match="not 3"):
        Predictor.load(path, fingerprint="ab" * 32, k=3)


# -- with the real model ------------------------------------------------------------------------
PROMPTS = [
    p.text
    for p in evaluation_prompts(
        5, shots=0, topics=["astronomy", "world_religions", "marketing", "virology", "sociology"]
    )
]


@pytest.mark.model
def test_llama_cpp_state_bytes_parse_and_encode_back_exactly(engine):
    tokens = engine.tokenize(PROMPTS[0], add_bos=True)
    engine.clear()
    engine.prefill(tokens, 0)
    blob = engine.export_range(0, len(tokens))
    engine.clear()
    state = state_blob.parse(blob, 2)
    assert [len(s.layers) for s in state.sections] == [3, 15]  # global layers 5, 11, 17; the others slide
    assert list(state.positions) == list(range(len(tokens)))
    assert state.sections[0].layers[0].k_f16().shape == (len(tokens), 256)
    assert state_blob.encode(state) == blob
    with pytest.raises(state_blob.StateFormatError):
        state_blob.parse(blob[:-10], 2)


@pytest.mark.model
def test_a_rebuilt_state_imports_and_gives_the_restored_logits(engine):
    """The writer's bytes are what llama.cpp reads: a state taken apart and put together again
    (rows replaced by their float16 values) decodes exactly as the exported one."""
    tokens = engine.tokenize(PROMPTS[1], add_bos=True)
    engine.clear()
    engine.prefill(tokens[:-1], 0)
    blob = engine.export_range(0, len(tokens) - 1)
    engine.clear()
    engine.import_range(blob)
    restored = engine.decode_one(tokens[-1], len(tokens) - 1).copy()
    engine.clear()
    state = state_blob.parse(blob, 2)
    for section in state.sections:
        section.layers = [state_blob.LayerRows.from_f16(layer.k_f16(), layer.v_f16()) for layer in section.layers]
    engine.import_range(state_blob.encode(state))
    rebuilt = engine.decode_one(tokens[-1], len(tokens) - 1).copy()
    engine.clear()
    assert np.array_equal(rebuilt, restored)


@pytest.mark.model
def test_reference_engine_matches_llama_cpp(engine, reference):
    """Same GGUF, same tokens: the logits stay close and the reference's greedy token is
    llama.cpp's, up to near-ties (llama.cpp's own batch shapes move its logits by up to ~0.8)."""
    worst = 0.0
    for text in PROMPTS[:3]:
        tokens = engine.tokenize(text, add_bos=True)
        engine.clear()
        served = engine.prefill(tokens, 0, logits_at={len(tokens) - 1})[len(tokens) - 1]
        engine.clear()
        ours = reference.forward(tokens).logits[0].numpy()
        assert served[np.argmax(ours)] >= served.max() - 0.5, (
            "the reference chose a token llama.cpp clearly ranks lower"
        )
        worst = max(worst, float(np.max(np.abs(ours - served))))
    assert worst < 1.5, f"max |logit difference| {worst:.3f}"


@pytest.mark.model
def test_reference_cache_and_masks_behave(reference, engine):
    """Prefill in two parts through the KV cache equals one pass; a mask hiding the whole prompt
    but the last token changes the answer."""
    tokens = engine.tokenize(PROMPTS[2], add_bos=True)[:32]
    whole = reference.forward(tokens).logits[0]
    first = reference.forward(tokens[:20], logits_at=[])
    resumed = reference.forward(tokens[20:], first.cache).logits[0]
    assert float((whole - resumed).abs().max()) < 1e-3
    import torch

    only_self = torch.zeros(len(tokens), len(tokens), dtype=torch.bool)
    only_self[torch.arange(len(tokens)), torch.arange(len(tokens))] = True
    masked = reference.forward(tokens, mask=only_self).logits[0]
    assert float((whole - masked).abs().max()) > 1.0


@pytest.fixture(scope="module")
def kv_strategy(engine, reference, tmp_path_factory):
    """A k=6 predictor fitted on a few calibration documents (quality is bench lab's business)."""
    from dashboard.lab.fitting import fit_predictors
    from dashboard.lab.texts import calibration_documents

    directory = tmp_path_factory.mktemp("lab")
    documents = calibration_documents(
        lambda text: engine.tokenize(text, add_bos=True), max_tokens=160, topics=mmlu.topics()[:2]
    )
    predictor = fit_predictors(reference, documents, [K], engine.model_file.sha256)[K]
    predictor.save(predictor_path(directory, engine.model_file.sha256, K))
    strategy = KVPredictionServing.open(engine, K, directory)
    yield strategy
    strategy.close()


@pytest.mark.model
def test_a_predicted_state_imports_and_the_base_model_decodes_from_it(engine, kv_strategy):
    tokens = engine.tokenize(PROMPTS[3], add_bos=True)
    result = kv_strategy.run(PROMPTS[3], max_tokens=4)
    b = result.breakdown
    assert b.strategy == "kv-prediction(6)" and b.cachebox == "off"
    assert b.aux_prefill_ms > 0 and b.predict_ms > 0 and b.kv_import_ms > 0 and b.ttft_ms >= b.prefill_ms
    assert b.prompt_tokens == len(tokens) and 1 <= b.generated_tokens <= 4
    # Layers below k come from the auxiliary model: they are the base model's own keys and values.
    engine.clear()
    engine.prefill(tokens[:-1], 0)
    exact = state_blob.parse(engine.export_range(0, len(tokens) - 1), 2)
    engine.clear()
    aux = kv_strategy.aux
    aux.clear()
    aux.prefill(tokens[:-1], 0)
    aux_state = state_blob.parse(aux.export_range(0, len(tokens) - 1), 2)
    aux.clear()
    blob, _ = predicted_state(kv_strategy.predictor, [aux_state])
    predicted = state_blob.parse(blob, 2)
    swa_exact, swa_predicted = exact.sections[1].layers, predicted.sections[1].layers
    for layer in range(5):  # sliding-window layers 0..4 < k
        assert np.allclose(swa_predicted[layer].k_f16(), swa_exact[layer].k_f16(), atol=0.05)
    # Layer 5 (global, < k) too; layer 6 onwards are predictions, near but not equal.
    assert np.allclose(predicted.sections[0].layers[0].k_f16(), exact.sections[0].layers[0].k_f16(), atol=0.05)
    assert not np.allclose(swa_predicted[5].v_f16(), swa_exact[5].v_f16(), atol=0.05)


@pytest.mark.model
@pytest.mark.cachebox
def test_a_kv_prediction_run_never_stores_or_leaves_state_an_exact_run_could_reuse(
    engine, kv_strategy, make_board, valkey_url, namespace
):
    import uuid

    from inference.board import serve
    from inference.contract.messages import RunRequest

    board = make_board(valkey_url, namespace)
    spec = parse_strategy(f"kv-prediction:{K}")
    board._opened[spec] = kv_strategy
    prompt = PROMPTS[4]
    predicted = board.strategy(spec).run(prompt, max_tokens=3)
    assert predicted.uploaded == [] and predicted.breakdown.uploaded_bytes == 0
    # A dispatched run asks for the strategy by name, and its report says which one answered.
    report = serve(
        board,
        RunRequest(
            request_id=str(uuid.uuid4()),
            segments=[prompt],
            max_tokens=3,
            namespace=namespace,
            strategy=f"kv-prediction:{K}",
        ),
    )
    assert report.error == "" and report.breakdown.strategy == "kv-prediction(6)" and report.breakdown.cachebox == "off"
    assert report.text == predicted.text
    with pytest.raises(ValueError, match="strategy"):
        RunRequest(request_id=str(uuid.uuid4()), segments=[prompt], strategy="kv-prediction")
    exact = board.run(prompt, max_tokens=3)
    assert exact.breakdown.matched_tokens == 0 and exact.breakdown.case == "miss"  # nothing cached, nothing reused
    engine.clear()
    cold = board.run(prompt, max_tokens=3, use_cache=False)
    assert exact.tokens == cold.tokens
    board._opened.pop(spec)


@pytest.mark.django_db
def test_the_benchmarks_page_shows_a_lab_report_with_its_trade_off_chart(client, django_user_model, settings, tmp_path):
    import json

    from django.urls import reverse

    from dashboard.bench.lab import lab_report

    settings.BASE_DIR = tmp_path
    folder = tmp_path / "bench-results"
    row = {
        "kind": "kvp",
        "k": 6,
        "method": "KV prediction (k=6)",
        "median_ttft_ms": 300.0,
        "ttft_ratio": 0.4,
        "first_token_agreement": 0.8,
        "accuracy": 0.3,
        "accuracy_retention": 0.9,
        "paired": {"both_correct": 1, "only_base": 0, "only_this": 0},
        "heldout_kl_mean": 0.5,
        "heldout_kl_median": 0.4,
    }
    doc = {
        "ks": [6],
        "prompts": 1,
        "heldout_texts": 1,
        "table": [row, {**row, "kind": "aux", "method": "auxiliary alone (k=6)"}],
        "machine": {"date": "today"},
    }
    folder.mkdir()
    (folder / "lab-1.json").write_text(json.dumps(doc))
    lab_report(folder / "lab-1.html", doc)
    client.force_login(django_user_model.objects.create_user("lab", password="pw-lab-123456", is_staff=True))
    page = client.get(reverse("benchmarks")).content.decode()
    assert "KV prediction (lab): k=6 TTFT x0.4, agreement 0.8" in page
    report = client.get(reverse("benchmark-report", args=["lab-1"])).content.decode()
    assert (
        "Efficiency-accuracy trade-off" in report and "plotly" in report.lower() and "Differs from the paper" in report
    )


@pytest.mark.model
def test_prompts_longer_than_the_sliding_window_keep_every_position(engine, kv_strategy):
    """A sliding-window cache exports only what its last position sees: the auxiliary state is
    taken in windows, so the predicted state still holds every prompt position in both caches."""
    from inference.lab.kv_prediction import export_prefix, merge_sections

    text = " ".join(PROMPTS) * 3
    tokens = engine.tokenize(text, add_bos=True)[:600]
    aux = kv_strategy.aux
    aux.clear()
    aux.prefill(tokens[:-1], 0)
    parts = export_prefix(aux, len(tokens) - 1, engine.n_swa)
    aux.clear()
    assert len(parts) == 2
    for section in range(2):
        positions, _ = merge_sections(parts, section)
        assert list(positions) == list(range(len(tokens) - 1))
    logits, breakdown = kv_strategy.prefill_logits(tokens)
    assert np.all(np.isfinite(logits)) and breakdown.state_bytes > 0
