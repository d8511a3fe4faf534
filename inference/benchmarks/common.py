"""What every benchmark shares: machine metadata, medians, saving JSON."""

from __future__ import annotations

import json
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
    from inference.exchange import Exchange
    from inference.prefix_serving import PrefixServing

    exchange = Exchange(store, catalogs, fingerprint=engine.fingerprint, keys=keys, codec=codec) if store is not None else None
    return PrefixServing(engine, exchange, policy=policy)


def median(values) -> float:
    values = list(values)
    return round(statistics.median(values), 3) if values else 0.0


def machine_info(board) -> dict:
    engine = board.engine
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5).stdout.strip()
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
        "threads": engine.config.threads(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_cpp.__version__,
        "model": engine.model_file.path.name,
        "model_sha256": engine.model_file.sha256[:16],
        "n_ctx": engine.n_ctx,
        "kv_type": engine.config.kv_type,
        "compute_profile": engine.pacer.profile.emulated_label if engine.pacer is not None else "this machine (not paced)",
        "cachebox": board.store.safe_url if board.store else None,
        "link": board.store.link_label if board.store else "no cache box",
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def save_json(path: str | Path, document: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return path
