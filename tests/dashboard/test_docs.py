"""The documentation holds: its links and images resolve, the configuration table is the code's,
and the benchmark figures come from saved results, never from hand. Pure: no model, no server."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from dashboard import docs

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without code blocks and inline code (links there are examples, not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings."""
    anchors = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines() + re.findall(
        r"^#+ .*$", page.read_text(encoding="utf-8"), re.M
    ):
        if line.startswith("#"):
            title = line.lstrip("#").strip().replace("`", "").lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_every_relative_link_and_image_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_is_short_and_every_doc_is_linked_from_it():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 15_000
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"


def test_the_configuration_table_is_the_codes(settings):
    written = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert written == docs.render_configuration(), "docs/configuration.md is out of date: run `python manage.py docs`"


def test_every_variable_the_code_reads_is_in_the_table():
    names = {variable.name for variable in docs.read_variables()}
    assert {
        "REDIS_URL",
        "DATABASE_URL",
        "EDGECACHE_N_CTX",
        "EDGECACHE_RAM_TIER_MB",
        "EDGECACHE_RUN_RATE",
        "EDGECACHE_VISIBILITY_TIMEOUT",
    } <= names
    table = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert all(f"| `{name}` |" in table for name in names)


def test_a_variable_without_a_meaning_or_a_meaning_without_a_variable_fails():
    variables = docs.read_variables()
    with pytest.raises(ValueError, match="no meaning for \\['EDGECACHE_NEW_KNOB'\\]"):
        docs.render_configuration([*variables, docs.Variable("EDGECACHE_NEW_KNOB", "inference/board/config.py", 3)])
    with pytest.raises(ValueError, match="no code reads \\['EDGECACHE_RUN_RATE'\\]"):
        docs.render_configuration([v for v in variables if v.name != "EDGECACHE_RUN_RATE"])


def test_defaults_come_from_the_code_and_words_only_where_it_has_none():
    by_name = {variable.name: variable for variable in docs.read_variables()}
    assert docs._default_text(by_name["EDGECACHE_N_CTX"]) == "4096"  # BoardConfig's field default
    assert docs._default_text(by_name["EDGECACHE_RUN_RATE"]) == "30"  # the settings' literal
    assert docs._default_text(by_name["EDGECACHE_DEVICE"]) == "host name"  # computed on each machine
    changed = docs.Variable("EDGECACHE_DEVICE", "inference/board/config.py", "a-fixed-name")
    with pytest.raises(ValueError, match="drop the one written in MEANINGS"):
        docs._default_text(changed)


def test_every_benchmark_has_a_section_filled_from_its_newest_saved_result(tmp_path):
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert docs.missing_sections(text) == []
    empty = docs.render_benchmarks(text, tmp_path)
    assert "`python manage.py bench scale` makes one" in empty
    machine = {"cpu": "Test CPU", "cpu_count": 2, "threads": 1, "model": "m.gguf", "date": "2026-11-24T10:00:00Z"}
    row = {"prompt_tokens": 135, "cold_ttft_ms": 166.4, "hit_ttft_ms": 4.8, "ratio": 0.029, "state_bytes": 2.49e6}
    (tmp_path / "scale-20261123-100000.json").write_text(
        json.dumps({"bench": "scale", "format": 1, "machine": machine, "lengths": [{**row, "cold_ttft_ms": 999.0}]})
    )
    os.utime(tmp_path / "scale-20261123-100000.json", (1_700_000_000, 1_700_000_000))  # the older one
    (tmp_path / "scale-20261124-100000.json").write_text(
        json.dumps({"bench": "scale", "format": 1, "machine": machine, "lengths": [row]})
    )
    (tmp_path / "cases-1.json").write_text(
        json.dumps({"bench": "cases", "machine": machine})
    )  # another version: not printable
    filled = docs.render_benchmarks(text, tmp_path)
    scale = filled[filled.index("<!-- bench:scale -->") : filled.index("<!-- /bench:scale -->")]
    assert "scale-20261124-100000.json" in scale and "Test CPU, cores: 2, threads: 1" in scale
    assert "     135       166.4         4.8   0.029      2.49" in scale and "999.0" not in scale
    assert "could not be printed: KeyError" in filled[filled.index("<!-- bench:cases -->") :]

    def outside(page: str) -> str:
        return docs.SECTION.sub(lambda match: match.group(1) + match.group(4), page)

    assert outside(filled) == outside(text)  # everything outside the sections is kept
    assert docs.render_benchmarks(filled, tmp_path) == filled  # regenerating changes nothing


def test_the_newest_saved_result_is_the_one_measured_last_not_the_file_written_last(tmp_path):
    """A fresh clone writes every file of bench-results/ at checkout time: the README and
    benchmarks page must still show the run measured last (its machine.date)."""
    from dashboard.bench import documents

    for name, date, mtime in (
        ("scale-old", "2026-11-24T10:00:00Z", 2_000_000_000),
        ("scale-new", "2026-11-25T10:00:00Z", 1_700_000_000),
        ("scale-undated", None, 1_600_000_000),
    ):
        machine = {"cpu": "Test CPU", **({"date": date} if date else {})}
        (tmp_path / f"{name}.json").write_text(
            json.dumps({"bench": "scale", "format": 1, "machine": machine, "lengths": []})
        )
        os.utime(tmp_path / f"{name}.json", (mtime, mtime))
    assert [path.stem for path, _ in documents.saved_documents(tmp_path)] == ["scale-new", "scale-old", "scale-undated"]
    assert documents.newest(["scale"], tmp_path)["scale"][0].stem == "scale-new"


def test_citing_copies_a_result_into_the_cited_folder_and_refuses_what_is_no_benchmark(tmp_path, settings):
    """`manage.py docs --cite FILE`: a benchmark's saved document goes into docs/figures/ (the one
    folder of results the repository keeps); a file that is none is refused, saying why."""
    from django.core.management import CommandError, call_command

    from dashboard.bench import documents

    settings.BASE_DIR = tmp_path  # docs/figures/ of a copy, not of the checkout
    stray = tmp_path / "notes.json"
    stray.write_text(json.dumps({"hello": 1}))
    with pytest.raises(CommandError, match="no benchmark's document"):
        call_command("docs", "--check", "--cite", str(stray))
    assert not documents.figures_dir().exists()
    saved = tmp_path / "scale-20261128-000000.json"
    saved.write_text(json.dumps({"bench": "scale", "machine": {"date": "2026-11-28T00:00:00Z"}}))
    with pytest.raises(CommandError, match="out of date"):  # the checkout's docs do not show it yet: --check says so
        call_command("docs", "--check", "--cite", str(saved))
    assert (documents.figures_dir() / saved.name).read_text() == saved.read_text()
