"""`python manage.py bench api`: concurrent streaming clients of the OpenAI-compatible API.

Each client (a process of its own, plain HTTP on one kept-alive connection, as OpenAI's client
keeps its connections) sends streamed chat requests one after another until the clock runs out
and measures, per request, the first content chunk's latency and, from the last
chunk's ``edgecache`` figures, the board's own TTFT, the queue (from dispatch to the board taking
the run, as the API saw it) and how long the run waited on its board for earlier runs to end
(``behind_ms``, from the request's arrival at the API). What the API adds (``overhead_ms``) is the
first chunk minus the board's TTFT and that wait: HTTP, key, routing, the dispatch and its hop to
the board, the board's checks before it starts, the pub/sub hop of the first token. The wait
behind other runs is the fleet's capacity, not the API's cost (with more clients than boards it is
most of the first chunk), and the API's work that overlaps it delays nothing. Bounded in count
and time; loopback or the URL given only. ``share_ms`` is the issue's figure for the API's share of
the first chunk: the first chunk minus the queue and the board's TTFT.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import queue
import time
from pathlib import Path
from urllib.parse import urlsplit

import plotly.graph_objects as go

from dashboard.bench.base import BenchError, Benchmark
from dashboard.bench.common import percentile
from dashboard.bench.html_report import write_report

QUESTIONS = (
    "Name three colors of the rainbow.",
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Count from one to five.",
    "What do bees make?",
    "Name a fruit that is yellow.",
    "What is two plus three?",
    "Say hello in French.",
)
MAX_REQUESTS_PER_CLIENT = 10_000  # a bound on the loop, whatever the clock says
FIGURES = (
    "first_chunk_ms",
    "api_ms",
    "queue_ms",
    "behind_ms",
    "board_ttft_ms",
    "first_minus_board_ttft_ms",
    "overhead_ms",
    "share_ms",
    "total_ms",
)


def models(url: str, key: str) -> list[str]:
    status, body = _request(url, "GET", "/v1/models", key, None)
    if status != 200:
        raise RuntimeError(f"GET /v1/models answered {status}: {body[:300]!r}")
    return [entry["id"] for entry in json.loads(body)["data"]]


def run_api_bench(
    url: str, key: str, model: str, *, clients: int = 8, seconds: float = 30, max_tokens: int = 32, progress=None
) -> dict:
    """Run the clients for ``seconds``, each a process of its own (as clients are programs of their
    own: threads of one interpreter would wait on each other's turn to read their chunks); the
    figures and every sample."""
    context = multiprocessing.get_context("fork")
    done = context.Value("i", 0)
    results = context.Queue()
    started = time.monotonic()
    processes = [
        context.Process(
            target=_client, args=(url, key, model, number, started, seconds, max_tokens, done, results), daemon=True
        )
        for number in range(clients)
    ]
    for process in processes:
        process.start()
    samples: list[dict] = []
    reported, finished = 0, 0
    limit = started + seconds + 180  # a request started just before the clock may finish after it
    while finished < clients and time.monotonic() < limit:
        try:
            samples += results.get(timeout=0.2)
            finished += 1
        except queue.Empty:
            pass
        if progress is not None and done.value > reported:
            progress(done.value - reported)
            reported = done.value
    for process in processes:
        process.join(1)
        if process.is_alive():
            process.kill()
    elapsed = time.monotonic() - started
    return summarize(samples, clients=clients, seconds=seconds, elapsed=elapsed, model=model, max_tokens=max_tokens)


def _client(
    url: str, key: str, model: str, number: int, started: float, seconds: float, max_tokens: int, done, results
) -> None:
    """One client: requests one after another until the clock runs out, on one kept-alive
    connection as OpenAI's client keeps them (a new one after a failure); its samples, at the end."""
    samples = []
    connection = _Connection(url)
    for index in range(MAX_REQUESTS_PER_CLIENT):
        if time.monotonic() >= started + seconds:
            break
        question = QUESTIONS[(number + index) % len(QUESTIONS)]
        sample = _one(url, key, model, question, max_tokens, connection)
        sample.update({"client": number, "t_s": round(time.monotonic() - started, 3)})
        samples.append(sample)
        with done.get_lock():
            done.value += 1
    results.put(samples)


class _Connection:
    """A client's HTTP connection, kept alive from one request to the next (opened again after a
    failure or when the server closed it)."""

    def __init__(self, url: str):
        self.parts = urlsplit(url)
        self.http: http.client.HTTPConnection | None = None

    def open(self, timeout: float) -> http.client.HTTPConnection:
        if self.http is None:
            self.http = http.client.HTTPConnection(self.parts.hostname, self.parts.port or 80, timeout=timeout)
            self.http.connect()  # before the clock: a kept-alive client does not pay it per request
        return self.http

    def done(self, reusable: bool) -> None:
        if not reusable and self.http is not None:
            self.http.close()
            self.http = None


def stream_chat(url: str, key: str, body: dict, timeout: float, kept: _Connection | None = None) -> dict:
    """One streamed chat completion through the API, as a client sees it: ``first_ms`` (to the
    first content chunk, None without one), ``chunks`` (content chunks), ``figures`` (the last
    chunk's ``edgecache`` figures), ``total_ms`` and ``error`` ('' when it answered). ``kept``: the
    client's connection, kept alive (else one of its own, closed after)."""
    own = kept is None  # closed after this request
    kept = kept or _Connection(url)
    try:
        connection = kept.open(timeout)
    except OSError as exc:
        kept.done(False)
        return {"first_ms": None, "chunks": 0, "figures": {}, "total_ms": 0.0, "error": f"{type(exc).__name__}: {exc}"}
    reusable = False
    sent = time.perf_counter()
    first_ms, chunks, figures, error = None, 0, {}, ""
    try:
        connection.request(
            "POST",
            "/v1/chat/completions",
            body=json.dumps(body),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        response = connection.getresponse()
        if response.status != 200:
            error = f"HTTP {response.status}: {response.read()[:200].decode(errors='replace')}"
            reusable = not response.will_close
        else:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = str(chunk["error"].get("message", "error"))[:200]
                    break
                if chunk.get("choices") and chunk["choices"][0].get("delta", {}).get("content"):
                    chunks += 1
                    if first_ms is None:
                        first_ms = (time.perf_counter() - sent) * 1000.0
                figures = chunk.get("edgecache") or figures
            else:  # read to its end: the connection may carry the next request
                reusable = not response.will_close
    except (OSError, http.client.HTTPException, ValueError) as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        kept.done(reusable and not own)
    return {
        "first_ms": first_ms,
        "chunks": chunks,
        "figures": figures,
        "total_ms": (time.perf_counter() - sent) * 1000.0,
        "error": error,
    }


def _one(url: str, key: str, model: str, question: str, max_tokens: int, connection: _Connection | None = None) -> dict:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    answer = stream_chat(url, key, body, timeout=300, kept=connection)
    first_ms, tokens, figures, error, total_ms = (
        answer["first_ms"],
        answer["chunks"],
        answer["figures"],
        answer["error"],
        answer["total_ms"],
    )
    board_ttft, queue_ms, api_ms, behind_ms = (
        figures.get("ttft_ms"),
        figures.get("queue_ms"),
        figures.get("api_ms"),
        figures.get("behind_ms"),
    )
    return {
        "first_chunk_ms": round(first_ms, 3) if first_ms is not None else None,
        "board_ttft_ms": board_ttft,
        "queue_ms": queue_ms,
        "behind_ms": behind_ms,
        "api_ms": api_ms,
        "first_minus_board_ttft_ms": round(first_ms - board_ttft, 3)
        if first_ms is not None and board_ttft is not None
        else None,
        "overhead_ms": round(first_ms - board_ttft - behind_ms, 3)
        if first_ms is not None and board_ttft is not None and behind_ms is not None
        else None,
        # The API's share of the first chunk: what is neither the board's TTFT nor the queue
        # (from dispatch to the board taking the run).
        "share_ms": round(first_ms - board_ttft - queue_ms, 3)
        if first_ms is not None and board_ttft is not None and queue_ms is not None
        else None,
        "api_phases_ms": figures.get("api_phases_ms") or {},
        "total_ms": round(total_ms, 3),
        "chunks": tokens,
        "device": figures.get("device", ""),
        "case": figures.get("case", ""),
        "error": error,
    }


def summarize(
    samples: list[dict], *, clients: int, seconds: float, elapsed: float, model: str, max_tokens: int
) -> dict:
    ok = [s for s in samples if not s["error"]]

    def stats(field: str) -> dict:
        values = [s[field] for s in ok if s[field] is not None]
        return {"p50": _round(percentile(values, 50)), "p99": _round(percentile(values, 99))}

    devices = sorted({s["device"] for s in ok if s["device"]})
    return {
        "clients": clients,
        "seconds": seconds,
        "elapsed_s": round(elapsed, 3),
        "model": model,
        "max_tokens": max_tokens,
        "requests": len(samples),
        "errors": len(samples) - len(ok),
        "error_examples": sorted({s["error"] for s in samples if s["error"]})[:5],
        "requests_per_s": round(len(ok) / elapsed, 3) if elapsed else 0.0,
        "chunks_per_s": round(sum(s["chunks"] for s in ok) / elapsed, 3) if elapsed else 0.0,
        "first_chunk_ms": stats("first_chunk_ms"),
        "board_ttft_ms": stats("board_ttft_ms"),
        "queue_ms": stats("queue_ms"),
        "behind_ms": stats("behind_ms"),
        "api_ms": stats("api_ms"),
        "first_minus_board_ttft_ms": stats("first_minus_board_ttft_ms"),
        "overhead_ms": stats("overhead_ms"),
        "share_ms": stats("share_ms"),
        "total_ms": stats("total_ms"),
        "api_phases_ms": _phases(ok),
        "per_device": [{"device": name, "requests": sum(1 for s in ok if s["device"] == name)} for name in devices],
        "samples": samples,
    }


def _phases(samples: list[dict]) -> dict:
    """The median of each of the API's steps before dispatch (``edgecache.api_phases_ms``), in order."""
    names = list(dict.fromkeys(name for s in samples for name in s.get("api_phases_ms", {})))
    return {
        name: _round(percentile([s["api_phases_ms"][name] for s in samples if name in s.get("api_phases_ms", {})], 50))
        for name in names
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def api_report(path: Path, doc: dict) -> Path:
    ok = [s for s in doc["samples"] if not s["error"]]
    latency = go.Figure()
    latency.add_scatter(
        x=[s["t_s"] for s in ok], y=[s["first_chunk_ms"] for s in ok], mode="markers", name="first chunk (client)"
    )
    latency.add_scatter(
        x=[s["t_s"] for s in ok], y=[s["board_ttft_ms"] for s in ok], mode="markers", name="TTFT (board)"
    )
    latency.update_layout(
        title="First content chunk at the client and the board's own TTFT",
        xaxis_title="s since the start",
        yaxis_title="ms",
        yaxis_type="log",
        template="plotly_white",
    )
    rows = [{"figure": name, "p50 ms": doc[name]["p50"], "p99 ms": doc[name]["p99"]} for name in FIGURES if name in doc]
    summary = (
        f"{doc['clients']} streaming clients for {doc['seconds']:g} s against {doc['model']}: {doc['requests']} requests, "
        f"{doc['errors']} errors, {doc['requests_per_s']} requests/s, {doc['chunks_per_s']} chunks/s; "
        f"what the API adds (first chunk minus the board's TTFT and the wait for its earlier runs): p50 {doc['overhead_ms']['p50']} ms, p99 {doc['overhead_ms']['p99']} ms; "
        f"queue (dispatch to the board taking the run): p50 {doc['queue_ms']['p50']} ms, of it behind earlier runs: p50 {doc.get('behind_ms', {}).get('p50')} ms."
    )
    return write_report(
        path,
        f"bench api: {doc['clients']} clients, {doc['seconds']:g} s",
        summary,
        [latency],
        {"Latency": rows, "Boards": doc["per_device"]},
        doc,
    )


def _request(url: str, method: str, path: str, key: str, body: dict | None) -> tuple[int, bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=30)
    try:
        connection.request(
            method,
            path,
            body=json.dumps(body) if body is not None else None,
            headers={"Authorization": f"Bearer {key}"},
        )
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


# -- the command (python manage.py bench api) ----------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the running dashboard (default http://127.0.0.1:8000; `make run`)",
    )
    parser.add_argument("--clients", type=int, default=8, help="concurrent streaming clients (default 8)")
    parser.add_argument("--seconds", type=float, default=30, help="how long requests are sent (default 30)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer (default 32)")
    parser.add_argument(
        "--namespace",
        default="default",
        help="the namespace whose boards answer (a temporary API key of it is made, then revoked)",
    )


def run(ctx, *, url, clients, seconds, max_tokens, namespace, **options) -> dict:
    # lazy: the actions (and channels) only here; manage.py bench imports every bench
    from dashboard.actions.api_keys import create_key, revoke_key

    if clients < 1 or not 0 < seconds <= 3600 or max_tokens < 1:
        raise BenchError("--clients must be at least 1, --seconds between 0 and 3600, --max-tokens at least 1")
    try:
        row, key = create_key(None, namespace, name="bench api (temporary)", rate_per_minute=0)
    except ValueError as exc:
        raise BenchError(str(exc))
    try:
        try:
            served = models(url, key)
        except (OSError, RuntimeError) as exc:
            raise BenchError(
                f"the API at {url} does not answer ({exc}); start the dashboard (`make run`) or pass --url"
            )
        if not served:
            raise BenchError(
                f"no board of namespace {namespace!r} is online; start one with `edgecache-board --name NAME`"
            )
        with ctx.progress(desc=f"bench api ({clients} clients, {seconds:g} s)", unit="request") as bar:
            return run_api_bench(
                url, key, served[0], clients=clients, seconds=seconds, max_tokens=max_tokens, progress=bar.update
            )
    finally:
        revoke_key(None, row)


def lines(doc: dict) -> list[str]:
    out = [
        f"\n{doc['requests']} requests, {doc['errors']} errors, {doc['requests_per_s']} requests/s, {doc['chunks_per_s']} chunks/s"
    ]
    for name in (name for name in FIGURES if name in doc):
        out.append(f"  {name:<26} p50 {doc[name]['p50']}  p99 {doc[name]['p99']}")
    if doc.get("api_phases_ms"):
        steps = ", ".join(f"{name} {ms}" for name, ms in doc["api_phases_ms"].items())
        out.append(f"  the API's steps, p50 ms: {steps}")
    out += [f"  error: {example}" for example in doc["error_examples"]]
    return out


def headline(doc: dict) -> str:
    return (
        f"{doc['clients']} clients, {doc['seconds']:g} s: {doc['requests']} requests, {doc['errors']} errors; "
        f"first chunk p50 {doc['first_chunk_ms']['p50']} ms, p99 {doc['first_chunk_ms']['p99']} ms"
    )


BENCH = Benchmark(
    name="api",
    format=3,  # 2: overhead_ms subtracts the wait behind earlier runs (behind_ms); 3: share_ms and api_phases_ms
    help="concurrent streaming clients of the OpenAI-compatible API against the online boards (a running server)",
    add_arguments=add_arguments,
    run=run,
    lines=lines,
    report=api_report,
    headline=headline,
)
