"""`bench vs-server`, its pure parts: the workloads, the peer's balancers, the summary maths, the
targets, the HTML report and the README table. No I/O beyond writing the report: the processes,
the HTTP and the clocks are in ``vs_server``.

A sample is one request as the client saw it (a dict): ``system``, ``workload``, ``index``,
``warm`` (a request the system could serve from its cache: not the first of its prefix),
``ttft_ms`` (request sent to first content chunk), ``total_ms``, ``tokens`` (content chunks),
``text``, ``cold_text`` (the same request's answer with the system's cache off), ``http_bytes``
(request and response bodies), ``cache_bytes`` (what the system moved to serve it besides HTTP:
EdgeCache's cache-box traffic), ``cached_tokens`` and ``server`` (the board or llama-server that
answered).
"""

from __future__ import annotations

import hashlib
import itertools
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

from dashboard.bench.common import percentile

NAME = "vs-server"
FORMAT = 1
EDGECACHE = "EdgeCache"
PEER = "llama-server"
ROUND_ROBIN = "llama-server, round-robin"
PREFIX_HASH = "llama-server, prefix-hash"

# -- the workloads (pure) ------------------------------------------------------------------------
# A ~450-token system prompt (Gemma-3's tokenizer), the same for both systems: the rules of a
# made-up ferry company's help desk, so that the questions below make sense under it.
SYSTEM_PROMPT = " ".join(
    [
        "You are the help desk of North Sound Ferries, a small company that runs four routes between the mainland harbour of Eastport",
        "and the islands of Calder, Moray, Skerry and Holm. Answer in one or two short sentences, politely, and never invent a",
        "timetable, a fare or a rule that is not written below. If a question is not about the ferries, say that you can only help",
        "with ferry travel. Rules and facts you may use:",
        "1. The Eastport to Calder route runs every ninety minutes from 06:30 to 21:00; the crossing takes forty minutes.",
        "2. The Eastport to Moray route runs four times a day, at 07:00, 11:00, 15:00 and 19:00; the crossing takes seventy minutes.",
        "3. Skerry and Holm are served by the small ferry Puffin, twice a day, leaving Calder at 08:15 and 16:45; in winter storms it may not sail.",
        "4. An adult single ticket costs 6 pounds on the Calder route and 9 pounds on the Moray route; children under twelve travel for half,",
        "children under five travel free, and a return ticket costs the price of two singles minus ten percent.",
        "5. Cars must be booked at least one day ahead; a car costs 24 pounds each way on any route, and vans over two metres high cost 40 pounds.",
        "6. Bicycles travel free but must be left on the car deck; dogs travel free on a lead and must stay on the outer deck or in the dog room.",
        "7. Passengers should arrive twenty minutes before departure; cars must be in the queue thirty minutes before departure or lose their space.",
        "8. Tickets can be bought online, at the Eastport office, or on board with a card; cash is accepted at the office only.",
        "9. If a sailing is cancelled for weather, tickets are valid on the next sailing or refunded in full within fourteen days.",
        "10. The cafe on the large ferries sells tea, coffee, soup and sandwiches; the Puffin has no cafe, only a water fountain.",
        "11. Wheelchair users can board every ferry by the car ramp; please tell the crew at the ramp, and a lift takes you to the passenger deck.",
        "12. Lost property is kept at the Eastport office for one month; call the office or write to the help desk with a description.",
        "13. Season tickets for islanders cost 60 pounds a month for unlimited foot passenger travel on the route to their island.",
        "14. Group bookings of ten or more passengers get fifteen percent off if they are made a week ahead.",
        "15. Smoking and vaping are not allowed anywhere on board; alcohol bought on board may only be drunk in the cafe.",
        "16. The office in Eastport opens from 06:00 to 21:30 every day except Christmas Day, when no ferries sail.",
    ]
)
QUESTIONS = (
    "When does the first ferry to Calder leave?",
    "How much is a return ticket to Moray for one adult?",
    "Can I bring my dog on the ferry?",
    "Is there food on the Puffin?",
    "How early must I be at the harbour with my car?",
    "What happens to my ticket if the ferry is cancelled?",
    "How do I get to Holm?",
    "Can I pay in cash on board?",
    "Do children pay?",
    "Is the office open on Christmas Day?",
)
# Three conversations of four user turns each (the assistant's turns are the system's own answers).
CHATS = (
    (
        "Name three things to pack for a day on a small island.",
        "Which of them matters most in the rain?",
        "Why?",
        "Anything else for children?",
    ),
    (
        "Suggest a name for a grey cat.",
        "Something shorter?",
        "And one for a second cat, to match?",
        "Which would a child like best?",
    ),
    (
        "Give me a simple soup recipe with leeks.",
        "How long does it cook?",
        "Can I freeze it?",
        "What bread goes with it?",
    ),
)
CHAT_SYSTEM = "You are a concise, friendly assistant. Answer in at most two sentences."


