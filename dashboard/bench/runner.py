"""Run one registered benchmark the way every benchmark runs: arguments, context, stamp, print, save."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from django.conf import settings

from cachebox.errors import CacheBoxUnavailable
from cachebox.store import CacheBox
from dashboard.bench.base import CACHEBOX_DOWN, BenchError, Benchmark
from dashboard.bench.common import host_info, save_json
from dashboard.security.signing import control_plane_keys, keyring_for

RESULTS_DIR = "bench-results"  # under BASE_DIR: the Benchmarks and Lab pages read it


def add_arguments(bench: Benchmark, parser) -> None:
    """The benchmark's own options, and ``--json`` (where to save), which every benchmark has."""
    bench.add_arguments(parser)
    parser.add_argument(
        "--json",
        dest="json_path",
        default=None,
        metavar="PATH",
        help=f"where to save the JSON (default {RESULTS_DIR}/...)",
    )


class CommandContext:
    """What a benchmark's ``run`` may use (``dashboard.bench.base.BenchContext``), from this checkout's settings."""

    def __init__(self, write: Callable[[str], None]):
        self.write = write
        self.config = settings.EDGECACHE_BOARD
        self.embedded_cachebox = settings.REDIS_URL_IS_EMBEDDED

    @property
    def keys(self):
        return control_plane_keys()

    def keyring(self, namespace: str) -> dict:
        return keyring_for(namespace).to_dict()

    def _start_cachebox(self) -> None:
        """Start this checkout's embedded cache box (a board only connects; the control plane starts it)."""
        # lazy: the actions (and channels) out of the web process, which imports the runner
        from dashboard.actions import start_cachebox

        try:
            start_cachebox()
        except CacheBoxUnavailable as exc:
            raise BenchError(str(exc))

    @contextmanager
    def board(self, config=None, *, cachebox_only: bool = True, background_sync: bool = False, **changes):
        # lazy: the board runtime out of the web process, which imports the runner
        from inference.board.runtime import Board

        self._start_cachebox()
        config = (config or self.config).with_(**changes) if changes else (config or self.config)
        board = Board.start(config, keys=self.keys, background_sync=background_sync)
        try:
            if cachebox_only:
                board.cachebox_only()  # measure the cache box, not the board-local tiers
            if board.store is None or not board.store.ping():
                raise BenchError(CACHEBOX_DOWN)
            yield board
        finally:
            board.close()

    def cachebox_url(self, hint: str = "") -> str:
        # lazy: the board runtime out of the web process, which imports the runner
        from inference.board.runtime import cachebox_url

        self._start_cachebox()
        try:
            url = cachebox_url(self.config)
        except CacheBoxUnavailable as exc:
            raise BenchError(str(exc))
        if not CacheBox(url).ping():
            raise BenchError(CACHEBOX_DOWN + (f"; {hint}" if hint else ""))
        return url

    def progress(self, **options):
        from tqdm import tqdm

        return tqdm(**options)


def stamp(bench: Benchmark, document: dict) -> dict:
    """The document, saying what it is first: ``{"bench", "format", "machine", ...}``."""
    rest = {key: value for key, value in document.items() if key not in ("bench", "format", "machine")}
    return {"bench": bench.name, "format": bench.format, "machine": document.get("machine") or host_info(), **rest}


def default_path(name: str) -> Path:
    return Path(settings.BASE_DIR) / RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def save(bench: Benchmark, document: dict, json_path: str | None = None) -> tuple[Path, Path]:
    """Write the JSON and, beside it, the benchmark's HTML report; returns both paths."""
    path = save_json(json_path or default_path(bench.name), document)
    return path, bench.report(path.with_suffix(".html"), document)


def run(bench: Benchmark, options: dict, write: Callable[[str], None]) -> dict:
    """Run ``bench`` with the parsed ``options``, print its lines and save it; returns the document.

    BenchError goes to the caller (the command turns it into one line on stderr).
    """
    json_path = options.pop("json_path", None)
    document = stamp(bench, bench.run(CommandContext(write), **options))
    for line in bench.lines(document):
        write(line)
    path, html_path = save(bench, document, json_path)
    write(f"saved {path} and {html_path}")
    return document
