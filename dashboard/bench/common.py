"""What every benchmark shares: machine metadata, medians and percentiles, saving JSON."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import llama_cpp


def prefix_serving(engine, store, catalogs, keys, policy=None, codec: str = "raw"):
    """Prefix serving on ``engine`` over its own exchange with ``store`` (None: no cache at all),
    storing states with ``codec``."""
    # lazy (both): serving code out of the web process, whose pages read documents through the runner
    from inference.serving.exchange import Exchange  # lazy: see above
    from inference.serving.prefix import PrefixServing  # lazy: see above

    exchange = (
        Exchange(store, catalogs, fingerprint=engine.fingerprint, keys=keys, codec=codec) if store is not None else None
    )
    return PrefixServing(engine, exchange, policy=policy)


def median(values) -> float:
    values = list(values)
    return round(statistics.median(values), 3) if values else 0.0


def percentile(values, p: float, digits: int = 3) -> float | None:
    """The ``p``-th percentile (0-100) of ``values``, None for no values.

    The one definition every benchmark uses: linear interpolation between the closest ranks
    (numpy's default, Hyndman and Fan's type 7): rank ``(n - 1) * p / 100`` of the sorted values.
    So ``percentile(v, 50)`` is the median, and p99 of fewer than 100 values lies between the two
    largest. (``bench fleet`` used the nearest rank before its documents said their format.)
    """
    ordered = sorted(values)
    if not ordered:
        return None
    if not 0 <= p <= 100:
        raise ValueError("p must be between 0 and 100")
    rank = (len(ordered) - 1) * p / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    value = ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
    return round(float(value), digits)


def host_info() -> dict:
    """The machine a benchmark ran on, without a model (benchmarks that load none)."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu": cpu_model,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def machine_info(board) -> dict:
    """The machine and the engine a benchmark ran: ``board`` has ``engine`` and ``store`` (None: no cache box)."""
    engine, host = board.engine, host_info()
    return {
        **{key: host[key] for key in ("hostname", "platform", "cpu", "cpu_count")},
        "threads": engine.config.threads(),
        "python": host["python"],
        "llama_cpp_python": llama_cpp.__version__,
        "model": engine.model_file.path.name,
        "model_sha256": engine.model_file.sha256[:16],
        "n_ctx": engine.n_ctx,
        "kv_type": engine.config.kv_type,
        "compute_profile": engine.pacer.profile.emulated_label
        if engine.pacer is not None
        else "this machine (not paced)",
        "cachebox": board.store.safe_url if board.store else None,
        "link": board.store.link_label if board.store else "no cache box",
        "git_commit": host["git_commit"],
        "date": host["date"],
    }


def save_json(path: str | Path, document: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path
