"""python manage.py infer --prompt-file F [--max-tokens N] [--no-cache] [--strategy exact|kv-prediction:K|early-exit:M:T|anchors|anchors-tuned] [--json]"""

from __future__ import annotations

import json
import re

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from cachebox.errors import CacheBoxUnavailable, InvalidNamespace
from dashboard.actions import start_cachebox
from dashboard.actions.runs import split_segments
from dashboard.management.boards import add_sampling_arguments, read_prompt_file, sampling_from_options
from dashboard.security.signing import control_plane_keys
from inference.board.config import ConfigError
from inference.board.runtime import Board
from inference.engine.kernels import CLASS_RE
from inference.engine.model_file import ModelNotFound
from inference.serving.pml import PMLError, parse_schema
from inference.serving.run import Prompt, PromptError, RunOptions
from inference.serving.strategies import REGISTRY, parse_strategy


class Command(BaseCommand):
    help = "Run one prompt on this machine through the cache box and print the answer and its timing breakdown."

    def add_arguments(self, parser):
        parser.add_argument(
            "--prompt-file",
            required=True,
            help="UTF-8 text file with the prompt ('-' for stdin); a PML <prompt> with --schema",
        )
        parser.add_argument(
            "--schema", default=None, metavar="S.pml", help="serve the prompt from this PML schema's cached modules"
        )
        parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
        parser.add_argument("--no-cache", action="store_true", help="neither read nor write the cache box")
        parser.add_argument("--json", action="store_true", help="print one JSON object: text + every breakdown field")
        parser.add_argument(
            "--split-on",
            default=None,
            metavar="TEXT",
            help=r"cut the prompt after every TEXT (e.g. '\n\n') so each part is a cacheable range",
        )
        parser.add_argument("--namespace", default=None, help="cache namespace (default: EDGECACHE_NAMESPACE)")
        parser.add_argument(
            "--approximate-from",
            action="append",
            default=[],
            metavar="FINGERPRINT=CLASS",
            help="where this board's own entries miss, restore a state stored by another kernel class of the same model "
            "(its fingerprint and class, as another board's `infer --json` prints them): approximate, and the run says so",
        )
        parser.add_argument(
            "--strategy",
            default="exact",
            metavar="S",
            help="; ".join(line.form for line in REGISTRY.values())
            + ". Exact serving is the default; the others are lab "
            "strategies (approximate: KV prediction from K auxiliary layers, early exit while decoding on the reference "
            "engine, anchor tokens for earlier sentences or --split-on parts); lab strategies never read or write the cache box",
        )
        add_sampling_arguments(parser)

    def handle(self, *args, **options):
        text = read_prompt_file(options["prompt_file"])
        if not text.strip():
            raise CommandError(f"prompt file {options['prompt_file']} is empty: put the prompt text in it")
        sampling = sampling_from_options(options)
        approximate_from = {}
        for given in options["approximate_from"]:
            fingerprint, _, kernel_class = given.partition("=")
            if not re.fullmatch(r"[0-9a-f]{16}", fingerprint) or not CLASS_RE.match(kernel_class):
                raise CommandError(
                    f"--approximate-from {given!r}: write FINGERPRINT=CLASS, e.g. 0123456789abcdef=x86_64-avx512"
                )
            approximate_from[fingerprint] = kernel_class
        try:
            spec = parse_strategy(options["strategy"].strip())
        except ValueError as exc:
            raise CommandError(str(exc))
        if not spec.exact and options["schema"]:
            raise CommandError(
                f"--schema serves exact modules; it cannot be combined with --strategy {options['strategy']}"
            )
        schema_text = None
        if options["schema"]:
            schema_text = read_prompt_file(options["schema"])
            try:
                parse_schema(schema_text)  # fail before loading the model
            except PMLError as exc:
                raise CommandError(f"schema {options['schema']}: {exc}")
        try:
            start_cachebox()  # the embedded Valkey starts here unless REDIS_URL is set (a miss otherwise: "unavailable")
        except CacheBoxUnavailable as exc:
            self.stderr.write(f"the cache box does not start ({exc}): answering by local prefill")
        try:
            board = Board.start(
                settings.EDGECACHE_BOARD.with_(namespace=options["namespace"]),
                keys=control_plane_keys(),
                background_sync=False,
            )
        except (ModelNotFound, InvalidNamespace, ConfigError) as exc:
            raise CommandError(str(exc))
        if schema_text is not None:
            prompt = Prompt(schema=schema_text, pml=text)
        else:
            prompt = Prompt.of(split_segments(text, options["split_on"]))
        try:
            try:
                strategy = board.strategy(spec, prompt)
            except (ImportError, ValueError) as exc:  # no lab extra, no predictor or tuned model, adapters refused
                raise CommandError(str(exc))
            result = board.serve(
                spec,
                prompt,
                RunOptions(
                    max_tokens=options["max_tokens"],
                    sampling=sampling,
                    use_cache=not options["no_cache"],
                    approximate_from=approximate_from,
                ),
            )
            layers = strategy.serving.last_depths if spec.name == "early-exit" else None
        except (PromptError, PMLError) as exc:
            raise CommandError(str(exc))
        finally:
            fingerprint = board.engine.fingerprint
            board.close()
        if options["json"]:
            self.stdout.write(json.dumps({**result.as_dict(), "fingerprint": fingerprint}))
            return
        b = result.breakdown
        self.stdout.write(result.text)
        if layers is not None:
            self.stderr.write(
                f"\n[{b.strategy} (approximate; no cache box; reference engine): {b.prompt_tokens} prompt tokens; TTFT {b.ttft_ms:.1f} ms = "
                f"token {b.token_ms:.1f} + full-depth prefill {b.prefill_ms:.1f} + first decode step and sample; TTLT {b.ttlt_ms:.1f} ms; "
                f"layers run per answer token: {' '.join(map(str, layers))}]"
            )
            return
        if b.strategy:
            self.stderr.write(
                f"\n[{b.strategy} (approximate; no cache box): {b.prompt_tokens} prompt tokens; TTFT {b.ttft_ms:.1f} ms = "
                f"token {b.token_ms:.1f} + auxiliary prefill {b.aux_prefill_ms:.1f} + prediction {b.predict_ms:.1f} "
                f"+ import {b.kv_import_ms:.1f} + last prompt token {b.prefill_ms - b.aux_prefill_ms:.1f} + sample {b.sample_ms:.1f}; TTLT {b.ttlt_ms:.1f} ms]"
            )
            return
        self.stderr.write(
            f"\n[{b.case}: {b.matched_tokens}/{b.prompt_tokens} prompt tokens from the cache box ({b.cachebox}); "
            f"TTFT {b.ttft_ms:.1f} ms = token {b.token_ms:.1f} + bloom {b.bloom_ms:.2f} + prefill {b.prefill_ms:.1f} "
            f"+ redis {b.redis_ms:.1f} + sample {b.sample_ms:.1f}; TTLT {b.ttlt_ms:.1f} ms; "
            f"uploaded {b.uploaded_bytes / 1e6:.2f} MB in {b.upload_ms:.1f} ms]"
        )
