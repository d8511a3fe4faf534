"""What a benchmark is: one module that declares its arguments, runs, and returns a document.

A benchmark module ends with one declaration::

    BENCH = Benchmark(
        name="scale",                  # the subcommand (`bench scale`) and the document's "bench" field
        format=1,                      # the document's "format": raise it when a field changes meaning
        help="cold and full-hit TTFT from 128 to 2048 prompt tokens",
        add_arguments=add_arguments,   # (parser) -> None: argparse options of the subcommand
        run=run,                       # (ctx: BenchContext, **options) -> dict: measures, returns the document
        lines=lines,                   # (doc) -> list[str]: what the command prints after the run
        report=scale_report,           # (path, doc) -> Path: the HTML report saved beside the JSON
        headline=headline,             # (doc) -> str: one line for the Benchmarks page (optional)
    )

and one line in ``dashboard/bench/__init__.py`` (``BENCHMARKS``) names it. The command does the
rest, the same way for every benchmark: it stamps ``{"bench": name, "format": format,
"machine": {...}}`` at the front of the document, prints ``lines(doc)``, and saves the JSON and the
HTML report (``bench-results/<name>-<date>.json`` unless ``--json`` says where).

``run`` gets a ``BenchContext`` from the command: boards, the cache box, keys and progress bars
without importing the control plane (``inference`` never imports ``dashboard``). A person's
mistake (a bad option, an unknown topic, a cache box that does not answer) is a ``BenchError``:
the command prints its message as one line and exits non-zero.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from dashboard import mmlu


class BenchError(Exception):
    """A mistake a person can fix (options, topics, a server that does not answer): one line."""


class BenchContext(Protocol):
    """What the command gives a benchmark's ``run`` (``dashboard.bench.runner.CommandContext``)."""

    config: Any  # the BoardConfig of this checkout (settings.EDGECACHE_BOARD)
    keys: Any  # signing keys of the control plane (a Keychain)
    embedded_cachebox: bool  # the cache box is the checkout's embedded Valkey (no REDIS_URL)

    def board(
        self, config=None, *, cachebox_only: bool = True, background_sync: bool = False, **changes
    ) -> AbstractContextManager:
        """A started board (``config`` or this checkout's, with ``changes``) whose cache box answers; closed on exit.

        ``cachebox_only`` turns the board-local tiers off: most benchmarks measure the cache box.
        """

    def cachebox_url(self, hint: str = "") -> str:
        """The cache box's URL, after checking that it answers (BenchError with ``hint`` if not)."""

    def keyring(self, namespace: str) -> dict:
        """The signing key ring of ``namespace``, as a board receives it (a plain dict)."""

    def progress(self, **tqdm_options) -> AbstractContextManager:
        """A progress bar on the terminal (tqdm's options: total, desc, unit, ...)."""

    def write(self, line: str) -> None:
        """A line on the command's output while the benchmark runs."""


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: see the module docstring for each field."""

    name: str
    format: int
    help: str
    add_arguments: Callable[[Any], None]
    run: Callable[..., dict]
    lines: Callable[[dict], Iterable[str]]
    report: Callable[[Any, dict], Any]
    headline: Callable[[dict], str] | None = None

    def headline_of(self, doc: dict) -> str:
        """The Benchmarks page's line for ``doc``: ``headline``, else the document's own summary."""
        if self.headline is not None:
            return self.headline(doc)
        summary = doc.get("summary")
        return summary if isinstance(summary, str) else ""


CACHEBOX_DOWN = "the cache box does not answer; start it with `python manage.py cachebox start` or fix REDIS_URL"


# -- MMLU prompts for the options every benchmark shares ------------------------------------------
def prompts_of(topic: str, shots: int, count: int) -> list:
    """``count`` few-shot prompts of ``topic`` (BenchError for a bad topic or count)."""
    if count < 1:
        raise BenchError("--prompts must be at least 1")
    try:
        return mmlu.build_prompts(topic, shots, count)
    except (mmlu.UnknownTopic, ValueError, FileNotFoundError) as exc:
        raise BenchError(str(exc))


def topics_named(names: Iterable[str]) -> list[str]:
    """MMLU topics as the data set spells them (BenchError for an unknown one)."""
    try:
        return [mmlu.normalize_topic(name) for name in names]
    except (mmlu.UnknownTopic, FileNotFoundError) as exc:
        raise BenchError(str(exc))