@dataclass(frozen=True)
class Request:
    """One request of a workload, the same for both systems."""

    workload: str
    index: int
    group: str  # its topic, conversation or phase: what it shares a prefix with
    warm: bool  # the system may serve it from its cache (not the first of its prefix)
    prompt: str = ""  # a completion
    messages: tuple[tuple[str, str], ...] = ()  # a chat: (role, content); the driver adds earlier answers
    conversation: int = -1  # a chat's conversation (its earlier turns and answers are the driver's)
    max_tokens: int = 8

    @property
    def kind(self) -> str:
        return "chat" if self.messages or self.conversation >= 0 else "completion"

    @property
    def routing_text(self) -> str:
        """What a prefix-hash balancer hashes: the prompt, or the messages' text in order."""
        return self.prompt or "\n".join(content for _, content in self.messages)


def interleave(groups: Sequence[Sequence]) -> list:
    """Round-robin over ``groups``: the first of each, then the second of each, ... (pure)."""
    out = []
    for row in itertools.zip_longest(*groups):
        out.extend(item for item in row if item is not None)
    return out


def one_board_warm(
    mmlu_prompt: str, repeats: int = 6, questions: Sequence[str] = QUESTIONS, max_tokens: int = 8
) -> list[Request]:
    """A 5-shot MMLU prompt ``repeats`` times, then the system prompt with each question (pure)."""
    name = "one-board-warm"
    out = [
        Request(name, i, "mmlu repeat", warm=i > 0, prompt=mmlu_prompt, max_tokens=max_tokens) for i in range(repeats)
    ]
    for j, question in enumerate(questions):
        out.append(
            Request(
                name,
                repeats + j,
                "system prompt",
                warm=j > 0,
                messages=(("system", SYSTEM_PROMPT), ("user", question)),
                max_tokens=max_tokens,
            )
        )
    return out


def many_prompts(by_topic: dict[str, Sequence[str]], max_tokens: int = 4) -> list[Request]:
    """The prompts of each topic, topics interleaved (pure): the first of a topic is cold."""
    name = "one-board-many"
    tagged = [
        [(topic, position, prompt) for position, prompt in enumerate(prompts)] for topic, prompts in by_topic.items()
    ]
    return [
        Request(name, i, topic, warm=position > 0, prompt=prompt, max_tokens=max_tokens)
        for i, (topic, position, prompt) in enumerate(interleave(tagged))
    ]


def chat(conversations: Sequence[Sequence[str]] = CHATS, max_tokens: int = 24) -> list[Request]:
    """Each conversation's turns, conversations interleaved (pure): turn k > 0 continues turn k-1."""
    name = "chat"
    tagged = [[(c, turn, text) for turn, text in enumerate(turns)] for c, turns in enumerate(conversations)]
    return [
        Request(
            name,
            i,
            f"conversation {c}",
            warm=turn > 0,
            messages=(("system", CHAT_SYSTEM), ("user", text)),
            conversation=c,
            max_tokens=max_tokens,
        )
        for i, (c, turn, text) in enumerate(interleave(tagged))
    ]


