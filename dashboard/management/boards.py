"""Helpers shared by the commands that run a board next to the control plane (infer, bench)."""

from __future__ import annotations

import sys
from pathlib import Path

from django.core.management.base import CommandError

from inference.engine.sampling import SamplingParams


def read_prompt_file(path: str) -> str:
    """The text of a prompt file ('-' for standard input), or a one-line CommandError."""
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except FileNotFoundError:
        raise CommandError(f"prompt file {path} does not exist")
    except IsADirectoryError:
        raise CommandError(f"prompt file {path} is a directory; give a text file")
    except OSError as exc:
        raise CommandError(f"cannot read prompt file {path}: {exc.strerror}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CommandError(
            f"prompt file {path} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        )


def add_sampling_arguments(parser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy decoding")
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--seed", type=int, default=None)


def sampling_from_options(options) -> SamplingParams:
    try:
        return SamplingParams(options["temperature"], options["top_k"], options["top_p"], options["seed"])
    except ValueError as exc:
        raise CommandError(str(exc))
