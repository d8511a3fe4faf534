"""`bench footprint`: a board's memory, measured in a process of its own, as a real board runs.

The parent (the bench command) starts a board process (``python -m dashboard.bench.footprint``)
that imports what an edge board imports, starts a ``Board`` from a ``BoardConfig`` carrying the
registered memory, and serves a fixed mix of runs: cold runs, misses and partial hits of MMLU
prompts sharing their few-shot examples, repeats served from the cache box (or the RAM tier),
a four-turn conversation and schema runs. While it runs the parent samples the child's RSS from
``/proc``; the child reports its peak (VmHWM), PSS and where the memory went.

With ``compare`` the same runs are served a second time by a board without a registered memory
(today's sizing: n_ubatch 512, a 128 MB RAM tier), one after the other on one machine, so the
TTFT ratios are side by side. Each board works in a namespace of its own (removed afterwards),
so neither one finds the other's entries.

This module stays light at import: the board process imports it, and what it imports would
count as the board's memory (``report`` imports the charts when called).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from inference.engine.proc_memory import ProcessMemory, mapped_files

NAME = "footprint"
FORMAT = 1
DEFAULT_TOPICS = ("astronomy", "high_school_biology")
# The travel schema and a prompt of it (examples/), as the schema tests use them.
SCHEMA_PROMPT = '<prompt schema="travel"><trip-plan duration="3 days"/><tokyo><kyoto/></tokyo><user>Which places first?</user></prompt>'
CHAT_OPENING = [
    ("system", "You are a terse assistant for ferry passengers."),
    ("user", "Name three things to bring on a ferry trip."),
]
CHAT_NEXT = ["Which of them matters most in winter?", "Why?", "Thanks. Anything else for children?"]
CHAT_TURNS = 4


# -- the runs (pure) ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    kind: str  # "cold" (no cache), "prompt" (cached: miss, partial or full), "chat" (a turn), "schema"
    prompt: int = -1  # MMLU prompt index (cold, prompt)
    turn: int = -1  # chat turn (0 ..)


def workload(runs: int) -> list[Step]:
    """``runs`` steps: each new MMLU prompt once cold and once cached (a miss, or a partial hit
    after another prompt of its topic stored the shared examples), the prompt before last again
    (a full hit from the board's tiers or the cache box), the four turns of a conversation after
    the fourth prompt and a schema run after the seventh and the twelfth. Pure."""
    if runs < 1:
        raise ValueError("runs must be at least 1")
    steps: list[Step] = []
    index = 0
    while len(steps) < runs:
        steps += [Step("cold", index), Step("prompt", index)]
        if index >= 2:
            steps.append(Step("prompt", index - 2))
        if index == 3:
            steps += [Step("chat", turn=turn) for turn in range(CHAT_TURNS)]
        if index in (6, 11):
            steps.append(Step("schema"))
        index += 1
    return steps[:runs]


def prompt_count(steps: list[Step]) -> int:
    return max((step.prompt for step in steps), default=-1) + 1


def mmlu_prompts(steps: list[Step], topics, shots: int) -> list[list[str]]:
    """The MMLU prompts (as segments) the steps name: prompt i is of topic i mod len(topics)."""
    # lazy: footprint's child runs this file: its top imports count in the measured interpreter stage
    from dashboard import mmlu

    count = prompt_count(steps)
    per_topic = -(-count // len(topics))
    built = {topic: mmlu.build_prompts(topic, shots, per_topic) for topic in topics}
    return [built[topics[index % len(topics)]][index // len(topics)].segments for index in range(count)]


def summarize_ttft(sized: list[dict], unsized: list[dict]) -> dict:
    """Median TTFT by (kind, case, tier) for the two boards over the same steps, and their ratio
    where both served a step the same way (the same case from the same tier). Pure."""

    def groups(runs):
        out: dict[str, list[float]] = {}
        for run in runs:
            out.setdefault(run_label(run), []).append(run["ttft_ms"])
        return out

    a, b = groups(sized), groups(unsized)
    rows = {}
    for label in sorted(set(a) | set(b)):
        left = round(statistics.median(a[label]), 2) if label in a else None
        right = round(statistics.median(b[label]), 2) if label in b else None
        rows[label] = {
            "sized_ms": left,
            "unsized_ms": right,
            "ratio": round(left / right, 3) if left is not None and right else None,
            "n": [len(a.get(label, [])), len(b.get(label, []))],
        }
    return rows


def run_label(run: dict) -> str:
    """How a run was served: ``cold``, ``prompt:miss``, ``prompt:partial:cachebox``, ``chat:full:context``..."""
    if run["kind"] == "cold":
        return "cold"
    parts = [run["kind"], run.get("case") or "miss"]
    if run.get("tier"):
        parts.append(run["tier"])
    return ":".join(parts)


# -- the board process -----------------------------------------------------------------------------
def _emit(event: dict) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def _memory() -> dict:
    return ProcessMemory.read().as_dict()


def board_main(spec: dict) -> int:
    """Run ``spec``'s steps as a board would (the child's entry point); JSON lines on stdout."""
    _emit({"event": "stage", "stage": "interpreter", "memory": _memory()})
    from inference.engine.proc_memory import tune_malloc  # lazy: measured from the bare interpreter on

    if spec.get("tune_malloc", True):
        tune_malloc()
    # What an edge process imports before it serves (inference.board.main and its Celery worker),
    # imported here: the child's memory after them is the measured "imports" stage.
    import celery.apps.worker  # noqa: F401
    import celery.worker.consumer  # noqa: F401
    import kombu.transport.redis  # noqa: F401

    import inference.board.main  # noqa: F401  # lazy: a measured stage
    import inference.board.tasks  # noqa: F401  # lazy: a measured stage
    from cachebox.signing import Keychain, KeyRing, shared_producer_ring  # lazy: a measured stage
    from dashboard.bench.common import machine_info  # lazy: a measured stage
    from inference.board.config import BoardConfig  # lazy: a measured stage
    from inference.board.runtime import Board  # lazy: a measured stage

    _emit(
        {
            "event": "stage",
            "stage": "imports",
            "memory": _memory(),
            "heavy_modules": sorted(
                name for name in ("torch", "django", "plotly", "channels", "uvicorn", "psycopg") if name in sys.modules
            ),
        }
    )
    ring = shared_producer_ring(KeyRing.from_dict(spec["ring"]))  # no control plane here: the ring's holders sign alike
    keys = Keychain(lambda namespace: ring if ring.covers(namespace) else None)
    config = BoardConfig.from_env(**spec["config"])
    board = Board.start(config, keys=keys, background_sync=True)
    namespace = config.namespace
    plan = getattr(board, "memory_plan", None)
    _emit(
        {
            "event": "stage",
            "stage": "board",
            "memory": _memory(),
            "machine": machine_info(board),
            "plan": plan.as_dict() if plan is not None else None,
            "n_ctx": board.engine.n_ctx,
            "n_ubatch": getattr(board.engine.config, "n_ubatch", 0) or board.engine.config.n_batch,
            "ram_tier_bytes": board.prefix.ram.budget_bytes if board.prefix.ram else 0,
        }
    )
    try:
        steps = [Step(**step) for step in spec["steps"]]
        prompts = spec["prompts"]  # segments, as a request brings them (the MMLU file stays in the parent)
        schema_source = (Path(spec["root"]) / "examples" / "travel.pml").read_text()
        max_tokens = spec["max_tokens"]
        conversation = list(CHAT_OPENING)
        encoded = False
        cold_tokens: dict[int, list[int]] = {}
        for number, step in enumerate(steps):
            started = time.perf_counter()
            if step.kind == "cold":
                result = board.run(prompts[step.prompt], max_tokens=max_tokens, use_cache=False, namespace=namespace)
                cold_tokens[step.prompt] = result.tokens
            elif step.kind == "prompt":
                result = board.run(prompts[step.prompt], max_tokens=max_tokens, namespace=namespace)
            elif step.kind == "chat":
                if step.turn:
                    conversation.append(("user", CHAT_NEXT[(step.turn - 1) % len(CHAT_NEXT)]))
                _, result = board.run_chat(conversation, max_tokens=16, namespace=namespace)
                board.follow_up(conversation, result.text, namespace=namespace)
                conversation.append(("assistant", result.text))
            else:
                if not encoded:
                    board.schemas.encode_schema(schema_source, namespace=namespace)
                    encoded = True
                result = board.run_pml(schema_source, SCHEMA_PROMPT, max_tokens=max_tokens, namespace=namespace)
            b = result.breakdown
            run = {
                "event": "run",
                "index": number,
                **asdict(step),
                "ttft_ms": round(b.ttft_ms, 2),
                "case": str(b.case),
                "tier": str(b.tier),
                "matched_tokens": b.matched_tokens,
                "prompt_tokens": b.prompt_tokens,
                "wall_ms": round((time.perf_counter() - started) * 1000, 1),
                "memory": _memory(),
            }
            if step.kind == "prompt" and step.prompt in cold_tokens:
                run["agrees_with_cold"] = result.tokens == cold_tokens[step.prompt]
            _emit(run)
        status = board.status()
        files = mapped_files()
        model_path = str(board.engine.model_file.path)
        _emit(
            {
                "event": "done",
                "memory": _memory(),
                "model_file_mb": files.get(model_path, 0.0),
                "libraries_mb": round(sum(mb for path, mb in files.items() if path != model_path), 1),
                "kv_mb": round(board.engine.n_ctx * board.engine.state_bytes_per_token / 2**20, 1),
                "ram_tier": status.get("ram_tier"),
                "memory_status": status.get("memory"),
            }
        )
    finally:
        try:
            if board.store is not None:
                board.store.flush(namespace)
        finally:
            board.close()
    return 0


# -- the parent --------------------------------------------------------------------------------------
class _Sampler(threading.Thread):
    """Reads a process's memory every ``every`` seconds until stopped; keeps the largest RSS and PSS."""

    def __init__(self, pid: int, every: float = 0.05):
        super().__init__(name="footprint-sampler", daemon=True)
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, float, float]] = []  # (s since start, RSS MB, PSS MB)
        self._stop_event = threading.Event()
        self._start = time.monotonic()

    def run(self) -> None:
        while not self._stop_event.wait(self.every):
            memory = ProcessMemory.read(self.pid)
            if not memory.rss_mb:
                continue
            self.samples.append((round(time.monotonic() - self._start, 2), memory.rss_mb, memory.pss_mb))

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)


