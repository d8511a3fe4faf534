"""Where a state comes from, nearest first: the board's context, its RAM tier, its flash tier,
the cache box.

For each MMLU prompt, side by side in one run: cold (no cache), a full hit from the cache box
(local tiers off; over ``--link`` when one is given), a full hit from the board's context (the
same prompt again), a full hit from its RAM tier (another prompt in between), a full hit from its
flash tier (read from the disk, not the page cache, and at ``--flash-read-mbps`` through a cgroup
v1 blkio limit where this process may set one), and llama-cpp-python's LlamaRAMCache hit (its own
RAM cache next to the model). Medians, network bytes, and agreement with cold.

Conversations (``run_conversations``): four turns each; every later turn is served from the
board's context (the previous turn's prompt and answer, prepared after it), from the cache box
on a board that did not see the conversation, and cold. Per turn: tokens prefilled, TTFT,
agreement with cold.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from cachebox.link import LINK_PRESETS
from dashboard.bench.base import BenchError, Benchmark, prompts_of
from dashboard.bench.common import machine_info, median
from dashboard.bench.peers import LlamaCppPromptCache
from dashboard.bench.reports import tiers_report
from dashboard.hosts.plan import CGROUP_ROOT
from dashboard.mmlu import MMLUPrompt
from inference.engine.chat import chat_prompt, follow_up
from inference.serving.exchange import Exchange
from inference.serving.prefix import PrefixServing

FILLER = ["A prompt about something else entirely, to move the board's context on."]


def out_of_page_cache(folder: Path) -> None:
    """Make the next reads of ``folder``'s files come from the disk, as after a board's reboot."""
    for path in folder.glob("*.entry"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # written pages are only dropped once clean
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


@contextmanager
def disk_read_limit(folder: Path, read_mbps: float) -> Iterator[str]:
    """This process's reads from ``folder``'s disk limited to ``read_mbps`` MB/s (a cgroup v1 blkio
    throttle, as an SD card reads); yields what was used, said in the report."""
    blkio = Path(CGROUP_ROOT) / "blkio"
    if read_mbps <= 0:
        yield "this machine's disk, unthrottled"
        return
    if os.geteuid() != 0 or not (blkio / "blkio.throttle.read_bps_device").exists():
        yield "this machine's disk, unthrottled (a blkio limit needs root and cgroup v1 blkio)"
        return
    device = os.stat(folder).st_dev
    group = blkio / "edgecache" / f"bench-tiers-{os.getpid()}"
    group.mkdir(parents=True, exist_ok=True)
    home = next(
        (
            line.split(":", 2)[2]
            for line in Path("/proc/self/cgroup").read_text().splitlines()
            if line.split(":")[1] == "blkio"
        ),
        "/",
    )
    try:
        (group / "blkio.throttle.read_bps_device").write_text(
            f"{os.major(device)}:{os.minor(device)} {int(read_mbps * 1e6)}"
        )
        (group / "cgroup.procs").write_text(str(os.getpid()))
        yield f"reads at {read_mbps:g} MB/s (cgroup v1 blkio.throttle.read_bps_device on {os.major(device)}:{os.minor(device)})"
    finally:
        (blkio / home.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()
        try:
            group.parent.rmdir()  # the parent too, unless boards as hosts use it
        except OSError:
            pass


def run_tiers(
    board,
    prompts: list[MMLUPrompt],
    *,
    max_tokens: int = 4,
    flash_read_mbps: float = 0.0,
    progress: Callable[[], None] | None = None,
) -> dict:
    engine = board.engine
    namespace = f"bench-tiers-{uuid.uuid4().hex[:10]}"
    exchange = Exchange(
        board.store, board.catalogs, fingerprint=engine.fingerprint, device=board.config.device, keys=board.keys
    )
    cachebox_only = PrefixServing(engine, exchange, chunk_tokens=board.prefix.chunk_tokens)
    local = PrefixServing(
        engine, exchange, chunk_tokens=board.prefix.chunk_tokens, context_reuse=True, ram_tier_bytes=512 * 1024 * 1024
    )
    card = tempfile.TemporaryDirectory(prefix="edgecache-flash-", dir=Path.cwd())  # on the disk (a /tmp may be memory)
    flash = PrefixServing(
        engine,
        exchange,
        chunk_tokens=board.prefix.chunk_tokens,
        flash_tier_bytes=2 * 1024**3,
        flash_dir=Path(card.name),
    )
    rows = []
    disk = ""
    try:
        for prompt in prompts:
            row: dict = {}
            cold = cachebox_only.run(prompt.segments, max_tokens=max_tokens, use_cache=False)
            cachebox_only.run(prompt.segments, max_tokens=1, namespace=namespace)  # store it
            remote = cachebox_only.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)
            local.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)  # into the context and RAM
            context = local.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)
            local.run(FILLER, max_tokens=1, namespace=namespace, upload=False)
            ram = local.run(prompt.segments, max_tokens=max_tokens, namespace=namespace)
            flash.run(prompt.segments, max_tokens=1, namespace=namespace, upload=False)  # fetched once, kept on flash
            out_of_page_cache(Path(card.name))
            with disk_read_limit(Path(card.name), flash_read_mbps) as disk:
                from_flash = flash.run(prompt.segments, max_tokens=max_tokens, namespace=namespace, upload=False)
            for name, result in (
                ("cold", cold),
                ("cachebox", remote),
                ("context", context),
                ("ram", ram),
                ("flash", from_flash),
            ):
                b = result.breakdown
                row[name] = {
                    "ttft_ms": b.ttft_ms,
                    "tier": str(b.tier),
                    "case": str(b.case),
                    "fetched_bytes": b.fetched_bytes,
                    "agree": result.tokens == cold.tokens,
                }
            rows.append(row)
            if progress:
                progress()
        peer = LlamaCppPromptCache(str(engine.model_file.path), engine.n_ctx, engine.config.threads(), "ram")
        try:
            for prompt, row in zip(prompts, rows):
                peer.run(prompt.text, max_tokens)
                peer.run(FILLER[0], 1)
                hit = peer.run(prompt.text, max_tokens)
                row["llama_ram_cache"] = {"ttft_ms": hit["ttft_ms"]}
                if progress:
                    progress()
        finally:
            peer.close()
    finally:
        card.cleanup()
        board.store.flush(namespace)
        board.catalogs.forget(namespace)

    def med(name: str) -> float:
        return median(row[name]["ttft_ms"] for row in rows)

    summary = {name: med(name) for name in ("cold", "cachebox", "context", "ram", "flash", "llama_ram_cache")}
    tiers = ("cachebox", "context", "ram", "flash")
    return {
        "n": len(prompts),
        "max_tokens": max_tokens,
        "link": board.exchange.link_label or "unshaped",
        "flash_disk": disk,
        "median_ttft_ms": summary,
        "network_bytes": {name: median(row[name]["fetched_bytes"] for row in rows) for name in tiers},
        "tiers_seen": {name: sorted({row[name]["tier"] for row in rows}) for name in tiers},
        "agreement_with_cold": {name: round(sum(row[name]["agree"] for row in rows) / len(rows), 4) for name in tiers},
        "ratios": {
            "context_over_cachebox": round(summary["context"] / summary["cachebox"], 4)
            if summary["cachebox"]
            else None,
            "ram_over_cachebox": round(summary["ram"] / summary["cachebox"], 4) if summary["cachebox"] else None,
            "flash_over_cachebox": round(summary["flash"] / summary["cachebox"], 4) if summary["cachebox"] else None,
            "flash_over_cold": round(summary["flash"] / summary["cold"], 5) if summary["cold"] else None,
            "context_over_cold": round(summary["context"] / summary["cold"], 5) if summary["cold"] else None,
            "ram_over_cold": round(summary["ram"] / summary["cold"], 5) if summary["cold"] else None,
            "llama_ram_cache_over_ram_tier": round(summary["llama_ram_cache"] / summary["ram"], 1)
            if summary["ram"]
            else None,
            "llama_ram_cache_over_context": round(summary["llama_ram_cache"] / summary["context"], 1)
            if summary["context"]
            else None,
        },
        "rows": rows,
    }


FOLLOW_UPS = (
    "Explain your answer in one sentence.",
    "Which option is the most tempting wrong one?",
    "Summarise the question in five words.",
)


def run_conversations(
    board, prompts: list[MMLUPrompt], *, max_tokens: int = 16, progress: Callable[[], None] | None = None
) -> dict:
    """Four-turn conversations (an MMLU question, then three follow-ups), played on one board from
    its context (each answer's continuation prepared and shared after it); then every turn again,
    cold and from the cache box on a board with no context, with the same history."""
    engine = board.engine
    namespace = f"bench-chat-{uuid.uuid4().hex[:10]}"
    exchange = Exchange(
        board.store, board.catalogs, fingerprint=engine.fingerprint, device=board.config.device, keys=board.keys
    )
    local = PrefixServing(engine, exchange, chunk_tokens=board.prefix.chunk_tokens, context_reuse=True)
    remote = PrefixServing(engine, exchange, chunk_tokens=board.prefix.chunk_tokens)
    turns: list[dict] = []
    try:
        for prompt in prompts:
            messages = [("user", prompt.text)]
            played = []
            for number in range(1 + len(FOLLOW_UPS)):
                if number:
                    messages.append(("user", FOLLOW_UPS[number - 1]))
                chat = chat_prompt(engine, messages)
                result = local.run(
                    chat.text, tokens=chat.tokens, cuts=chat.cuts, max_tokens=max_tokens, namespace=namespace
                )
                prefix = follow_up(engine, messages, result.text)
                extension = (
                    local.extend(prefix.tokens, prefix.cuts, namespace=namespace) if prefix is not None else None
                )
                played.append((list(messages), chat, result, extension))
                messages.append(("assistant", result.text))
            # Last turn first, each without the entries its own run stored: what the cache box held
            # when that turn arrived (the earlier turns and the continuations prepared after them).
            for number, (history, chat, result, extension) in reversed(list(enumerate(played, start=1))):
                board.store.delete([entry.name for entry in result.uploaded])
                cold = remote.run(chat.text, tokens=chat.tokens, cuts=chat.cuts, max_tokens=max_tokens, use_cache=False)
                fetched = remote.run(
                    chat.text,
                    tokens=chat.tokens,
                    cuts=chat.cuts,
                    max_tokens=max_tokens,
                    namespace=namespace,
                    upload=False,
                )
                b, f = result.breakdown, fetched.breakdown
                turns.append(
                    {
                        "turn": number,
                        "prompt_tokens": b.prompt_tokens,
                        "new_tokens": b.prompt_tokens - (chat.starts[-1] if number > 1 else 0),
                        "prefilled_tokens": b.prompt_tokens - b.matched_tokens,
                        "context_tier": str(b.tier),
                        "context_ttft_ms": b.ttft_ms,
                        "cachebox_tier": str(f.tier),
                        "cachebox_prefilled_tokens": f.prompt_tokens - f.matched_tokens,
                        "cachebox_ttft_ms": f.ttft_ms,
                        "cold_ttft_ms": cold.breakdown.ttft_ms,
                        "next_turn_ms": extension.total_ms if extension is not None else 0.0,
                        "context_agrees": result.tokens == cold.tokens,
                        "cachebox_agrees": fetched.tokens == cold.tokens,
                    }
                )
            turns.sort(key=lambda row: row["turn"])
            if progress:
                progress()
    finally:
        board.store.flush(namespace)
        board.catalogs.forget(namespace)

    later = [turn for turn in turns if turn["turn"] > 1]

    def med(name: str, rows=later) -> float:
        return median(row[name] for row in rows)

    return {
        "conversations": len(prompts),
        "turns": 1 + len(FOLLOW_UPS),
        "max_tokens": max_tokens,
        "later_turns": {
            "prefilled_equals_new_tokens": round(
                sum(row["prefilled_tokens"] == row["new_tokens"] for row in later) / len(later), 4
            )
            if later
            else None,
            "median_prompt_tokens": med("prompt_tokens"),
            "median_new_tokens": med("new_tokens"),
            "median_prefilled_tokens": med("prefilled_tokens"),
            "median_cachebox_prefilled_tokens": med("cachebox_prefilled_tokens"),
            "median_ttft_ms": {
                "context": med("context_ttft_ms"),
                "cachebox": med("cachebox_ttft_ms"),
                "cold": med("cold_ttft_ms"),
            },
            "median_next_turn_ms": med("next_turn_ms", turns),
            "agreement_with_cold": {
                "context": round(sum(row["context_agrees"] for row in later) / len(later), 4) if later else None,
                "cachebox": round(sum(row["cachebox_agrees"] for row in later) / len(later), 4) if later else None,
            },
        },
        "rows": turns,
    }


# -- the command (python manage.py bench tiers) --------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("--topic", default="astronomy")
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--shots", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument(
        "--conversations",
        type=int,
        default=4,
        help="four-turn conversations played from the context, the cache box and cold (0: skip)",
    )
    parser.add_argument(
        "--link",
        default="",
        help="the board's link to the cache box, a preset such as wifi4 (default: as the network is)",
    )
    parser.add_argument(
        "--flash-read-mbps",
        type=float,
        default=0.0,
        help="limit the flash tier's disk reads to this many MB/s, as an SD card (cgroup v1 blkio; root)",
    )
    parser.add_argument(
        "--memory-mb",
        type=int,
        default=0,
        help="size the board to this registered memory, e.g. 512 for a Pi Zero 2W (default: unsized)",
    )


def run(
    ctx, *, topic, prompts, shots, max_tokens, conversations, link="", flash_read_mbps=0.0, memory_mb=0, **options
) -> dict:
    selected = prompts_of(topic, shots, prompts)
    if link and LINK_PRESETS.get(link) is None:
        raise BenchError(
            f"--link must be one of {', '.join(name for name, profile in LINK_PRESETS.items() if profile)}"
        )
    changes = {"link": LINK_PRESETS[link] if link else None, "memory_mb": memory_mb or None}
    with ctx.board(**changes) as board:
        with ctx.progress(total=2 * len(selected) + conversations, desc="bench tiers", unit="step") as bar:
            document = run_tiers(
                board, selected, max_tokens=max_tokens, flash_read_mbps=flash_read_mbps, progress=bar.update
            )
            if conversations > 0:
                document["conversation"] = run_conversations(
                    board, (selected * conversations)[:conversations], progress=bar.update
                )
        document.update({"topic": selected[0].target.topic, "shots": shots, "machine": machine_info(board)})
    return document


def lines(doc: dict) -> list[str]:
    out = [
        f"\nfull-hit TTFT, median ms over {doc['n']} prompts: "
        + ", ".join(f"{k} {v}" for k, v in doc["median_ttft_ms"].items()),
        f"ratios: {doc['ratios']}",
        f"network bytes: {doc['network_bytes']}; agreement with cold: {doc['agreement_with_cold']}",
        f"link to the cache box: {doc.get('link', 'unshaped')}; flash tier read from {doc.get('flash_disk') or 'this machine'}",
    ]
    if "conversation" in doc:
        later = doc["conversation"]["later_turns"]
        out.append(
            f"conversations ({doc['conversation']['conversations']} x {doc['conversation']['turns']} turns), later turns, medians: "
            f"prompt {later['median_prompt_tokens']} tokens, new {later['median_new_tokens']}, prefilled {later['median_prefilled_tokens']} "
            f"(from the cache box on another board: {later['median_cachebox_prefilled_tokens']}); prefilled only the new tokens in "
            f"{later['prefilled_equals_new_tokens']:.0%} of turns; TTFT {later['median_ttft_ms']}; next-turn preparation {later['median_next_turn_ms']} ms "
            f"after each answer; agreement with cold {later['agreement_with_cold']}"
        )
    return out


def headline(doc: dict) -> str:
    return "full-hit TTFT, median ms: " + ", ".join(f"{k} {v}" for k, v in doc["median_ttft_ms"].items())


BENCH = Benchmark(
    name="tiers",
    format=1,
    help="full hits from the board's context, its RAM tier, its flash tier, the cache box, and llama-cpp-python's LlamaRAMCache",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=tiers_report,
    headline=headline,
)
