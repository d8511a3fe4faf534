"""python manage.py docs [--check] [--cite FILE ...]: regenerate docs/configuration.md, the benchmark
figures of docs/benchmarks.md and the README's vs-server table (from docs/figures/, the cited
documents; ``--cite`` copies saved results there first)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from dashboard import docs
from dashboard.bench import documents


class Command(BaseCommand):
    help = "Write docs/configuration.md (from the code), docs/benchmarks.md's figures and the README's vs-server table (from the documents cited in docs/figures/)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--check", action="store_true", help="change nothing; fail if a generated file is out of date"
        )
        parser.add_argument(
            "--cite",
            nargs="+",
            default=[],
            metavar="FILE",
            help="copy these saved results (bench-results/NAME.json) into docs/figures/ first, to be cited",
        )

    def handle(self, *args, check: bool, cite: list[str], **options):
        for name in cite:
            source = Path(name)
            try:
                kind = documents.kind_of(json.loads(source.read_text(encoding="utf-8")))
            except (OSError, ValueError) as exc:
                raise CommandError(f"cannot cite {name}: {exc}") from None
            if kind is None:
                raise CommandError(f"cannot cite {name}: it is no benchmark's document (no 'bench' field)")
            documents.figures_dir().mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, documents.figures_dir() / source.name)
            self.stdout.write(f"cited {source.name} ({kind}) in {documents.FIGURES_DIR}/")
        folder = docs.ROOT / "docs"
        benchmarks = (folder / "benchmarks.md").read_text(encoding="utf-8")
        missing = docs.missing_sections(benchmarks)
        if missing:
            raise CommandError(
                f"docs/benchmarks.md has no marked section for {', '.join(missing)} (<!-- bench:NAME --> ... <!-- /bench:NAME -->)"
            )
        readme = docs.ROOT / "README.md"
        wanted = {
            folder / "configuration.md": docs.render_configuration(),
            folder / "benchmarks.md": docs.render_benchmarks(benchmarks),
            readme: docs.render_readme(readme.read_text(encoding="utf-8")),
        }
        stale = [path for path, text in wanted.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
        if check:
            if stale:
                raise CommandError(
                    f"out of date: {', '.join(str(p.relative_to(docs.ROOT)) for p in stale)}; run `python manage.py docs`"
                )
            self.stdout.write("docs are up to date")
            return
        for path in stale:
            path.write_text(wanted[path], encoding="utf-8")
            self.stdout.write(f"wrote {path.relative_to(docs.ROOT)}")
        if not stale:
            self.stdout.write("docs are up to date")