class FootprintError(RuntimeError):
    """The board process failed; the message carries its last output."""


def measure_board(
    config: dict,
    *,
    ring: dict,
    steps: list[Step],
    prompts: list[list[str]],
    max_tokens: int,
    tune_malloc: bool = True,
    timeout: float = 3600.0,
    env: dict | None = None,
) -> dict:
    """Serve ``steps`` in a board process of its own; its stages, runs, samples and final memory."""
    root = Path(__file__).resolve().parent.parent.parent
    spec = {
        "config": config,
        "ring": ring,
        "steps": [asdict(step) for step in steps],
        "prompts": prompts,
        "max_tokens": max_tokens,
        "root": str(root),
        "tune_malloc": tune_malloc,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "dashboard.bench.footprint"],
        cwd=root,
        env={**os.environ, **(env or {})},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    sampler = _Sampler(process.pid)
    sampler.start()
    events: list[dict] = []
    peak = ProcessMemory()
    try:
        process.stdin.write(json.dumps(spec))  # the keys travel on a pipe, never on the command line
        process.stdin.close()
        deadline = time.monotonic() + timeout
        for line in process.stdout:
            event = json.loads(line)
            events.append(event)
            if event["event"] == "done":
                peak = ProcessMemory.read(process.pid)  # VmHWM before it exits
            if time.monotonic() > deadline:
                raise FootprintError(f"the board process took longer than {timeout:g} s")
        code = process.wait(timeout=60)
    finally:
        sampler.stop()
        if process.poll() is None:
            process.kill()
            process.wait()
    errors = process.stderr.read()[-3000:]
    if code != 0 or not events or events[-1]["event"] != "done":
        raise FootprintError(f"the board process failed (exit {code}): {errors.strip() or 'no output'}")
    stages = {event["stage"]: event for event in events if event["event"] == "stage"}
    runs = [event for event in events if event["event"] == "run"]
    done = events[-1]
    samples = sampler.samples
    return {
        "peak_rss_mb": max(peak.peak_rss_mb, max((rss for _, rss, _ in samples), default=0.0)),
        "pss_mb": max([pss for _, _, pss in samples] + [done["memory"]["pss_mb"]]),
        "final": done["memory"],
        "stages": {name: event["memory"] for name, event in stages.items()},
        "heavy_modules": stages["imports"].get("heavy_modules", []),
        "machine": stages["board"].get("machine"),
        "plan": stages["board"].get("plan"),
        "n_ctx": stages["board"].get("n_ctx"),
        "n_ubatch": stages["board"].get("n_ubatch"),
        "ram_tier_bytes": stages["board"].get("ram_tier_bytes"),
        "parts": parts({name: event["memory"] for name, event in stages.items()}, done),
        "runs": [{key: value for key, value in run.items() if key != "event"} for run in runs],
        "samples": samples[:: max(1, len(samples) // 2000)],
    }


def parts(stages: dict, done: dict) -> list[dict]:
    """Where the peak went, largest first: the mapped model, shared libraries, the interpreter and
    its imports, the KV cache, and the rest (llama.cpp's compute and output buffers, the RAM tier,
    states in flight and the allocator's slack), each as measured (MB). Pure."""
    interpreter = stages["interpreter"]["anon_mb"]
    imports = stages["imports"]["anon_mb"] - interpreter
    board = stages["board"]["anon_mb"] - stages["imports"]["anon_mb"]
    kv = done["kv_mb"]
    ram = (done.get("ram_tier") or {}).get("bytes", 0) / 2**20
    peak_anon = max(done["memory"]["anon_mb"], stages["board"]["anon_mb"])
    rows = [
        ("model weights (mapped GGUF file)", done["model_file_mb"]),
        ("shared libraries (mapped)", done["libraries_mb"]),
        ("interpreter", interpreter),
        ("imports (anonymous memory)", imports),
        ("KV cache (n_ctx x state bytes per token)", kv),
        ("engine buffers at start (repacked weights, compute and output buffers)", max(0.0, board - kv)),
        ("RAM tier (entries held at the end)", ram),
        ("runs (states in flight, allocator slack) at the end", max(0.0, peak_anon - stages["board"]["anon_mb"] - ram)),
    ]
    return sorted(({"part": name, "mb": round(mb, 1)} for name, mb in rows), key=lambda row: -row["mb"])


def run(options: dict) -> dict:
    """The bench: ``options`` holds memory_mb, runs, topics, shots, max_tokens, threads,
    namespace (a prefix), ring (the signing keys of that namespace prefix's namespaces: a
    callable namespace -> KeyRing dict), compare (also a board without a registered memory),
    board_env (environment of the board processes: REDIS_URL, EDGECACHE_HOME...)."""
    memory_mb = int(options.get("memory_mb") or 512)
    steps = workload(int(options.get("runs") or 50))
    topics = tuple(options.get("topics") or DEFAULT_TOPICS)
    shots, max_tokens, threads = (
        int(options.get("shots", 5)),
        int(options.get("max_tokens", 4)),
        int(options.get("threads") or 1),
    )
    ring_for = options["ring"]
    prefix = options.get("namespace") or f"bench-footprint-{uuid.uuid4().hex[:8]}"
    boards = {"sized": memory_mb}
    if options.get("compare", True):
        boards["unsized"] = 0
    prompts = mmlu_prompts(steps, topics, shots)
    measured = {}
    for label, memory in boards.items():
        namespace = f"{prefix}-{label}"
        config = {"device": f"footprint-{label}", "namespace": namespace, "threads": threads, "memory_mb": memory}
        if options.get("n_ctx"):
            config["n_ctx"] = int(options["n_ctx"])
        measured[label] = measure_board(
            config,
            ring=ring_for(namespace),
            steps=steps,
            prompts=prompts,
            max_tokens=max_tokens,
            env=options.get("board_env"),
        )
        if options.get("progress"):
            options["progress"](label)
    sized = measured["sized"]
    budget_mb = (sized.get("plan") or {}).get("budget_mb")
    document = {
        "bench": NAME,
        "format": FORMAT,
        "machine": sized["machine"],
        "memory_mb": memory_mb,
        "runs": len(steps),
        "threads": threads,
        "topics": list(topics),
        "shots": shots,
        "max_tokens": max_tokens,
        "peak_rss_mb": sized["peak_rss_mb"],
        "pss_mb": sized["pss_mb"],
        "budget_mb": budget_mb,
        "within_budget": budget_mb is not None and sized["peak_rss_mb"] <= budget_mb,
        "parts": sized["parts"],
        "boards": measured,
        "agreement_with_cold": _agreement(sized["runs"]),
    }
    if "unsized" in measured:
        document["ttft"] = summarize_ttft(sized["runs"], measured["unsized"]["runs"])
        document["peak_rss_mb_unsized"] = measured["unsized"]["peak_rss_mb"]
    return document


def _agreement(runs: list[dict]) -> float | None:
    checked = [run["agrees_with_cold"] for run in runs if "agrees_with_cold" in run]
    return round(sum(checked) / len(checked), 4) if checked else None


def report(path: Path, doc: dict) -> Path:
    """The HTML report beside the JSON: RSS over time for each board, the parts, the TTFT table."""
    import plotly.graph_objects as go

    # lazy: footprint's child runs this file: its top imports count in the measured interpreter stage
    from dashboard.bench.html_report import write_report

    over_time = go.Figure()
    for label, board in doc["boards"].items():
        over_time.add_scatter(
            x=[s[0] for s in board["samples"]], y=[s[1] for s in board["samples"]], mode="lines", name=f"{label} RSS"
        )
    if doc.get("budget_mb"):
        over_time.add_hline(
            y=doc["budget_mb"],
            line_dash="dot",
            annotation_text=f"budget {doc['budget_mb']} MB of {doc['memory_mb']} MB",
        )
    over_time.update_layout(
        title="Board RSS while serving the runs",
        xaxis_title="s since the board process started",
        yaxis_title="MB",
        template="plotly_white",
    )
    parts_figure = go.Figure(
        go.Bar(x=[row["mb"] for row in doc["parts"]], y=[row["part"] for row in doc["parts"]], orientation="h")
    )
    parts_figure.update_layout(
        title=f"Where the memory of a {doc['memory_mb']} MB board goes (MB)", template="plotly_white", margin={"l": 380}
    )
    ttft = [{"served as": label, **row} for label, row in (doc.get("ttft") or {}).items()]
    summary = (
        f"A board registered with {doc['memory_mb']} MB peaked at {doc['peak_rss_mb']} MB RSS (PSS {doc['pss_mb']} MB) over {doc['runs']} runs; "
        f"budget {doc['budget_mb']} MB; answers agree with cold: {doc['agreement_with_cold']}."
    )
    return write_report(
        path,
        f"bench footprint: {doc['memory_mb']} MB board",
        summary,
        [over_time, parts_figure],
        {"Parts": doc["parts"], "TTFT (median ms)": ttft},
        doc,
    )


# -- the `bench footprint` subcommand (the registry's shape: dashboard/bench/base.py) -----------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--memory-mb", type=int, default=512, help="the board's registered memory (default 512: a Pi Zero 2W)"
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=50,
        help="runs: cold, misses, partial and full hits, a 4-turn conversation, schema runs (default 50)",
    )
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads of the board (default 1)")
    parser.add_argument(
        "--no-compare", dest="compare", action="store_false", help="skip the unsized board (no TTFT ratios)"
    )


def measure(ctx, *, memory_mb: int, runs: int, threads: int, compare: bool, **options) -> dict:
    # lazy: footprint's child runs this file: its top imports count in the measured interpreter stage
    from dashboard.bench.base import BenchError

    if memory_mb < 64 or runs < 1 or threads < 1:
        raise BenchError("--memory-mb must be at least 64, --runs and --threads at least 1")
    config = ctx.config
    env = {
        "EDGECACHE_HOME": str(config.embedded_dir.parent),
        "REDIS_URL": ctx.cachebox_url() if not config.cachebox_url else config.redis_url,
    }
    if config.cachebox_url:
        env["EDGECACHE_CACHEBOX_URL"] = config.cachebox_url
    ctx.write(
        f"bench footprint: a {memory_mb} MB board serves {runs} runs"
        + (", then an unsized one the same runs" if compare else "")
    )
    try:
        return run(
            {
                "memory_mb": memory_mb,
                "runs": runs,
                "threads": threads,
                "compare": compare,
                "ring": ctx.keyring,
                "board_env": env,
                "progress": lambda label: ctx.write(f"  {label} board done"),
            }
        )
    except FootprintError as exc:
        raise BenchError(str(exc)) from None


def lines(doc: dict) -> list[str]:
    out = [
        f"\npeak RSS {doc['peak_rss_mb']} MB, PSS {doc['pss_mb']} MB (budget {doc['budget_mb']} MB of {doc['memory_mb']} MB: "
        f"{'within' if doc['within_budget'] else 'over'}); unsized board: peak {doc.get('peak_rss_mb_unsized', '-')} MB; "
        f"answers agree with cold: {doc['agreement_with_cold']}"
    ]
    out += [f"  {row['mb']:>7.1f} MB  {row['part']}" for row in doc["parts"]]
    out += [
        f"  TTFT {label:<28} sized {row['sized_ms']}  unsized {row['unsized_ms']}  ratio {row['ratio']}  (n {row['n'][0]}/{row['n'][1]})"
        for label, row in (doc.get("ttft") or {}).items()
    ]
    return out


def headline(doc: dict) -> str:
    return f"a {doc.get('memory_mb')} MB board peaked at {doc.get('peak_rss_mb')} MB RSS (budget {doc.get('budget_mb')} MB)"


def _benchmark():
    # lazy: footprint's child runs this file: its top imports count in the measured interpreter stage
    from dashboard.bench.base import Benchmark

    return Benchmark(
        name=NAME,
        format=FORMAT,
        help="a board's memory (peak RSS, PSS, by part) in a process of its own, sized to a registered memory, with TTFT beside an unsized board",
        add_arguments=add_arguments,
        run=measure,
        lines=lines,
        report=report,
        headline=headline,
    )


def __getattr__(name: str):
    # ``BENCH`` is built on first use: the board process imports this module and must stay light.
    if name == "BENCH":
        return _benchmark()
    raise AttributeError(name)


if __name__ == "__main__":
    sys.exit(board_main(json.loads(sys.stdin.read())))