def fleet(by_topic: dict[str, Sequence[str]], link: str, max_tokens: int = 4) -> list[Request]:
    """The many-prompts stream under the fleet's name for ``link`` (pure)."""
    return [
        Request(f"fleet-{link}", r.index, r.group, r.warm, prompt=r.prompt, max_tokens=max_tokens)
        for r in many_prompts(by_topic, max_tokens)
    ]


def remember(history: dict[int, list], request: Request, answer: str) -> None:
    """Keep a chat turn's question and answer for its conversation's next turns (pure). A chat
    request of no conversation (the warm workload's questions under one system prompt) is a
    question of its own: nothing carries over to the next one."""
    if request.kind == "chat" and request.conversation >= 0:
        history.setdefault(request.conversation, []).append((request.messages[-1][1], answer))


def chat_messages(request: Request, history: Sequence[tuple[str, str]]) -> list[dict]:
    """The OpenAI messages of a chat request after ``history`` (its conversation's earlier
    (question, answer) pairs): system, then each earlier turn, then this question (pure)."""
    system, question = request.messages[0][1], request.messages[-1][1]
    out = [{"role": "system", "content": system}]
    for asked, answered in history:
        out += [{"role": "user", "content": asked}, {"role": "assistant", "content": answered}]
    return out + [{"role": "user", "content": question}]


# -- the peer's balancers (pure) -----------------------------------------------------------------
class RoundRobin:
    """Each request to the next server in turn."""

    name = ROUND_ROBIN

    def __init__(self, servers: int):
        if servers < 1:
            raise ValueError("a balancer needs at least one server")
        self.servers = servers
        self._next = 0

    def pick(self, text: str) -> int:
        chosen = self._next
        self._next = (self._next + 1) % self.servers
        return chosen


class PrefixHash:
    """The server chosen by a hash of the prompt's first ``prefix_tokens`` tokens: requests that
    share that prefix (an MMLU topic's few-shot examples, a system prompt) meet on one server,
    whose prompt cache holds it. The strongest simple balancer a llama-server fleet can use."""

    name = PREFIX_HASH

    def __init__(self, servers: int, tokenize: Callable[[str], Sequence[int]], prefix_tokens: int = 256):
        if servers < 1:
            raise ValueError("a balancer needs at least one server")
        self.servers, self.tokenize, self.prefix_tokens = servers, tokenize, prefix_tokens

    def pick(self, text: str) -> int:
        head = list(self.tokenize(text))[: self.prefix_tokens]
        digest = hashlib.blake2b(b"".join(int(t).to_bytes(4, "little") for t in head), digest_size=8).digest()
        return int.from_bytes(digest, "little") % self.servers


# -- the summary maths (pure) -------------------------------------------------------------------
def _pct(values: Iterable[float], p: float) -> float | None:
    values = [v for v in values if v is not None]
    return percentile(values, p, digits=1) if values else None


def agreement(samples: Sequence[dict]) -> float | None:
    """The share of answers identical to the same request's cold answer (None: no cold answers)."""
    pairs = [(s["text"], s["cold_text"]) for s in samples if s.get("cold_text") is not None and not s.get("error")]
    return round(statistics.fmean(a == b for a, b in pairs), 4) if pairs else None


