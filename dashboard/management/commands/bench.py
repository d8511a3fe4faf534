"""python manage.py bench NAME ...: the registered benchmarks (dashboard/bench), and `bench topics`.

Each benchmark prints its figures and saves a JSON document that says what it is, with an HTML
report beside it, in bench-results/ (or where --json says).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from dashboard import bench as registry
from dashboard import mmlu
from dashboard.bench import runner
from dashboard.bench.base import BenchError


class Command(BaseCommand):
    help = "Benchmarks: `bench cases` reproduces the paper's five cache cases on MMLU; `bench topics` lists topics."

    def add_arguments(self, parser):
        sub = parser.add_subparsers(dest="bench", required=True)
        for bench in registry.every():
            runner.add_arguments(bench, sub.add_parser(bench.name, help=bench.help))
        sub.add_parser("topics", help="list the 57 MMLU topics and their sizes")

    def handle(self, *args, bench, **options):
        if bench == "topics":
            for topic, questions in sorted(mmlu.load_questions().items()):
                self.stdout.write(f"{len(questions):5d}  {topic}")
            return
        try:
            runner.run(registry.get(bench), options, self.stdout.write)
        except BenchError as exc:
            raise CommandError(str(exc))
