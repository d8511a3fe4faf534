import numpy as np
import pytest

from inference.engine.sampling import SamplingParams, sample, top_candidates


def test_top_candidates_are_sorted_best_first_with_low_id_tie_break():
    logits = np.array([0.1, 5.0, 3.0, 5.0, -1.0], dtype=np.float32)
    ids, values = top_candidates(logits, 3)
    assert ids.tolist() == [1, 3, 2]
    assert values.tolist() == [5.0, 5.0, 3.0]


def test_greedy_on_top_candidates_equals_argmax_on_full_logits():
    rng = np.random.default_rng(0)
    for _ in range(50):
        logits = rng.normal(size=5000).astype(np.float32)
        ids, values = top_candidates(logits, 64)
        assert sample(ids, values, SamplingParams()) == int(np.argmax(logits))


def test_temperature_sampling_is_reproducible_with_a_seed_and_respects_top_k():
    logits = np.linspace(0, 1, 100).astype(np.float32)
    ids, values = top_candidates(logits, 64)
    params = SamplingParams(temperature=1.0, top_k=5, top_p=1.0, seed=7)
    draws = [sample(ids, values, params, np.random.default_rng(7)) for _ in range(20)]
    assert len(set(draws)) == 1  # same seed, same draw
    many = {sample(ids, values, params, np.random.default_rng(seed)) for seed in range(200)}
    assert many <= set(ids[:5].tolist()) and len(many) > 1


@pytest.mark.parametrize("kwargs", [{"temperature": -1}, {"top_p": 0}, {"top_k": 0}])
def test_invalid_sampling_parameters_are_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_top_p_of_one_keeps_every_candidate_whatever_the_rounding():
    """OpenAI's default top_p is 1.0; a cumulative sum a hair under 1.0 once cut past the candidates."""
    rng = np.random.default_rng(0)
    for seed in range(200):
        logits = np.random.default_rng(seed).normal(size=64).astype(np.float32)
        ids = np.arange(64, dtype=np.int32)
        token = sample(ids, logits, SamplingParams(temperature=0.7, top_k=64, top_p=1.0), rng)
        assert 0 <= token < 64