def summarize(samples: Sequence[dict], *, elapsed_s: float, peak_rss_mb: dict[str, float] | None = None) -> dict:
    """One system's figures on one workload (pure)."""
    ok = [s for s in samples if not s.get("error")]
    warm = [s for s in ok if s.get("warm")]
    tokens = sum(s.get("tokens", 0) for s in ok)
    rss = dict(peak_rss_mb or {})
    return {
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "error_examples": sorted({s["error"] for s in samples if s.get("error")})[:3],
        "ttft_ms": {"p50": _pct((s["ttft_ms"] for s in ok), 50), "p99": _pct((s["ttft_ms"] for s in ok), 99)},
        "warm_ttft_ms": {"p50": _pct((s["ttft_ms"] for s in warm), 50), "p99": _pct((s["ttft_ms"] for s in warm), 99)},
        "cold_ttft_ms": {"p50": _pct((s["ttft_ms"] for s in ok if not s.get("warm")), 50)},
        # each system's own prefill of what it had not cached (a board's breakdown; llama-server's timings)
        "warm_prefill_ms": {"p50": _pct((s.get("prefill_ms") for s in warm), 50)},
        "total_s": round(elapsed_s, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / elapsed_s, 2) if elapsed_s > 0 else None,
        "requests_per_s": round(len(ok) / elapsed_s, 3) if elapsed_s > 0 else None,
        "http_bytes": sum(s.get("http_bytes", 0) for s in ok),
        "cache_bytes": sum(s.get("cache_bytes", 0) for s in ok),
        "cached_tokens": sum(s.get("cached_tokens", 0) or 0 for s in ok),
        "prompt_tokens": sum(s.get("prompt_tokens", 0) or 0 for s in ok),
        "peak_rss_mb": rss,
        "peak_rss_mb_max": max(rss.values()) if rss else None,
        "agreement": agreement(ok),
        "servers": dict(sorted(_count(s.get("server", "") for s in ok).items())),
        "api_overhead_ms": _api_overhead(ok),
    }


