"""The lab's fitted files (KV predictors, exit adapters): named numpy arrays in one ``.npz``,
written whole or not at all, read without pickle and refused with a reason when they are not
what the caller expects (another format, another model, missing arrays)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def save_arrays(path: str | Path, **arrays: np.ndarray) -> Path:
    """Write ``arrays`` to ``path`` through a temporary file, so a reader never meets half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial.npz")
    np.savez(partial, **arrays)
    partial.replace(path)
    return path


def load_arrays(
    path: str | Path,
    *,
    error: type[Exception],
    what: str,
    fit_hint: str,
    format: str,
    fingerprint: str,
    needed: set[str],
    json_records: tuple[str, ...] = ("calibration",),
) -> dict:
    """The arrays of a file written by ``save_arrays`` with its ``format`` and ``fingerprint``
    arrays, holding at least ``needed``; raises ``error`` naming the problem otherwise
    (``what``: "exit-adapter file"; ``fit_hint``: how to make one). The ``json_records`` (strings
    holding JSON) come back decoded."""
    path = Path(path)
    if not path.is_file():
        raise error(f"no {what} at {path}: {fit_hint}")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except Exception as exc:  # zip, header or pickle errors: all mean "not such a file"
        raise error(f"{path} is not a readable {what} ({type(exc).__name__}: {exc})") from None
    if missing := (needed | {"format", "fingerprint"}) - arrays.keys():
        raise error(f"{path} lacks {', '.join(sorted(missing))}: not a {what} of this version")
    if str(arrays["format"]) != format:
        raise error(f"{path} has format {str(arrays['format'])!r}, expected {format!r}")
    if str(arrays["fingerprint"]) != fingerprint:
        raise error(
            f"{path} was fitted for model {str(arrays['fingerprint'])[:16]}..., not this model ({fingerprint[:16]}...)"
        )
    for name in json_records:
        if name in arrays:
            try:
                arrays[name] = json.loads(str(arrays[name]))
            except ValueError:
                raise error(f"{path}: {name} record is not JSON") from None
    return arrays
