"""python manage.py bench {cases,topics} ...: benchmarks that print and save their figures."""

from __future__ import annotations

import importlib
import math
import signal
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from cachebox.errors import CacheBoxUnavailable
from inference import mmlu
from inference.benchmarks.cases import run_cases
from inference.benchmarks.common import machine_info, save_json
from inference.board import Board

from dashboard.signing import control_plane_keys, keyring_for

# Lab studies that live in their own module: ``add_arguments(parser)`` and ``handle(command, **options)``
# (the command gives them ``stdout``, ``_save`` and ``_default_path``).
LAB_STUDIES = {
    "lab-exit": ("inference.benchmarks.early_exit", "early exit with KV fill (seed 002) on the reference engine: speed-quality curve across thresholds"),
    "lab-anchors": ("inference.benchmarks.anchors", "anchor tokens (seed 004): KV and entry bytes, speed, MMLU accuracy, base and anchor-tuned, full and pruned"),
}


def _lab_study(name: str):
    module_name = LAB_STUDIES[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return None  # not in this checkout


class Command(BaseCommand):
    help = "Benchmarks: `bench cases` reproduces the paper's five cache cases on MMLU; `bench topics` lists topics."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="bench", required=True)
        cases = sub.add_parser("cases", help="cases 1-5 of the paper on MMLU prompts")
        cases.add_argument("--topic", default="astronomy", help="MMLU topic (see `bench topics`)")
        cases.add_argument("--prompts", type=int, default=20, help="number of target questions")
        cases.add_argument("--shots", type=int, default=5, help="few-shot examples per prompt")
        cases.add_argument("--max-tokens", type=int, default=4, help="tokens generated per run")
        cases.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="where to save the JSON (default bench-results/...)")
        modules = sub.add_parser("modules", help="Prompt Cache on MMLU: modules vs full prefill, accuracy and TTFT")
        modules.add_argument("--topics", nargs="+", default=None, metavar="TOPIC", help="MMLU topics (default: all 57)")
        modules.add_argument("--prompts", type=int, default=6, help="questions per topic (default 6: 342 over all topics)")
        modules.add_argument("--shots", type=int, default=5)
        modules.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        breakeven = sub.add_parser("breakeven", help="always / never / adaptive fetching under each emulated link")
        breakeven.add_argument("--topic", default="astronomy")
        breakeven.add_argument("--prompts", type=int, default=30)
        breakeven.add_argument("--shots", type=int, default=5)
        breakeven.add_argument("--threads", type=int, default=0, help="llama.cpp threads of the measured engine (1: board-like; default: every core)")
        breakeven.add_argument("--links", nargs="+", default=None, metavar="PRESET", help="link presets (default: wifi4 fast-ethernet none)")
        breakeven.add_argument("--cases", nargs="+", default=None, metavar="CASE", help="the paper's cases 1-5 (default: all)")
        breakeven.add_argument("--modes", nargs="+", default=None, metavar="MODE", help="always never fetch-or-compute adaptive (default: all)")
        breakeven.add_argument("--profile", default="", help="pace the engine to a board class: pi-zero-2w or pi5 (emulated; default: this machine)")
        breakeven.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        kv = sub.add_parser("kv", help="state codecs (bytes, speed) and quantized KV (q8_0, q4_0) against f16: agreement, accuracy, KL")
        kv.add_argument("--topics", nargs="+", default=["astronomy", "high_school_biology", "world_religions"], metavar="TOPIC")
        kv.add_argument("--prompts", type=int, default=100, help="questions per topic (default 100: 300 paired prompts)")
        kv.add_argument("--shots", type=int, default=3)
        kv.add_argument("--held-out", nargs="+", default=["philosophy", "prehistory"], metavar="TOPIC", help="topics whose questions are the KL text")
        kv.add_argument("--texts", type=int, default=16, help="held-out texts per topic for the KL (64 positions each)")
        kv.add_argument("--threads", type=int, default=0)
        kv.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        peers = sub.add_parser("peers", help="EdgeCache against no cache, llama-cpp-python's caches and the paper's design")
        peers.add_argument("--topic", default="astronomy")
        peers.add_argument("--prompts", type=int, default=5)
        peers.add_argument("--shots", type=int, default=5)
        peers.add_argument("--max-tokens", type=int, default=4)
        peers.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        catalog = sub.add_parser("catalog", help="hit-ratio sweep with and without the catalog; false positives")
        catalog.add_argument("--prompts", type=int, default=10, help="prompts, one per MMLU topic (no shared prefixes)")
        catalog.add_argument("--shots", type=int, default=5)
        catalog.add_argument("--link", default="wifi4", help="link preset for the cache-box traffic (default wifi4)")
        catalog.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        scale = sub.add_parser("scale", help="cold and full-hit TTFT from 128 to 2048 prompt tokens")
        scale.add_argument("--repeats", type=int, default=3)
        scale.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        load = sub.add_parser("load", help="N boards (one process each) send MMLU prompts to one cache box for a bounded time")
        load.add_argument("--devices", type=int, default=8, help="board processes (1 llama.cpp thread each; default 8)")
        load.add_argument("--seconds", type=float, default=60, help="how long prompts are dispatched (default 60)")
        load.add_argument("--shots", type=int, default=5)
        load.add_argument("--topics", nargs="+", default=None, metavar="TOPIC", help="MMLU topics the prompts come from (default: 3)")
        load.add_argument("--prompts", type=int, default=8, help="questions per topic in the pool prompts are drawn from (default 8)")
        load.add_argument("--max-tokens", type=int, default=4, help="tokens generated per run")
        load.add_argument("--drain", type=float, default=60, help="seconds to wait for outstanding answers after the clock")
        load.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        exact = sub.add_parser("exact", help="a cached answer is the cold answer: agreement by case, and what the batch cuts cost")
        exact.add_argument("--topics", nargs="+", default=["astronomy", "high_school_biology", "world_religions"], metavar="TOPIC")
        exact.add_argument("--prompts", type=int, default=34, help="questions per topic (default 34: 102 over 3 topics)")
        exact.add_argument("--shots", type=int, default=5)
        exact.add_argument("--max-tokens", type=int, default=8, help="greedy tokens compared per run")
        exact.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        tiers = sub.add_parser("tiers", help="full hits from the board's context, its RAM tier, the cache box, and llama-cpp-python's LlamaRAMCache")
        tiers.add_argument("--topic", default="astronomy")
        tiers.add_argument("--prompts", type=int, default=10)
        tiers.add_argument("--shots", type=int, default=5)
        tiers.add_argument("--max-tokens", type=int, default=4)
        tiers.add_argument("--conversations", type=int, default=4, help="four-turn conversations played from the context, the cache box and cold (0: skip)")
        tiers.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        api = sub.add_parser("api", help="concurrent streaming clients of the OpenAI-compatible API against the online boards (a running server)")
        api.add_argument("--url", default="http://127.0.0.1:8000", help="the running dashboard (default http://127.0.0.1:8000; `make run`)")
        api.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
        api.add_argument("--seconds", type=float, default=30, help="how long requests are sent (default 30)")
        api.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
        api.add_argument("--namespace", default="default", help="the namespace whose boards answer (a temporary API key of it is made, then revoked)")
        api.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        fleet = sub.add_parser("fleet", help="random, round-robin and cache-aware routing of one MMLU arrival stream over N in-process boards")
        fleet.add_argument("--boards", type=int, default=4, help="in-process boards, 1 llama.cpp thread each (default 4)")
        fleet.add_argument("--topics", nargs="+", default=None, metavar="TOPIC", help="MMLU topics, interleaved (default: 4)")
        fleet.add_argument("--prompts", type=int, default=40, help="prompts in the stream, over all topics (default 40)")
        fleet.add_argument("--shots", type=int, default=5)
        fleet.add_argument("--max-tokens", type=int, default=4)
        fleet.add_argument("--link", default="wifi4", help="link preset between boards and cache box (default wifi4; none: loopback)")
        fleet.add_argument("--ram-mb", type=int, default=None, help="each board's RAM tier in MB (default: the board default, EDGECACHE_RAM_TIER_MB)")
        fleet.add_argument("--spacing", type=float, default=1.0, help="arrivals every this many cold TTFTs of one board alone (default 1.0)")
        fleet.add_argument("--seed", type=int, default=7)
        fleet.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        lab = sub.add_parser("lab", help="the reference engine against llama.cpp; KV prediction (seed 001) for each k against full prefill")
        lab.add_argument("--ks", nargs="+", type=int, default=[3, 6, 9], metavar="K", help="auxiliary layers to try (default 3 6 9)")
        lab.add_argument("--prompts", type=int, default=300, help="5-shot MMLU prompts over all topics (default 300)")
        lab.add_argument("--shots", type=int, default=5)
        lab.add_argument("--heldout", type=int, default=57, help="held-out texts for the next-token KL (default 57)")
        lab.add_argument("--reference-prompts", type=int, default=200, help="0-shot MMLU prompts the reference engine is checked on (0: skip)")
        lab.add_argument("--calibration-docs", type=int, default=57, help="calibration documents when a predictor must be fitted (default 57, one per topic)")
        lab.add_argument("--threads", type=int, default=0, help="llama.cpp threads (default: the board's; 1 keeps timings steady on a shared machine)")
        lab.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        for name, (_, help_text) in LAB_STUDIES.items():
            study = _lab_study(name)
            if study is not None:
                study.add_arguments(sub.add_parser(name, help=help_text))
        footprint = sub.add_parser("footprint", help="a board's memory (peak RSS, PSS, by part) in a process of its own, sized to a registered memory, with TTFT beside an unsized board")
        footprint.add_argument("--memory-mb", type=int, default=512, help="the board's registered memory (default 512: a Pi Zero 2W)")
        footprint.add_argument("--runs", type=int, default=50, help="runs: cold, misses, partial and full hits, a 4-turn conversation, schema runs (default 50)")
        footprint.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the board (default 1)")
        footprint.add_argument("--no-compare", dest="compare", action="store_false", help="skip the unsized board (no TTFT ratios)")
        footprint.add_argument("--json", dest="json_path", default=None, metavar="PATH")
        sub.add_parser("topics", help="list the 57 MMLU topics and their sizes")

    def handle(self, *args, bench, **options):
        if bench in LAB_STUDIES:
            return _lab_study(bench).handle(self, **options)
        return getattr(self, f"bench_{bench}")(**options)

    def bench_topics(self, **options):
        for topic, questions in sorted(mmlu.load_questions().items()):
            self.stdout.write(f"{len(questions):5d}  {topic}")

    def bench_cases(self, topic, prompts, shots, max_tokens, json_path: str | None, **options):
        if prompts < 1:
            raise CommandError("--prompts must be at least 1")
        try:
            selected = mmlu.build_prompts(topic, shots, prompts)
        except (mmlu.UnknownTopic, ValueError, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        board = Board.start(settings.EDGECACHE_BOARD, keys=control_plane_keys(), background_sync=False).cachebox_only()  # measure the cache box, not the board-local tiers
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
        from inference.benchmarks.reports import cases_report

        self._print_cases(document)
        self._save("cases", json_path, document, cases_report)

    def bench_modules(self, topics, prompts, shots, json_path: str | None, **options):
        from inference.benchmarks.modules import run_modules

        if prompts < 1 or not 0 <= shots <= 8:
            raise CommandError("--prompts must be at least 1 and --shots between 0 and 8")
        try:
            chosen = [mmlu.normalize_topic(topic) for topic in topics] if topics else mmlu.topics()
        except (mmlu.UnknownTopic, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        board = Board.start(settings.EDGECACHE_BOARD, keys=control_plane_keys(), background_sync=False).cachebox_only()  # measure the cache box, not the board-local tiers
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
        from inference.benchmarks.reports import modules_report

        sc = document["scaffold"]
        self.stdout.write(
            f"\n{document['n']} prompts ({len(chosen)} topic{'s' if len(chosen) > 1 else ''}; {shots}-shot), medians:\n"
            f"  TTFT full prefill {document['baseline_ttft_ms']:.1f} ms, from cached modules {document['cached_ttft_ms']:.1f} ms: ratio {document['ratio']}\n"
            f"  accuracy full prefill {document['accuracy_baseline']:.3f} {document['accuracy_baseline_ci95']}, "
            f"modules {document['accuracy_cached']:.3f} {document['accuracy_cached_ci95']}; same answer in {document['answer_agreement']:.3f}\n"
            f"  on the {sc['baseline']['n']} prompts a scaffold covers: full prefill {sc['baseline']['accuracy']:.3f}, "
            f"modules {sc['modules']['accuracy']:.3f}, scaffold {sc['scaffold']['accuracy']:.3f} (TTFT {sc['scaffold']['ttft_ms']:.1f} ms)"
        )
        self._save("modules", json_path, document, modules_report)

    def bench_exact(self, topics, prompts, shots, max_tokens, json_path: str | None, **options):
        from inference.benchmarks.exact import run_exact
        from inference.benchmarks.reports import exact_report

        try:
            chosen = [mmlu.normalize_topic(topic) for topic in topics]
        except (mmlu.UnknownTopic, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        if prompts < 2:
            raise CommandError("--prompts must be at least 2 (the first prompt of a topic stores, the others hit)")
        board = self._board()
        try:
            with tqdm(total=2 * prompts * len(chosen), desc=f"bench exact ({len(chosen)} topics, {shots}-shot)", unit="run") as bar:
                document = run_exact(board, chosen, prompts, shots, max_tokens=max_tokens, progress=bar.update)
            document.update({"shots": shots, "machine": machine_info(board)})
        finally:
            board.close()
        self.stdout.write(f"\ngrid {document['grid']} tokens; cold prefill, median ms (ratio to n_batch batches):")
        for name, row in document["cut_costs"].items():
            self.stdout.write(f"  {name:<14} {row['prefill_ms']:9.1f}  x{row['ratio_to_uncut']}")
        self.stdout.write(f"resumed logits bitwise identical to cold: {document['resumed_logits_bitwise_identical']} (max |diff| {document['resumed_logits_max_abs_diff']})")
        for case, row in document["by_case"].items():
            self.stdout.write(f"  {case:<8} {row['runs']:4d} runs  greedy agreement {row['greedy_agreement']}  TTFT {row['median_ttft_ms']} ms (cold {row['median_cold_ttft_ms']} ms)")
        self._save("exact", json_path, document, exact_report)

    def bench_kv(self, topics, prompts, shots, held_out, texts, threads, json_path: str | None, **options):
        from inference.benchmarks.kv import run_kv
        from inference.benchmarks.reports import kv_report

        try:
            chosen = [mmlu.normalize_topic(topic) for topic in topics]
            spare = [mmlu.normalize_topic(topic) for topic in held_out]
        except (mmlu.UnknownTopic, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        if set(chosen) & set(spare):
            raise CommandError("the held-out topics must differ from the evaluated ones")
        selected = [prompt for topic in chosen for prompt in self._prompts(topic, shots, prompts)]
        questions = mmlu.load_questions()
        held_out_texts = [question.render(with_answer=True) for topic in spare for question in questions[topic][:texts]]
        board = self._board(threads=threads or None)
        machine, model_file = machine_info(board), board.engine.model_file
        board.close()
        with tqdm(total=len(selected), desc=f"bench kv ({len(selected)} prompts x f16, q8_0, q4_0)", unit="prompt") as bar:
            document = run_kv(model_file, selected, held_out_texts, threads=threads, progress=bar.update)
        document.update({"topics": chosen, "held_out_topics": spare, "shots": shots, "machine": machine})
        self.stdout.write(f"\n{document['n']} paired prompts ({shots}-shot), KL over {document['kl_positions']} held-out positions")
        self.stdout.write(f"{'KV':<6}{'B/token':>9}{'zstd-shuffle':>14}{'decode/saving':>15}{'accuracy':>10}{'1st-token agr':>15}{'answer agr':>12}{'KL mean':>10}")
        for kv, row in document["kv_types"].items():
            shuffled = row["codecs"]["zstd-shuffle"]
            self.stdout.write(
                f"{kv:<6}{row['bytes_per_token']:>9.0f}{shuffled['ratio']:>13.3f}x{shuffled['wifi4_decode_to_saving'] or 0:>15.3f}"
                f"{row['accuracy']:>10.3f}{row['first_token_agreement']:>15.3f}{row['answer_agreement']:>12.3f}{row.get('kl_mean') or 0:>10.4f}"
            )
        self._save("kv", json_path, document, kv_report)

    def bench_tiers(self, topic, prompts, shots, max_tokens, conversations, json_path: str | None, **options):
        from inference.benchmarks.reports import tiers_report
        from inference.benchmarks.tiers import run_conversations, run_tiers

        selected = self._prompts(topic, shots, prompts)
        board = self._board()
        try:
            with tqdm(total=2 * len(selected) + conversations, desc="bench tiers", unit="step") as bar:
                document = run_tiers(board, selected, max_tokens=max_tokens, progress=bar.update)
                if conversations > 0:
                    document["conversation"] = run_conversations(board, (selected * conversations)[:conversations], progress=bar.update)
            document.update({"topic": selected[0].target.topic, "shots": shots, "machine": machine_info(board)})
        finally:
            board.close()
        self.stdout.write(f"\nfull-hit TTFT, median ms over {document['n']} prompts: " + ", ".join(f"{k} {v}" for k, v in document["median_ttft_ms"].items()))
        self.stdout.write(f"ratios: {document['ratios']}")
        self.stdout.write(f"network bytes: {document['network_bytes']}; agreement with cold: {document['agreement_with_cold']}")
        if "conversation" in document:
            later = document["conversation"]["later_turns"]
            self.stdout.write(
                f"conversations ({document['conversation']['conversations']} x {document['conversation']['turns']} turns), later turns, medians: "
                f"prompt {later['median_prompt_tokens']} tokens, new {later['median_new_tokens']}, prefilled {later['median_prefilled_tokens']} "
                f"(from the cache box on another board: {later['median_cachebox_prefilled_tokens']}); prefilled only the new tokens in "
                f"{later['prefilled_equals_new_tokens']:.0%} of turns; TTFT {later['median_ttft_ms']}; next-turn preparation {later['median_next_turn_ms']} ms "
                f"after each answer; agreement with cold {later['agreement_with_cold']}"
            )
        self._save("tiers", json_path, document, tiers_report)

    def bench_api(self, url, clients, seconds, max_tokens, namespace, json_path: str | None, **options):
        from dashboard.api.bench import api_report, models, run_api_bench
        from dashboard.api.keys import create_key, revoke_key

        if clients < 1 or not 0 < seconds <= 3600 or max_tokens < 1:
            raise CommandError("--clients must be at least 1, --seconds between 0 and 3600, --max-tokens at least 1")
        try:
            row, key = create_key(None, namespace, name="bench api (temporary)", rate_per_minute=0)
        except ValueError as exc:
            raise CommandError(str(exc))
        try:
            try:
                served = models(url, key)
            except (OSError, RuntimeError) as exc:
                raise CommandError(f"the API at {url} does not answer ({exc}); start the dashboard (`make run`) or pass --url")
            if not served:
                raise CommandError(f"no board of namespace {namespace!r} is online; start one with `python manage.py edge --name NAME`")
            with tqdm(desc=f"bench api ({clients} clients, {seconds:g} s)", unit="request") as bar:
                document = run_api_bench(url, key, served[0], clients=clients, seconds=seconds, max_tokens=max_tokens, progress=bar.update)
        finally:
            revoke_key(None, row)
        self.stdout.write(
            f"\n{document['requests']} requests, {document['errors']} errors, {document['requests_per_s']} requests/s, {document['chunks_per_s']} chunks/s"
        )
        for name in ("first_chunk_ms", "api_ms", "queue_ms", "board_ttft_ms", "first_minus_board_ttft_ms", "overhead_ms", "total_ms"):
            self.stdout.write(f"  {name:<26} p50 {document[name]['p50']}  p99 {document[name]['p99']}")
        for example in document["error_examples"]:
            self.stdout.write(f"  error: {example}")
        self._save("api", json_path, document, api_report)

    def bench_footprint(self, memory_mb, runs, threads, compare, json_path: str | None, **options):
        from inference.benchmarks import footprint

        if memory_mb < 64 or runs < 1 or threads < 1:
            raise CommandError("--memory-mb must be at least 64, --runs and --threads at least 1")
        env = {"EDGECACHE_HOME": str(settings.EDGECACHE_EMBEDDED_DIR.parent), "REDIS_URL": settings.REDIS_URL}
        if settings.EDGECACHE_CACHEBOX_URL:
            env["EDGECACHE_CACHEBOX_URL"] = settings.EDGECACHE_CACHEBOX_URL
        try:
            from inference.board import broker_url

            broker_url(settings.EDGECACHE_BOARD)  # the embedded cache box starts here, once
        except CacheBoxUnavailable as exc:
            raise CommandError(str(exc))
        self.stdout.write(f"bench footprint: a {memory_mb} MB board serves {runs} runs" + (", then an unsized one the same runs" if compare else ""))
        try:
            document = footprint.run(
                {"memory_mb": memory_mb, "runs": runs, "threads": threads, "compare": compare, "ring": lambda namespace: keyring_for(namespace).to_dict(),
                 "board_env": env, "progress": lambda label: self.stdout.write(f"  {label} board done")}
            )
        except footprint.FootprintError as exc:
            raise CommandError(str(exc))
        self.stdout.write(
            f"\npeak RSS {document['peak_rss_mb']} MB, PSS {document['pss_mb']} MB (budget {document['budget_mb']} MB of {memory_mb} MB: "
            f"{'within' if document['within_budget'] else 'over'}); unsized board: peak {document.get('peak_rss_mb_unsized', '-')} MB; "
            f"answers agree with cold: {document['agreement_with_cold']}"
        )
        for row in document["parts"]:
            self.stdout.write(f"  {row['mb']:>7.1f} MB  {row['part']}")
        for label, row in (document.get("ttft") or {}).items():
            self.stdout.write(f"  TTFT {label:<28} sized {row['sized_ms']}  unsized {row['unsized_ms']}  ratio {row['ratio']}  (n {row['n'][0]}/{row['n'][1]})")
        self._save("footprint", json_path, document, footprint.report)

    def _prompts(self, topic: str, shots: int, count: int):
        if count < 1:
            raise CommandError("--prompts must be at least 1")
        try:
            return mmlu.build_prompts(topic, shots, count)
        except (mmlu.UnknownTopic, ValueError, FileNotFoundError) as exc:
            raise CommandError(str(exc))

    def _board(self, **config) -> Board:
        board_config = settings.EDGECACHE_BOARD.with_(**config)
        board = Board.start(board_config, keys=control_plane_keys(), background_sync=False).cachebox_only()  # measure the cache box, not the board-local tiers
        if board.store is None or not board.store.ping():
            board.close()
            raise CommandError("the cache box does not answer; start it with `python manage.py cachebox start` or fix REDIS_URL")
        return board

    def _save(self, name: str, json_path: str | None, document: dict, report) -> None:
        path = save_json(json_path or self._default_path(name), document)
        html_path = report(path.with_suffix(".html"), document)
        self.stdout.write(f"saved {path} and {html_path}")

    def bench_breakeven(self, topic, prompts, shots, threads, links, cases, modes, profile, json_path: str | None, **options):
        from cachebox.link import LINK_PRESETS
        from inference.benchmarks.breakeven import MODES, PRESETS, run_breakeven
        from inference.benchmarks.cases import CASE_NAMES
        from inference.benchmarks.reports import breakeven_report
        from inference.compute_profile import profile_named

        links, cases, modes = links or list(PRESETS), cases or list(CASE_NAMES), modes or list(MODES)
        for name, given, known in (("link", links, LINK_PRESETS), ("case", cases, CASE_NAMES), ("mode", modes, MODES)):
            unknown = [value for value in given if value not in known]
            if unknown:
                raise CommandError(f"unknown {name} {', '.join(unknown)}; choose from {', '.join(known)}")
        try:
            profile_named(profile)
        except ValueError as exc:
            raise CommandError(str(exc))
        selected = self._prompts(topic, shots, prompts)
        board = self._board(threads=threads or None, compute_profile=profile or None)
        label = f"{len(links)} links x {len(cases)} cases x {len(modes)} policies, {board.engine.config.threads()} thread(s)"
        try:
            with tqdm(total=len(selected), desc=f"bench breakeven ({label})", unit="prompt") as bar:
                document = run_breakeven(
                    board.engine,
                    board.store.url,
                    selected,
                    keys=board.keys,
                    prefill_ms_per_token=board.config.prefill_ms_per_token,
                    presets=links,
                    cases=cases,
                    modes=modes,
                    progress=bar.update,
                )
            document.update({"topic": selected[0].target.topic, "shots": shots, "machine": machine_info(board)})
        finally:
            board.close()
        if document["compute_profile"]:
            self.stdout.write(f"compute paced to {document['compute_profile']}: every figure below is emulated")
        for preset, data in document["presets"].items():
            self.stdout.write(f"\n{preset} ({data['link']}{', emulated link' if data['emulated'] else ''}; entries stored {data['codec']}): median TTFT ms")
            self.stdout.write(f"{'case':<32}" + "".join(f"{mode:>18}" for mode in modes) + f"{'adaptive/best':>15}")
            for case, row in data["cases"].items():
                name = document["case_names"][case]
                ratio = row.get("adaptive_vs_best")
                note = "" if row.get("within_5pct", True) else "  (over 5%)"
                if "overlap_target_met" in row:
                    note += f"  (target {row['overlap_target']}: {'met' if row['overlap_target_met'] else 'not met'})"
                self.stdout.write(
                    f"{case + ' ' + name:<32}" + "".join(f"{row[mode + '_ttft_ms']:>18.1f}" for mode in modes)
                    + (f"{ratio:>15.3f}" if ratio is not None else f"{'-':>15}") + note
                )
        self.stdout.write(f"\npolicy within 5% of the better fixed choice everywhere: {document['target_met']}")
        if document["overlap_target_met"] is not None:
            self.stdout.write(f"Wi-Fi 4, cases 4 and 5, adaptive at most {document['overlap_target']}x the better fixed choice: {document['overlap_target_met']}")
        self._save("breakeven", json_path, document, breakeven_report)

    def bench_peers(self, topic, prompts, shots, max_tokens, json_path: str | None, **options):
        from inference.benchmarks.peers import run_peers
        from inference.benchmarks.reports import peers_report

        if prompts < 2:
            raise CommandError("--prompts must be at least 2: a hit must not find its prompt still in the context")
        selected = self._prompts(topic, shots, prompts)
        board = self._board()
        try:
            with tqdm(total=6, desc="bench peers", unit="peer") as bar:
                document = run_peers(board, selected, max_tokens=max_tokens, progress=bar.update)
            document.update({"topic": selected[0].target.topic, "shots": shots, "max_tokens": max_tokens, "machine": machine_info(board)})
        finally:
            board.close()
        document["summary"] = f"EdgeCache full-hit TTFT is {document['edgecache_hit_vs_ram_cache_hit']}x faster than a LlamaRAMCache hit."
        self.stdout.write(f"\n{'peer':<42}{'TTFT':>10}{'TTLT':>10}{'hit TTFT':>10}{'state MB':>10}{'agree':>8}")
        for name, row in document["peers"].items():
            self.stdout.write(
                f"{name:<42}{row['ttft_ms']:>10.1f}{row['ttlt_ms']:>10.1f}{row['hit_ttft_ms']:>10.1f}{row['state_bytes'] / 1e6:>10.2f}{row['agreement_with_cold']:>8.2f}"
            )
        self.stdout.write(document["summary"])
        self._save("peers", json_path, document, peers_report)

    def bench_catalog(self, prompts, shots, link, json_path: str | None, **options):
        from cachebox.link import LINK_PRESETS
        from inference.benchmarks.catalog import HIT_RATIOS, run_catalog
        from inference.benchmarks.reports import catalog_report

        if link not in LINK_PRESETS or LINK_PRESETS[link] is None:
            raise CommandError(f"--link must be one of {', '.join(k for k, v in LINK_PRESETS.items() if v)}")
        if not 1 <= prompts <= 57:
            raise CommandError("--prompts must be between 1 and 57 (one prompt per MMLU topic)")
        # One prompt per topic: no two share a prefix, so an uncached prompt is a true miss.
        selected = [mmlu.build_prompts(name, shots, 1)[0] for name in mmlu.topics()[:prompts]]
        board = self._board()
        try:
            with tqdm(total=2 * len(HIT_RATIOS), desc="bench catalog", unit="pass") as bar:
                document = run_catalog(board.engine, board.store.url, selected, keys=board.keys, link_preset=link, progress=bar.update)
            document.update({"topics": [p.target.topic for p in selected], "shots": shots, "machine": machine_info(board)})
        finally:
            board.close()
        self.stdout.write(f"\n{document['link']}; mean TTFT ms over {document['n']} prompts")
        self.stdout.write(f"{'hit ratio':>10}{'catalog':>12}{'no catalog':>12}{'miss cost without':>20}")
        for row in document["sweep"]:
            self.stdout.write(
                f"{row['hit_ratio']:>10.1f}{row['with_catalog']['mean_ttft_ms']:>12.1f}{row['without_catalog']['mean_ttft_ms']:>12.1f}"
                f"{row['without_catalog']['miss_network_ms']:>17.1f} ms"
            )
        for row in document["false_positives"]:
            self.stdout.write(f"false positives at capacity {row['capacity']}: observed {row['observed']}, configured {row['configured']} ({row['size_bytes'] / 1e6:.2f} MB)")
        document["summary"] = "Catalog: a sure miss costs no network; without it every miss asks the cache box."
        self._save("catalog", json_path, document, catalog_report)

    def bench_scale(self, repeats, json_path: str | None, **options):
        from inference.benchmarks.reports import scale_report
        from inference.benchmarks.scale import LENGTHS, run_scale

        board = self._board()
        try:
            with tqdm(total=len(LENGTHS), desc="bench scale", unit="length") as bar:
                document = run_scale(board, repeats=repeats, progress=bar.update)
            document["machine"] = machine_info(board)
        finally:
            board.close()
        self.stdout.write(f"\n{'tokens':>8}{'cold TTFT':>12}{'hit TTFT':>12}{'ratio':>8}{'state MB':>10}")
        for row in document["lengths"]:
            self.stdout.write(f"{row['prompt_tokens']:>8}{row['cold_ttft_ms']:>12.1f}{row['hit_ttft_ms']:>12.1f}{row['ratio']:>8.3f}{row['state_bytes'] / 1e6:>10.2f}")
        document["summary"] = "Cold prefill grows with the prompt; a hit costs the bytes moved and restored."
        self._save("scale", json_path, document, scale_report)

    def bench_load(self, devices, seconds, shots, topics, prompts, max_tokens, drain, json_path: str | None, **options):
        from cachebox.errors import CacheBoxUnavailable
        from cachebox.store import CacheBox
        from inference.benchmarks.load import DEFAULT_TOPICS, LoadError, LoadRun, prompt_pool
        from inference.benchmarks.reports import load_report
        from inference.board import cachebox_url

        if devices < 1 or seconds <= 0 or prompts < 1 or max_tokens < 1 or drain < 0 or not 0 <= shots <= 8:
            raise CommandError("--devices, --prompts and --max-tokens must be at least 1, --seconds positive, --drain >= 0, --shots 0 to 8")
        try:
            chosen = [mmlu.normalize_topic(topic) for topic in (topics or DEFAULT_TOPICS)]
            pool = prompt_pool(chosen, shots, prompts)
        except (mmlu.UnknownTopic, ValueError, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        try:
            url = cachebox_url(settings.EDGECACHE_BOARD)  # the embedded Valkey starts here, once, not in N boards at a time
        except CacheBoxUnavailable as exc:
            raise CommandError(str(exc))
        store = CacheBox(url)
        if not store.ping():
            raise CommandError("the cache box does not answer; start it with `python manage.py cachebox start` or fix REDIS_URL")
        namespace = f"bench-load-{int(time.time())}"
        bars: dict[str, tqdm] = {"loading": tqdm(total=devices, desc=f"bench load: loading {devices} boards", unit="board")}

        def ready(count: int) -> None:
            bars["loading"].update(count - bars["loading"].n)

        def tick(elapsed: float, state: dict) -> None:
            if "clock" not in bars:
                bars["loading"].close()
                bars["clock"] = tqdm(
                    total=int(math.ceil(seconds)), desc=f"bench load ({devices} boards)", bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} s{postfix}"
                )
            bar = bars["clock"]
            if state["draining"]:
                bar.set_description(f"bench load ({devices} boards): draining")
            bar.set_postfix(runs=state["runs"], errors=state["errors"], out=state["outstanding"], refresh=False)
            bar.update(max(0, min(bar.total, int(elapsed)) - bar.n))
            if state["final"]:
                bar.refresh()

        runner = LoadRun(devices, seconds, pool, namespace=namespace, ring=keyring_for(namespace).to_dict(), max_tokens=max_tokens, drain_seconds=drain, on_ready=ready, on_tick=tick)
        # Ctrl-C must stop the boards even when started from a shell that ignores SIGINT.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            document = runner.run()
        except LoadError as exc:
            raise CommandError(str(exc))
        except KeyboardInterrupt:
            raise CommandError("interrupted: every board was stopped, nothing saved")
        finally:
            for bar in bars.values():
                bar.close()
            try:
                store.flush(namespace)
            except CacheBoxUnavailable:
                pass
        document.update(
            {
                "topics": chosen,
                "shots": shots,
                "prompts_per_topic": prompts,
                "cachebox": {"kind": "embedded valkey" if settings.REDIS_URL_IS_EMBEDDED else f"REDIS_URL ({url.split(':', 1)[0]})", "url": store.safe_url},
            }
        )
        stable = document["p99_stability"]
        document["summary"] = (
            f"{devices} boards x {seconds:g} s: {document['runs']} runs, {document['errors']} errors, {document['lost']} lost; "
            f"TTFT p50 {document['ttft_ms_p50']} ms, p99 {document['ttft_ms_p99']} ms; hit ratio {document['hit_ratio']}; "
            f"{document['cachebox_mb_per_s']} MB/s to and from the cache box."
        )
        self.stdout.write(f"\n{document['summary']}")
        self.stdout.write(
            f"cache box: {document['cachebox']['kind']} at {document['cachebox']['url']}; {document['dispatched']} dispatched, "
            f"{document['repeated_prompts']} exact repeats; cases {document['cases']}; measured {document['measured_seconds']:.1f} s"
        )
        self.stdout.write(f"{'window':>12}{'runs':>6}{'p50 ms':>10}{'p99 ms':>10}{'hit':>7}")
        for w in document["windows"]:
            p50 = "-" if w["ttft_ms_p50"] is None else f"{w['ttft_ms_p50']:.1f}"
            p99 = "-" if w["ttft_ms_p99"] is None else f"{w['ttft_ms_p99']:.1f}"
            label = f"{w['start_s']:g}-{w['end_s']:g} s"
            self.stdout.write(f"{label:>12}{w['runs']:>6}{p50:>10}{p99:>10}{w['hit_ratio']:>7.2f}")
        self.stdout.write("runs per board: " + ", ".join(f"{b['board']} {b['runs']}" for b in document["per_board"]))
        starts = ", ".join(f"{start:g}" for start in stable["windows_compared"]) or "none"
        steady = document["after_warmup"]
        self.stdout.write(
            f"warm-up (until every board answered once): {stable['warmup_s']} s; after it {steady['runs']} runs, "
            f"TTFT p50 {steady['ttft_ms_p50']} ms, p99 {steady['ttft_ms_p99']} ms\n"
            f"p99 stability over the windows after it with >= {stable['min_runs']} runs (start s: {starts}): largest rise over an "
            f"earlier window {stable['max_rise']} (stable if <= {stable['threshold']:g}): {stable['stable']}\n"
            f"target (0 errors, 0 lost, stable p99) met: {document['target_met']}"
        )
        for message in document["error_messages"]:
            self.stdout.write(f"error: {message}")
        for death in document["board_deaths"]:
            self.stdout.write(f"board {death['board']} died at {death['t_s']} s (exit code {death['exitcode']})")
        self._save("load", json_path, document, load_report)

    def bench_fleet(self, boards, topics, prompts, shots, max_tokens, link, ram_mb, spacing, seed, json_path: str | None, **options):
        from cachebox.link import LINK_PRESETS
        from inference.benchmarks.fleet import DEFAULT_TOPICS, POLICIES, fleet_report, run_fleet

        if boards < 2 or prompts < boards or max_tokens < 1 or spacing <= 0 or not 0 <= shots <= 8:
            raise CommandError("--boards must be at least 2, --prompts at least --boards, --max-tokens at least 1, --spacing positive, --shots 0 to 8")
        if link not in LINK_PRESETS:
            raise CommandError(f"--link must be one of {', '.join(LINK_PRESETS)}")
        try:
            chosen = [mmlu.normalize_topic(topic) for topic in (topics or DEFAULT_TOPICS)]
            per_topic = [prompts // len(chosen) + (1 if index < prompts % len(chosen) else 0) for index in range(len(chosen))]
            by_topic = {topic: mmlu.build_prompts(topic, shots, count) for topic, count in zip(chosen, per_topic) if count}
        except (mmlu.UnknownTopic, ValueError, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        profile = LINK_PRESETS[link]
        base = settings.EDGECACHE_BOARD.with_(threads=1, link=profile, ram_tier_bytes=ram_mb * 1024 * 1024 if ram_mb is not None else None, context_reuse=True)
        started: list[Board] = []
        try:
            for number in tqdm(range(boards), desc=f"bench fleet: loading {boards} boards", unit="board"):
                started.append(Board.start(base.with_(device=f"fleet-{number}"), keys=control_plane_keys()))
            if started[0].store is None or not started[0].store.ping():
                raise CommandError("the cache box does not answer; start it with `python manage.py cachebox start` or fix REDIS_URL")
            with tqdm(total=len(POLICIES) * prompts, desc=f"bench fleet ({link})", unit="run") as bar:
                document = run_fleet(started, by_topic, link=profile, link_name=link, max_tokens=max_tokens, spacing=spacing, ram_budget_bytes=started[0].prefix.ram.budget_bytes if started[0].prefix.ram else 0, seed=seed, progress=bar.update)
            document.update({"shots": shots, "seed": seed, "machine": machine_info(started[0])})
        finally:
            for board in started:
                board.close()
        self.stdout.write(
            f"\n{document['boards']} boards, {document['link_label']}, RAM tier {document['ram_tier_mb']} MB; {document['prompts']} prompts of "
            f"{len(document['topics'])} topics, one every {document['interval_ms']:.0f} ms (cold TTFT alone {document['cold_ttft_ms_alone']:.0f} ms)"
        )
        self.stdout.write(f"{'policy':<13}{'TTFT p50':>10}{'p90':>10}{'service p50':>13}{'wait p50':>10}{'idle+waiting':>14}  tiers")
        for name, row in document["policies"].items():
            tiers = ", ".join(f"{tier} {share:.2f}" for tier, share in row["hit_ratio_by_tier"].items())
            self.stdout.write(
                f"{name:<13}{row['ttft_ms_p50']:>10.1f}{row['ttft_ms_p90']:>10.1f}{row['service_ttft_ms_p50']:>13.1f}{row['wait_ms_p50']:>10.1f}{row['idle_while_waiting_s']:>12.2f} s  {tiers}"
                + (f"  ({row['errors']} errors)" if row["errors"] else "")
            )
        document["summary"] = (
            f"Median TTFT round-robin / cache-aware = {document['median_ttft_round_robin_over_cache_aware']} (target 2x: {document['target_met']}); "
            f"{document['boards']} boards on {document['link_label']}."
        )
        self.stdout.write(document["summary"])
        self._save("fleet", json_path, document, fleet_report)

    def bench_lab(self, ks, prompts, shots, heldout, reference_prompts, calibration_docs, threads, json_path: str | None, **options):
        from types import SimpleNamespace

        from inference.benchmarks.lab import lab_report, run_lab
        from inference.engine import Engine
        from inference.lab import texts
        from inference.lab.kv_prediction import KVPredictionServing, PredictorFileError, ensure_predictors, lab_dir
        from inference.board import engine_config
        from inference.model_file import resolve_model

        if prompts < 1 or heldout < 0 or reference_prompts < 0 or not ks or any(not 1 <= k < 18 for k in ks):
            raise CommandError("--prompts must be at least 1, --heldout and --reference-prompts >= 0, every k between 1 and 17")
        try:
            selected = texts.evaluation_prompts(prompts, shots)
            heldout_texts = texts.heldout_prompts(heldout)
            reference_texts = [p.text for p in texts.evaluation_prompts(reference_prompts, 0)] if reference_prompts else []
        except (ValueError, FileNotFoundError) as exc:
            raise CommandError(str(exc))
        config = settings.EDGECACHE_BOARD
        engine = Engine(resolve_model(config.model or None), engine_config(config.with_(threads=threads) if threads > 0 else config))
        strategies = {}
        try:
            reference = None
            if reference_texts or any(not (lab_dir() / f"kvp-{engine.model_file.sha256[:16]}-k{k}.npz").exists() for k in ks):
                try:
                    from inference.lab.reference import ReferenceModel
                except ImportError as exc:
                    raise CommandError(str(exc))
                self.stdout.write("loading the reference engine (dequantizing the GGUF)...")
                reference = ReferenceModel.load(engine.model_file.path, threads=engine.config.threads())
            with tqdm(total=calibration_docs, desc="fitting KV predictors (if missing)", unit="doc") as bar:
                ensure_predictors(
                    engine.model_file, ks, lab_dir(), lambda text: engine.tokenize(text, add_bos=True),
                    max_documents=calibration_docs, progress=bar.update, reference=reference,
                )
            try:
                strategies = {k: KVPredictionServing.open(engine, k, lab_dir()) for k in ks}
            except PredictorFileError as exc:
                raise CommandError(str(exc))
            with tqdm(total=len(reference_texts) + len(selected) + len(heldout_texts), desc=f"bench lab (k = {' '.join(map(str, ks))})", unit="prompt") as bar:
                document = run_lab(engine, strategies, selected, heldout_texts, reference=reference, reference_prompts=reference_texts, progress=bar.update)
            document.update({"shots": shots, "calibration": {k: s.predictor.calibration for k, s in strategies.items()}, "machine": machine_info(SimpleNamespace(engine=engine, store=None))})
        finally:
            for strategy in strategies.values():
                strategy.close()
            engine.close()
        if "reference" in document:
            r = document["reference"]
            self.stdout.write(
                f"\nreference engine vs llama.cpp on {r['prompts']} prompts: greedy agreement {r['greedy_agreement']}, "
                f"up to near-ties {r['agreement_up_to_near_ties']}; max |logit diff| {r['max_abs_logit_diff']} (median {r['median_max_abs_logit_diff']})"
            )
        self.stdout.write(f"\nbase: median TTFT {document['base']['median_ttft_ms']} ms over {document['prompts']} prompts, accuracy {document['base']['accuracy']}")
        self.stdout.write(f"{'method':<30}{'TTFT ms':>9}{'ratio':>7}{'agree':>7}{'acc':>7}{'KL':>8}")
        for row in document["table"]:
            self.stdout.write(
                f"{row['method']:<30}{row['median_ttft_ms']:>9.1f}{row['ttft_ratio']:>7.3f}{row['first_token_agreement']:>7.3f}{row['accuracy']:>7.3f}"
                f"{(row['heldout_kl_mean'] if row['heldout_kl_mean'] is not None else float('nan')):>8.3f}"
            )
        document["summary"] = "KV prediction against full prefill, the auxiliary alone and a truncated prompt."
        self._save("lab", json_path, document, lab_report)

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
        full = doc["cases"].get("5", {}).get("breakdown_ms", {})
        if "verify_ms" in full:
            self.stdout.write(f"full hit: signature and digest checks {full['verify_ms']:.2f} ms of {full['redis_ms']:.1f} ms fetch + restore")
