"""python manage.py bench {cases,topics} ...: benchmarks that print and save their figures."""

from __future__ import annotations

import json
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from inference import mmlu
from inference.benchmarks.cases import run_cases
from inference.benchmarks.common import machine_info, save_json
from inference.board import Board


class Command(BaseCommand):
    help = "Benchmarks: `bench cases` reproduces the paper's five cache cases on MMLU; `bench topics` lists topics."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="bench", required=True)
        cases = sub.add_parser("cases", help="cases 1-5 of the paper on MMLU prompts")
        cases.add_argument("--topic", default="astronomy", help="MMLU topic (see `bench topics`)")
        cases.add_argument("--prompts", type=int, default=20, help="number of target questions")
        cases.add_argument("--shots", type=int, default=5, help="few-shot examples per prompt")
        cases.add_argument("--max-tokens", type=int, default=4, help="tokens generated per run")
        cases.add_argument("--json", default=None, metavar="PATH", help="where to save the JSON (default bench-results/...)")
        modules = sub.add_parser("modules", help="Prompt Cache on MMLU: modules vs full prefill, accuracy and TTFT")
        modules.add_argument("--topics", nargs="+", default=None, metavar="TOPIC", help="MMLU topics (default: all 57)")
        modules.add_argument("--prompts", type=int, default=6, help="questions per topic (default 6: 342 over all topics)")
        modules.add_argument("--shots", type=int, default=5)
        modules.add_argument("--json", default=None, metavar="PATH")
        sub.add_parser("topics", help="list the 57 MMLU topics and their sizes")

    def handle(self, *args, bench, **options):
        return getattr(self, f"bench_{bench}")(**options)

    def bench_topics(self, **options):
        for topic, questions in sorted(mmlu.load_questions().items()):
            self.stdout.write(f"{len(questions):5d}  {topic}")

    def bench_cases(self, topic, prompts, shots, max_tokens, json: str | None, **options):
        if prompts < 1:
            raise CommandError("--prompts must be at least 1")
        try:
            selected = mmlu.build_prompts(topic, shots, prompts)
        except (mmlu.UnknownTopic, ValueError, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        board = Board.from_settings(background_sync=False)
        try:
            if board.store is None or not board.store.ping():
                raise CommandError("the cache box does not answer; start it with `python manage.py cachebox start` or fix REDIS_URL")
            with tqdm(total=len(selected), desc=f"bench cases ({selected[0].target.topic}, {shots}-shot)", unit="prompt") as bar:
                document = run_cases(board, selected, max_tokens=max_tokens, progress=bar.update)
            document.update(
                {"topic": selected[0].target.topic, "shots": shots, "max_tokens": max_tokens, "machine": machine_info(board)}
            )
        finally:
            board.close()
        path = save_json(json or self._default_path("cases"), document)
        self._print_cases(document)
        self.stdout.write(f"saved {path}")

    def bench_modules(self, topics, prompts, shots, json: str | None, **options):
        from inference.benchmarks.modules import run_modules

        if prompts < 1 or not 0 <= shots <= 8:
            raise CommandError("--prompts must be at least 1 and --shots between 0 and 8")
        try:
            chosen = [mmlu.normalize_topic(topic) for topic in topics] if topics else mmlu.topics()
        except (mmlu.UnknownTopic, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        board = Board.from_settings(background_sync=False)
        namespace = f"bench-modules-{int(time.time())}"
        try:
            if board.store is None or not board.store.ping():
                raise CommandError("the cache box does not answer; start it with `python manage.py cachebox start` or fix REDIS_URL")
            with tqdm(total=prompts * len(chosen), desc=f"bench modules ({shots}-shot)", unit="prompt") as bar:
                try:
                    document = run_modules(board, chosen, prompts, shots, namespace=namespace, progress=bar.update)
                except ValueError as exc:
                    raise CommandError(str(exc))
            document["machine"] = machine_info(board)
        finally:
            board.store.flush(namespace)
            board.close()
        path = save_json(json or self._default_path("modules"), document)
        sc = document["scaffold"]
        self.stdout.write(
            f"\n{document['n']} prompts ({len(chosen)} topic{'s' if len(chosen) > 1 else ''}; {shots}-shot), medians:\n"
            f"  TTFT full prefill {document['baseline_ttft_ms']:.1f} ms, from cached modules {document['cached_ttft_ms']:.1f} ms: ratio {document['ratio']}\n"
            f"  accuracy full prefill {document['accuracy_baseline']:.3f} {document['accuracy_baseline_ci95']}, "
            f"modules {document['accuracy_cached']:.3f} {document['accuracy_cached_ci95']}; same answer in {document['answer_agreement']:.3f}\n"
            f"  on the {sc['baseline']['n']} prompts a scaffold covers: full prefill {sc['baseline']['accuracy']:.3f}, "
            f"modules {sc['modules']['accuracy']:.3f}, scaffold {sc['scaffold']['accuracy']:.3f} (TTFT {sc['scaffold']['ttft_ms']:.1f} ms)\n"
            f"saved {path}"
        )

    def _default_path(self, name: str) -> Path:
        return Path(settings.BASE_DIR) / "bench-results" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"

    def _print_cases(self, doc: dict) -> None:
        header = f"{'case':<32}{'TTFT':>9}{'TTLT':>9}{'Token':>8}{'Bloom':>7}{'P-dec':>9}{'Redis':>8}{'R-dec':>8}{'Sample':>8}{'matched':>9}{'tokens':>8}{'MB':>7}"
        self.stdout.write(f"\nMedians over {doc['n']} prompts ({doc['topic']}, {doc['shots']}-shot), milliseconds:")
        self.stdout.write(header)
        for case, row in doc["cases"].items():
            b = row["breakdown_ms"]
            self.stdout.write(
                f"{case + ' ' + row['name']:<32}{row['ttft_ms']:>9.1f}{row['ttlt_ms']:>9.1f}{b['token_ms']:>8.2f}{b['bloom_ms']:>7.3f}"
                f"{b['prefill_ms']:>9.1f}{b['redis_ms']:>8.1f}{b['decode_ms']:>8.1f}{b['sample_ms']:>8.2f}"
                f"{row['matched_tokens']:>9.0f}{row['prompt_tokens']:>8.0f}{row['state_bytes'] / 1e6:>7.2f}"
            )
        self.stdout.write(
            f"full-hit TTFT / cold TTFT = {doc['ttft_ratio_full_to_cold']}; greedy agreement = {doc['greedy_agreement']}; "
            f"accuracy case 1 = {doc['accuracy']['1']}, case 5 = {doc['accuracy']['5']}; "
            f"bytes per cached token = {doc['bytes_per_cached_token']}; catalog lookup median = {doc['catalog_lookup_ms']} ms"
        )
