"""python manage.py docs [--check]: regenerate docs/configuration.md, the benchmark figures of docs/benchmarks.md and the README's vs-server table."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from dashboard import docs


class Command(BaseCommand):
    help = "Write docs/configuration.md (from the code), docs/benchmarks.md's figures and the README's vs-server table (from the newest results in bench-results/)."

    def add_arguments(self, parser):
        parser.add_argument("--check", action="store_true", help="change nothing; fail if a generated file is out of date")

    def handle(self, *args, check: bool, **options):
        folder = docs.ROOT / "docs"
        benchmarks = (folder / "benchmarks.md").read_text(encoding="utf-8")
        missing = docs.missing_sections(benchmarks)
        if missing:
            raise CommandError(f"docs/benchmarks.md has no marked section for {', '.join(missing)} (<!-- bench:NAME --> ... <!-- /bench:NAME -->)")
        readme = docs.ROOT / "README.md"
        wanted = {
            folder / "configuration.md": docs.render_configuration(),
            folder / "benchmarks.md": docs.render_benchmarks(benchmarks),
            readme: docs.render_readme(readme.read_text(encoding="utf-8")),
        }
        stale = [path for path, text in wanted.items() if not path.exists() or path.read_text(encoding="utf-8") != text]
        if check:
            if stale:
                raise CommandError(f"out of date: {', '.join(str(p.relative_to(docs.ROOT)) for p in stale)}; run `python manage.py docs`")
            self.stdout.write("docs are up to date")
            return
        for path in stale:
            path.write_text(wanted[path], encoding="utf-8")
            self.stdout.write(f"wrote {path.relative_to(docs.ROOT)}")
        if not stale:
            self.stdout.write("docs are up to date")