def _count(values: Iterable[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return counts


def _api_overhead(samples: Sequence[dict]) -> dict | None:
    """EdgeCache's first chunk at the client minus the board's own TTFT, and its parts (api_ms:
    arrival to dispatch; queue_ms: dispatch to the board taking the run); None for the peer."""
    rows = [s for s in samples if s.get("board_ttft_ms") is not None]
    if not rows:
        return None
    return {
        "first_chunk_minus_board_ttft_ms_p50": _pct((s["ttft_ms"] - s["board_ttft_ms"] for s in rows), 50),
        "api_ms_p50": _pct((s.get("api_ms") for s in rows), 50),
        "queue_ms_p50": _pct((s.get("queue_ms") for s in rows), 50),
        "board_ttft_ms_p50": _pct((s["board_ttft_ms"] for s in rows), 50),
    }


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours is not None and theirs else None


def warm_floor(workloads: dict) -> dict | None:
    """One board, warm: EdgeCache's board prefill alone (what it had not restored: the new
    question) against llama-server's whole warm TTFT (pure). Both prefill with the same llama.cpp,
    so no API work brings the warm ratio below this one; None where either figure is missing."""
    warm = workloads.get("one-board-warm", {}).get("systems", {})
    if EDGECACHE not in warm or PEER not in warm:
        return None
    ours = (warm[EDGECACHE].get("warm_prefill_ms") or {}).get("p50")
    theirs = warm[PEER]["warm_ttft_ms"]["p50"]
    if ours is None or not theirs:
        return None
    return {
        "edgecache_prefill_p50_ms": ours,
        "peer_prefill_p50_ms": (warm[PEER].get("warm_prefill_ms") or {}).get("p50"),
        "peer_warm_ttft_p50_ms": theirs,
        "ratio": ratio(ours, theirs),
    }


def floor_text(floor: dict | None) -> str:
    if floor is None:
        return ""
    return (
        f"One board, warm: EdgeCache's board prefilled what it had not restored in {_fmt(floor['edgecache_prefill_p50_ms'])} ms (p50), "
        f"{floor['ratio']} of llama-server's whole warm TTFT ({_fmt(floor['peer_warm_ttft_p50_ms'])} ms; its own prefill "
        f"{_fmt(floor['peer_prefill_p50_ms'])} ms): with the same llama.cpp on both sides, no work outside the model takes the warm ratio below that."
    )


@dataclass(frozen=True)
class Target:
    name: str
    value: float | None
    limit: float
    higher_is_better: bool = False

    @property
    def met(self) -> bool | None:
        if self.value is None:
            return None
        return self.value >= self.limit if self.higher_is_better else self.value <= self.limit


def targets(workloads: dict, *, shared_mb: float | None = None) -> list[dict]:
    """The issue's targets, from the workloads measured (a workload not run is absent) (pure).
    ``shared_mb``: the memory both were given (llama-server's idle RSS + its --cache-ram), when they were."""
    out: list[Target] = []
    warm = workloads.get("one-board-warm", {}).get("systems", {})
    if EDGECACHE in warm and PEER in warm:
        out.append(
            Target(
                "one board, warm: EdgeCache TTFT p50 / llama-server's",
                ratio(warm[EDGECACHE]["warm_ttft_ms"]["p50"], warm[PEER]["warm_ttft_ms"]["p50"]),
                0.6,
            )
        )
    wifi = workloads.get("fleet-wifi4", {}).get("systems", {})
    peers = [
        wifi[name]["ttft_ms"]["p50"]
        for name in (ROUND_ROBIN, PREFIX_HASH)
        if name in wifi and wifi[name]["ttft_ms"]["p50"]
    ]
    if EDGECACHE in wifi and peers:
        out.append(
            Target(
                "fleet on Wi-Fi 4: EdgeCache TTFT p50 / the best peer balancer's",
                ratio(wifi[EDGECACHE]["ttft_ms"]["p50"], min(peers)),
                0.5,
            )
        )
    for name, workload in workloads.items():
        ours = workload.get("systems", {}).get(EDGECACHE)
        if ours is None:
            continue
        out.append(Target(f"{name}: EdgeCache agreement with cold", ours["agreement"], 1.0, higher_is_better=True))
    rss_ours = [
        w["systems"][EDGECACHE]["peak_rss_mb_max"] for w in workloads.values() if EDGECACHE in w.get("systems", {})
    ]
    rss_peer = [
        s["peak_rss_mb_max"] for w in workloads.values() for n, s in w.get("systems", {}).items() if n != EDGECACHE
    ]
    rss_ours, rss_peer = [v for v in rss_ours if v], [v for v in rss_peer if v]
    if rss_ours and rss_peer:
        out.append(
            Target(
                "peak RSS per board / llama-server's (largest of every workload)",
                ratio(max(rss_ours), max(rss_peer)),
                1.0,
            )
        )
    if rss_ours and shared_mb:
        out.append(
            Target(
                "peak RSS per board / the memory both may hold (llama-server's idle RSS + --cache-ram)",
                ratio(max(rss_ours), shared_mb),
                1.0,
            )
        )
    return [{**asdict(t), "met": t.met} for t in out]


def headline(doc: dict) -> str:
    parts = []
    for t in doc.get("targets", []):
        mark = "met" if t["met"] else ("missed" if t["met"] is False else "n/a")
        if "agreement" in t["name"]:
            continue
        parts.append(
            f"{t['name'].split(':')[0]} {t['value']}x ({mark}, target {'≥' if t['higher_is_better'] else '≤'} {t['limit']})"
        )
    agree = [t["value"] for t in doc.get("targets", []) if "agreement" in t["name"]]
    if agree:
        parts.append(
            f"EdgeCache agreement min {min(v for v in agree if v is not None) if any(v is not None for v in agree) else None}"
        )
    return "; ".join(parts) or doc.get("summary", "")


# -- what people read: the printed lines, the README table, the HTML report (pure but the file) ---
def table_rows(doc: dict) -> list[dict]:
    """One row per workload and system: the figures side by side."""
    rows = []
    for name, workload in doc.get("workloads", {}).items():
        for system, s in workload.get("systems", {}).items():
            rows.append(
                {
                    "workload": name,
                    "system": system,
                    "TTFT p50 ms": s["ttft_ms"]["p50"],
                    "TTFT p99 ms": s["ttft_ms"]["p99"],
                    "warm TTFT p50 ms": s["warm_ttft_ms"]["p50"],
                    "warm prefill p50 ms": (s.get("warm_prefill_ms") or {}).get("p50"),  # absent from older results
                    "total s": s["total_s"],
                    "tokens/s": s["tokens_per_s"],
                    "HTTP KB": round(s["http_bytes"] / 1024, 1),
                    "cache MB": round(s["cache_bytes"] / 1e6, 2),
                    "peak RSS MB": s["peak_rss_mb_max"],
                    "agreement": s["agreement"],
                }
            )
    return rows


def lines(doc: dict) -> list[str]:
    peer = doc.get("peer", {})
    out = [f"\nllama-server: {peer.get('version', '?')}; {doc.get('settings', {})}"]
    head = f"{'workload':<16}{'system':<28}{'TTFT p50':>10}{'p99':>9}{'warm p50':>10}{'prefill':>9}{'total s':>9}{'tok/s':>8}{'RSS MB':>8}{'agree':>7}"
    out.append(head)
    for r in table_rows(doc):
        out.append(
            f"{r['workload']:<16}{r['system']:<28}{_fmt(r['TTFT p50 ms']):>10}{_fmt(r['TTFT p99 ms']):>9}{_fmt(r['warm TTFT p50 ms']):>10}{_fmt(r['warm prefill p50 ms']):>9}"
            f"{_fmt(r['total s']):>9}{_fmt(r['tokens/s']):>8}{_fmt(r['peak RSS MB']):>8}{_fmt(r['agreement']):>7}"
        )
    for t in doc.get("targets", []):
        out.append(
            f"  target {t['name']}: {t['value']} (limit {t['limit']}): {'met' if t['met'] else 'MISSED' if t['met'] is False else 'n/a'}"
        )
    floor = floor_text(warm_floor(doc.get("workloads", {})))
    if floor:
        out.append(f"  {floor}")
    for name, reason in doc.get("skipped", {}).items():
        out.append(f"  skipped {name}: {reason}")
    return out


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.1f}" if abs(value) >= 10 else f"{value:.3g}"
    return str(value)


README_BEGIN = "<!-- vs-server table: generated by `python manage.py docs` from the newest saved JSON -->"
README_END = "<!-- end of vs-server table -->"


def newest_workloads(docs: Iterable[dict]) -> dict[str, dict]:
    """Each workload's newest figures from ``docs`` (newest first): a run of some workloads only
    (``--workloads``) updates those rows and keeps the others (pure). Each workload carries the
    ``date`` and ``peer`` of its document, and the memory both were given in it (``shared_mb``)."""
    found: dict[str, dict] = {}
    for doc in docs:
        for name, workload in (doc.get("workloads") or {}).items():
            if name not in found:
                found[name] = {
                    **workload,
                    "date": (doc.get("machine") or {}).get("date", "")[:10],
                    "peer": (doc.get("peer") or {}).get("version", ""),
                    "shared_mb": ((doc.get("memory") or {}).get("shared_mb")),
                }
    return {name: found[name] for name in sorted(found, key=_workload_order)}


def _workload_order(name: str) -> int:
    order = ("one-board-warm", "one-board-many", "chat", "fleet-loopback", "fleet-wifi4")
    return order.index(name) if name in order else len(order)


def readme_table(docs: Sequence[dict]) -> str:
    """The README's table of the newest figures of each workload, in Markdown, between its
    markers (pure); without a saved document, the line saying how to make one."""
    if not docs:
        return "\n".join(
            [
                README_BEGIN,
                "No saved result in `bench-results/` yet: `python manage.py bench vs-server` makes one.",
                README_END,
            ]
        )
    newest = docs[0]
    machine = newest.get("machine", {})
    settings = newest.get("settings", {})
    workloads = newest_workloads(docs)
    out = [
        README_BEGIN,
        f"On {machine.get('cpu_count', '?')} cores ({machine.get('cpu', '')}), {settings.get('model', '')}, context {settings.get('n_ctx', '')}, "
        f"{settings.get('threads', '?')} threads (a fleet's boards: half), against llama-server ({newest.get('peer', {}).get('version', '?')}); "
        "TTFT at the client, through each system's OpenAI API:",
        "",
        "| workload | system | TTFT p50 ms | TTFT p99 ms | warm TTFT p50 ms | total s | peak RSS MB | agreement | measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in table_rows({"workloads": workloads}):
        out.append(
            f"| {r['workload']} | {r['system']} | {_fmt(r['TTFT p50 ms'])} | {_fmt(r['TTFT p99 ms'])} | {_fmt(r['warm TTFT p50 ms'])} | "
            f"{_fmt(r['total s'])} | {_fmt(r['peak RSS MB'])} | {_fmt(r['agreement'])} | {workloads[r['workload']]['date']} |"
        )
    shared = {w.get("shared_mb") for w in workloads.values()}
    shared_mb = shared.pop() if len(shared) == 1 else None  # one figure for every row, or none
    targets_now = targets(workloads, shared_mb=shared_mb)
    if shared_mb:
        out.append("")
        out.append(
            f"Both had the same memory: {shared_mb:.0f} MB per board or server, llama-server's RSS once loaded and warmed plus its "
            "`--cache-ram`; EdgeCache's boards were registered with it and sized their RAM tier to what it leaves."
        )
    if targets_now:
        out.append("")
        out.append(
            "Targets: "
            + "; ".join(
                f"{t['name']} {t['value']} ({'met' if t['met'] else 'missed' if t['met'] is False else 'n/a'})"
                for t in targets_now
                if "agreement" not in t["name"]
            )
            + "."
        )
    floor = floor_text(warm_floor(workloads))
    if floor:
        out.append("")
        out.append(floor)
    out.append("")
    out.append(README_END)
    return "\n".join(out)


def replace_readme_table(readme: str, table: str) -> str:
    """``readme`` with the text between the markers replaced by ``table`` (ValueError without markers)."""
    start, end = readme.find(README_BEGIN), readme.find(README_END)
    if start < 0 or end < start:
        raise ValueError(
            f"the README has no vs-server markers; add the two lines {README_BEGIN!r} and {README_END!r} where the table goes"
        )
    return readme[:start] + table + readme[end + len(README_END) :]


def report(path: Path, doc: dict) -> Path:
    """The HTML report: one chart per workload, both systems side by side, then the table."""
    import plotly.graph_objects as go

    # lazy: plotly stays out of manage.py docs, which imports this module
    from dashboard.bench.html_report import write_report

    figures = []
    for name, workload in doc.get("workloads", {}).items():
        systems = workload.get("systems", {})
        names = list(systems)
        figure = go.Figure()
        bars = (
            ("TTFT p50", "ttft_ms", "p50"),
            ("TTFT p99", "ttft_ms", "p99"),
            ("warm TTFT p50", "warm_ttft_ms", "p50"),
            ("warm prefill p50 (its own)", "warm_prefill_ms", "p50"),
        )
        for label, key, part in bars:
            figure.add_bar(name=label, x=names, y=[(systems[n].get(key) or {}).get(part) for n in names])
        rss = [systems[n]["peak_rss_mb_max"] for n in names]
        figure.add_scatter(
            name="peak RSS per board (MB, right axis)",
            x=names,
            y=rss,
            mode="markers",
            marker={"size": 12, "symbol": "diamond"},
            yaxis="y2",
        )
        agree = ", ".join(f"{n}: {systems[n]['agreement']}" for n in names)
        figure.update_layout(
            title=f"{name}: {workload.get('description', '')}<br><sup>agreement with cold: {agree}</sup>",
            barmode="group",
            yaxis={"title": "ms (lower is better)"},
            yaxis2={"title": "MB", "overlaying": "y", "side": "right", "rangemode": "tozero"},
            template="plotly_white",
        )
        figures.append(figure)
    rows = table_rows(doc)
    target_rows = [
        {"target": t["name"], "value": t["value"], "limit": t["limit"], "met": t["met"]} for t in doc.get("targets", [])
    ]
    peer = doc.get("peer", {})
    summary = f"{doc.get('summary', '')} Peer: {peer.get('version', '')} ({peer.get('flags', '')}). {floor_text(warm_floor(doc.get('workloads', {})))}".rstrip()
    return write_report(
        path,
        "bench vs-server: EdgeCache and llama.cpp's llama-server, side by side",
        summary,
        figures,
        {"Targets": target_rows, "Figures": rows},
        doc,
    )
