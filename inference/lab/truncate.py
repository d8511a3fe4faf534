"""A GGUF holding only the first k blocks of a model: an auxiliary model llama.cpp runs.

Every key/value field is copied with ``<arch>.block_count`` set to k; the token embedding,
the output norm (and output matrix, if untied) and blocks 0..k-1 are copied byte for byte
with their own quantization. Its keys and values for layers < k are therefore the base
model's own (up to the kernels' rounding), at about k/18 of the prefill cost.
Writing takes a second or two (about 200 MB copied); the file is kept and reused.
"""

from __future__ import annotations

import os
from pathlib import Path


def truncated_path(directory: Path, base_sha256: str, k: int) -> Path:
    return Path(directory) / f"aux-{base_sha256[:16]}-first{k}.gguf"


def write_truncated(source: str | os.PathLike, target: str | os.PathLike, k: int) -> Path:
    """Write the first ``k`` blocks of ``source`` to ``target`` (atomically: a temp file, then renamed).
    Needs the ``gguf`` package (lab extra); a board given the file needs nothing more."""
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - depends on the optional extra
        raise ImportError("writing an auxiliary GGUF needs the lab extra: pip install -e '.[lab]' (gguf)") from exc
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    n_layer = int(reader.fields[f"{arch}.block_count"].contents())
    if not 1 <= k < n_layer:
        raise ValueError(f"k must be between 1 and {n_layer - 1} (the model has {n_layer} blocks), got {k}")
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + f".{os.getpid()}.partial")
    writer = gguf.GGUFWriter(str(partial), arch, endianess=reader.endianess)
    alignment = reader.alignment
    for name, found in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds these itself
        value = k if name == f"{arch}.block_count" else found.contents()
        value_type = found.types[0]
        sub_type = found.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, value_type, sub_type=sub_type)
    if alignment:
        writer.data_alignment = alignment
    for tensor in reader.tensors:
        if tensor.name.startswith("blk."):
            if int(tensor.name.split(".")[1]) >= k:
                continue
        writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)
    return target


def ensure_truncated(source: str | os.PathLike, base_sha256: str, k: int, directory: Path) -> Path:
    """The auxiliary GGUF for ``k`` blocks, written once under ``directory``."""
    target = truncated_path(directory, base_sha256, k)
    if not target.exists():
        write_truncated(source, target, k)
    return target
