"""`bench modules`: Prompt Cache on MMLU. Each few-shot example is a prompt module (a union
of two candidate examples per slot), the question is free text. Three arms on the same
prompts: full prefill of the same text (baseline), modules served from the cache box, and
the same with a scaffold that encodes one set of examples jointly."""

from __future__ import annotations

import math
import re
from typing import Callable
from xml.sax.saxutils import escape, quoteattr

from dashboard import mmlu
from dashboard.bench.base import BenchError, Benchmark, topics_named
from dashboard.bench.common import machine_info, median
from dashboard.bench.reports import modules_report

# Every topic by default: prompts from all of MMLU, not a hand-picked few (the uncached
# question's share of a 5-shot prompt ranges from 9% to 20% across topics).
DEFAULT_PROMPTS_PER_TOPIC = 6


def _slug(topic: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", topic.lower()).strip("-")


def schema_for(topic: str, shots: int, scaffold: bool) -> str:
    """PML schema: the instruction as schema text, then one union of two examples per slot."""
    questions = mmlu.load_questions()[topic]
    name = f"mmlu-{_slug(topic)}-{shots}{'-scaffold' if scaffold else ''}"
    parts = [f'<schema name={quoteattr(name)} xml:space="preserve">', escape(mmlu.instruction_for(topic))]
    for slot in range(shots):
        first, second = questions[slot], questions[shots + slot]
        parts.append(
            f'<union><module name="s{slot}a">{escape(first.render(True))}</module>'
            f'<module name="s{slot}b">{escape(second.render(True))}</module></union>'
        )
    if scaffold and shots >= 2:
        members = " ".join(f"s{slot}a" for slot in range(shots))
        parts.append(f'<scaffold name="examples-a" modules="{members}"/>')
    parts.append("</schema>")
    return "".join(parts)


def choices_for(index: int, shots: int) -> list[str]:
    """Which candidate each slot imports: every other prompt takes all "a" (the scaffolded set)."""
    if index % 2 == 0 or shots == 0:
        return ["a"] * shots
    mixed = ((index * 2654435761) >> 7) % (2**shots) or 1
    return ["b" if (mixed >> slot) & 1 else "a" for slot in range(shots)]


def prompt_for(schema_source: str, target: mmlu.Question, choices: list[str]) -> str:
    name = re.search(r'name="([^"]+)"', schema_source).group(1)
    imports = "".join(f"<s{slot}{choice}/>" for slot, choice in enumerate(choices))
    return f'<prompt schema={quoteattr(name)} xml:space="preserve">{imports}{escape(target.render(False))}</prompt>'


def plain_text(topic: str, shots: int, target: mmlu.Question, choices: list[str]) -> str:
    """The same prompt as one text, for the full-prefill baseline."""
    questions = mmlu.load_questions()[topic]
    examples = [questions[slot if choice == "a" else shots + slot].render(True) for slot, choice in enumerate(choices)]
    return mmlu.instruction_for(topic) + "".join(examples) + target.render(False)


def wilson(successes: int, total: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a proportion."""
    if total == 0:
        return 0.0, 0.0
    p = successes / total
    centre = p + z * z / (2 * total)
    spread = z * math.sqrt(p * (1 - p) / total + z * z / (4 * total * total))
    denominator = 1 + z * z / total
    return round((centre - spread) / denominator, 4), round((centre + spread) / denominator, 4)


def _accuracy(answers: list[str | None], truth: list[str]) -> dict:
    correct = sum(a == t for a, t in zip(answers, truth))
    low, high = wilson(correct, len(truth))
    return {
        "accuracy": round(correct / len(truth), 4) if truth else 0.0,
        "ci95": [low, high],
        "correct": correct,
        "n": len(truth),
    }


def run_modules(
    board,
    topics: list[str],
    prompts_per_topic: int,
    shots: int,
    *,
    namespace: str,
    progress: Callable[[], None] | None = None,
) -> dict:
    arms = {"baseline": [], "modules": [], "scaffold": []}  # (ttft_ms, answer, truth, topic)
    per_topic = {}
    for topic in topics:
        questions = mmlu.load_questions()[topic]
        targets = questions[2 * shots :][:prompts_per_topic]
        if len(targets) < prompts_per_topic:
            raise ValueError(f"topic {topic!r} has only {len(targets)} target questions at {shots} shots")
        plain_schema, scaffold_schema = schema_for(topic, shots, False), schema_for(topic, shots, True)
        board.schemas.encode_schema(plain_schema, namespace=namespace)  # a warm cache box: not timed
        board.schemas.encode_schema(scaffold_schema, namespace=namespace)
        rows = {"baseline": [], "modules": []}
        for index, target in enumerate(targets):
            choices = choices_for(index, shots)
            baseline = board.run(plain_text(topic, shots, target, choices), max_tokens=1, use_cache=False)
            row = (baseline.breakdown.ttft_ms, mmlu.parse_answer(baseline.text), target.answer, topic)
            arms["baseline"].append(row)
            rows["baseline"].append(row)
            schemas = [("modules", plain_schema)]
            if all(choice == "a" for choice in choices):
                schemas.append(("scaffold", scaffold_schema))
                arms.setdefault("baseline-a", []).append(row)
            for arm, schema in schemas:
                result = board.run_pml(schema, prompt_for(schema, target, choices), max_tokens=1, namespace=namespace)
                # The question is free text, computed on every run: a run whose modules all came
                # from the cache box is "partial" by tokens (schema serving counts tokens).
                if result.breakdown.case == "miss":
                    raise RuntimeError(f"{arm}: expected the modules from the cache box, got {result.breakdown.case}")
                row = (result.breakdown.ttft_ms, mmlu.parse_answer(result.text), target.answer, topic)
                arms[arm].append(row)
                if arm == "modules":
                    rows["modules"].append(row)
                    if all(choice == "a" for choice in choices):
                        arms.setdefault("modules-a", []).append(row)
            if progress:
                progress()
        base, cached = median(r[0] for r in rows["baseline"]), median(r[0] for r in rows["modules"])
        per_topic[topic] = {
            "baseline_ttft_ms": base,
            "cached_ttft_ms": cached,
            "ratio": round(cached / base, 4) if base else None,
        }

    def summary(rows):
        return {
            "ttft_ms": median(row[0] for row in rows),
            **_accuracy([row[1] for row in rows], [row[2] for row in rows]),
        }

    baseline, cached = summary(arms["baseline"]), summary(arms["modules"])
    agree = sum(b[1] == m[1] for b, m in zip(arms["baseline"], arms["modules"])) / len(arms["baseline"])
    return {
        "baseline_ttft_ms": baseline["ttft_ms"],
        "cached_ttft_ms": cached["ttft_ms"],
        "ratio": round(cached["ttft_ms"] / baseline["ttft_ms"], 4) if baseline["ttft_ms"] else None,
        "accuracy_baseline": baseline["accuracy"],
        "accuracy_cached": cached["accuracy"],
        "n": len(arms["baseline"]),
        "accuracy_baseline_ci95": baseline["ci95"],
        "accuracy_cached_ci95": cached["ci95"],
        "answer_agreement": round(agree, 4),
        "scaffold": {
            "prompts": "those importing every 'a' example, which the scaffold encodes jointly",
            "baseline": summary(arms.get("baseline-a", [])),
            "modules": summary(arms.get("modules-a", [])),
            "scaffold": summary(arms["scaffold"]),
        },
        "per_topic": per_topic,
        "topics": topics,
        "shots": shots,
    }


# -- the command (python manage.py bench modules) ------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--topics", nargs="+", default=None, metavar="TOPIC", help="MMLU topics (default: all 57)")
    parser.add_argument(
        "--prompts",
        type=int,
        default=DEFAULT_PROMPTS_PER_TOPIC,
        help="questions per topic (default 6: 342 over all topics)",
    )
    parser.add_argument("--shots", type=int, default=5)


def run(ctx, *, topics, prompts, shots, **options) -> dict:
    import time

    if prompts < 1 or not 0 <= shots <= 8:
        raise BenchError("--prompts must be at least 1 and --shots between 0 and 8")
    try:
        chosen = topics_named(topics) if topics else mmlu.topics()
    except FileNotFoundError as exc:
        raise BenchError(str(exc))
    namespace = f"bench-modules-{int(time.time())}"
    with ctx.board() as board:
        try:
            with ctx.progress(total=prompts * len(chosen), desc=f"bench modules ({shots}-shot)", unit="prompt") as bar:
                try:
                    document = run_modules(board, chosen, prompts, shots, namespace=namespace, progress=bar.update)
                except ValueError as exc:
                    raise BenchError(str(exc))
            document["machine"] = machine_info(board)
        finally:
            board.store.flush(namespace)
    return document


def lines(doc: dict) -> list[str]:
    sc = doc["scaffold"]
    topics = len(doc["topics"])
    return [
        f"\n{doc['n']} prompts ({topics} topic{'s' if topics > 1 else ''}; {doc['shots']}-shot), medians:\n"
        f"  TTFT full prefill {doc['baseline_ttft_ms']:.1f} ms, from cached modules {doc['cached_ttft_ms']:.1f} ms: ratio {doc['ratio']}\n"
        f"  accuracy full prefill {doc['accuracy_baseline']:.3f} {doc['accuracy_baseline_ci95']}, "
        f"modules {doc['accuracy_cached']:.3f} {doc['accuracy_cached_ci95']}; same answer in {doc['answer_agreement']:.3f}\n"
        f"  on the {sc['baseline']['n']} prompts a scaffold covers: full prefill {sc['baseline']['accuracy']:.3f}, "
        f"modules {sc['modules']['accuracy']:.3f}, scaffold {sc['scaffold']['accuracy']:.3f} (TTFT {sc['scaffold']['ttft_ms']:.1f} ms)"
    ]


def headline(doc: dict) -> str:
    return f"modules / full prefill TTFT {doc['ratio']}, accuracy {doc['accuracy_baseline']} vs {doc['accuracy_cached']}, n={doc['n']}"


BENCH = Benchmark(
    name="modules",
    format=1,
    help="Prompt Cache on MMLU: modules vs full prefill, accuracy and TTFT",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=modules_report,
    headline=headline,
)
