"""Which text the lab fits on, which it measures on, kept apart.

From the end of every MMLU topic: the last ``CALIBRATION_PER_TOPIC`` questions are calibration
text (predictors are fitted on them, nothing is measured on them); the ``HELDOUT_PER_TOPIC``
before them are held-out text (next-token KL). Benchmark prompts (``mmlu.build_prompts`` from
the start of a topic) may use neither: ``evaluation_limit`` says how many questions of a topic
they may reach. Pure apart from reading the MMLU file.
"""

from __future__ import annotations

from typing import Callable

from dashboard import mmlu

CALIBRATION_PER_TOPIC = 4
HELDOUT_PER_TOPIC = 2


def evaluation_limit(topic: str) -> int:
    """Questions 0..limit-1 of ``topic`` may appear in evaluated prompts (examples or targets)."""
    return len(mmlu.load_questions()[mmlu.normalize_topic(topic)]) - CALIBRATION_PER_TOPIC - HELDOUT_PER_TOPIC


def calibration_questions(topic: str) -> tuple[mmlu.Question, ...]:
    return mmlu.load_questions()[mmlu.normalize_topic(topic)][-CALIBRATION_PER_TOPIC:]


def heldout_questions(topic: str) -> tuple[mmlu.Question, ...]:
    questions = mmlu.load_questions()[mmlu.normalize_topic(topic)]
    return questions[-CALIBRATION_PER_TOPIC - HELDOUT_PER_TOPIC : -CALIBRATION_PER_TOPIC]


def calibration_documents(
    tokenize: Callable[[str], list[int]], max_tokens: int = 512, topics: list[str] | None = None
) -> list[list[int]]:
    """Calibration text as token lists of at most ``max_tokens``: per topic, the instruction and
    its calibration questions with their answers (the shape of a few-shot prompt)."""
    documents = []
    for topic in topics or mmlu.topics():
        text = mmlu.instruction_for(topic) + "".join(q.render(with_answer=True) for q in calibration_questions(topic))
        documents.append(tokenize(text)[:max_tokens])
    return documents


def heldout_prompts(count: int, topics: list[str] | None = None) -> list[str]:
    """``count`` held-out texts (instruction + one held-out question with its answer), topics in turn."""
    chosen = topics or mmlu.topics()
    texts = []
    for index in range(count):
        topic = chosen[index % len(chosen)]
        question = heldout_questions(topic)[(index // len(chosen)) % HELDOUT_PER_TOPIC]
        texts.append(mmlu.instruction_for(topic) + question.render(with_answer=True))
    return texts


def evaluation_prompts(count: int, shots: int = 5, topics: list[str] | None = None) -> list[mmlu.MMLUPrompt]:
    """``count`` MMLU prompts spread over topics (from the start of each), none touching the lab's text."""
    chosen = topics or mmlu.topics()
    per_topic = -(-count // len(chosen))
    prompts: list[mmlu.MMLUPrompt] = []
    for topic in chosen:
        available = evaluation_limit(topic) - shots
        take = min(per_topic, available, count - len(prompts))
        if take > 0:
            prompts += mmlu.build_prompts(topic, shots, take)
        if len(prompts) >= count:
            break
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} evaluation prompts available at {shots} shots, asked for {count}")
    return prompts
