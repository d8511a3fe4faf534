"""Simulated boards for ``bench fleet-sim``: many boards without a model in one process.

Each simulated board speaks the real contract with the control plane (``inference.contract.messages``,
``inference.contract.envelope``): it enrolls its own key pair with its device's token (``inference.board.devices.enroll``),
pushes signed heartbeats every few seconds onto the broker's heartbeat list, syncs its namespace's catalog log every second as a
real board's ``CatalogSyncThread`` does, takes sealed run requests off its own queue
(``device.NAME``), opens and checks them, publishes signed stream events and sends a signed,
sealed report. The answer takes a synthetic time drawn from measured board rates
(``inference.engine.compute_profile``: a Pi 5 or a Pi Zero 2W prefilling at its paper rate), and a run
that misses uploads a sealed entry of ``bytes_per_token`` per prompt token (fetched and opened by
the next board whose catalog says it is there).

What differs from a board process: the boards of one process share one connection pool to the
broker and cache box as the deployment's Redis user (a board process connects as its own ACL
user, which the control plane still makes for each of them); Celery messages are written in
Celery's own wire format (protocol 2, JSON) straight onto the lists kombu reads, so one asyncio
loop carries hundreds of boards.

Run as ``python -m dashboard.bench.sim_board SPEC.json``: the spec names the servers, the boards and
their tokens, and the files through which the bench says "go" and "stop"; the process writes its
measurements to ``SPEC.json``'s ``out`` file.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import os
import random
import sys
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cachebox.cluster import is_cluster_url, parse_cluster_url
from cachebox.entry import EntryHeader, encode_entry, open_entry
from cachebox.keys import catalog_key_names, enroll_inbox_key, entry_key_name, heartbeat_key, inbox_key, stream_channel
from cachebox.signing import UnknownProducer
from cachebox.store import CacheBox
from inference.board import EdgeIdentity
from inference.board.devices import enroll
from inference.board.identity import BoardKeys
from inference.contract.envelope import EnvelopeRefused, Kind, peek
from inference.contract.messages import (
    AuditReport,
    AuditRequest,
    BoardRates,
    BoardStatus,
    EnrollRequest,
    Heartbeat,
    InboxMessage,
    MessageRefused,
    Queue,
    RunReport,
    RunRequest,
    StoredEntry,
    StreamEvent,
    Task,
)
from inference.engine.compute_profile import PI_5, PI_ZERO_2W
from inference.placement import RAM_RESTORE_MS_PER_TOKEN
from inference.serving.breakdown import Breakdown, Case, Decision, Tier

log = logging.getLogger("dashboard.bench.sim_board")

SIM_MODEL = "sim-gemma-3-270m.gguf"  # what simulated boards say they serve (no model is loaded)
SIM_FINGERPRINT = "5111" + "0" * 28
DECODE_PER_PREFILL = 2.0  # decode ms per token, as a multiple of the board's prefill rate (llama.cpp on a Pi: ~2x)
CHARS_PER_TOKEN = 4.0  # a prompt's length in tokens, estimated when its request carries no tokens (no tokenizer here)
SYNC_INTERVAL_S = 1.0  # as ``CatalogSyncThread``
RAM_TIER_BYTES = 64 * 2**20  # a simulated board's RAM tier, as its heartbeat reports it
RATES = ((PI_5.prefill_ms_per_token, 0.8), (PI_ZERO_2W.prefill_ms_per_token, 0.2))  # (ms per token, share of the fleet)


def rate_of(name: str) -> float:
    """A board's prefill rate (ms per token), fixed by its name: 80% Pi 5, 20% Pi Zero 2W."""
    draw = int(hashlib.blake2b(name.encode(), digest_size=4).hexdigest(), 16) / 2**32
    cumulative = 0.0
    for rate, share in RATES:
        cumulative += share
        if draw < cumulative:
            return rate
    return RATES[-1][0]


def prompt_key(namespace: str, text: str) -> bytes:
    """The entry key a simulated board stores a prompt's state under (16 bytes, as ``cachebox.keys``)."""
    return hashlib.blake2b(f"{namespace}\0{text}".encode(), digest_size=16).digest()


def task_message(task: str, args: list, *, queue: str, expires_s: float | None = None) -> bytes:
    """One Celery task message (protocol 2, JSON body) as kombu's Redis transport stores it on ``queue``'s list."""
    task_id = str(uuid.uuid4())
    expires = (datetime.now(timezone.utc) + timedelta(seconds=expires_s)).isoformat() if expires_s else None
    headers = {
        "lang": "py",
        "task": task,
        "id": task_id,
        "shadow": None,
        "eta": None,
        "expires": expires,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "root_id": task_id,
        "parent_id": None,
        "argsrepr": "",
        "kwargsrepr": "{}",
        "origin": "fleet-sim",
        "ignore_result": True,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
    body = json.dumps(
        [args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}], separators=(",", ":")
    ).encode()
    message = {
        "body": base64.b64encode(body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return json.dumps(message, separators=(",", ":")).encode()


def task_args(raw: bytes) -> tuple[str, list]:
    """(task name, args) of a kombu Redis message written by Celery."""
    message = json.loads(raw)
    body = message["body"]
    if message.get("properties", {}).get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args = json.loads(body)[0]
    return message["headers"]["task"], args


@dataclass
class SimBoard:
    me: EdgeIdentity
    rate_ms: float  # prefill, ms per token
    catalog: set = field(default_factory=set)  # entry keys its replica holds
    # What it holds itself, as a real board does (``inference.tiers``): the last prompt in its
    # context, those before in its RAM tier (key -> bytes, oldest first, within RAM_TIER_BYTES).
    held: OrderedDict = field(default_factory=OrderedDict)
    last_id: str = "0"
    last_sync: float | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # a board serves its queue one run at a time

    def hold(self, key: bytes, size: int) -> None:
        """``key``'s state is now in its context; the oldest leave its RAM tier past its budget."""
        self.held.pop(key, None)
        self.held[key] = size
        while len(self.held) > 1 and sum(self.held.values()) > RAM_TIER_BYTES:
            self.held.popitem(last=False)


class Fleet:
    """The simulated boards of one process and what they measured."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.redis_url = spec["redis_url"]
        self.cachebox_url = spec.get("cachebox_url") or spec["redis_url"]
        self.heartbeat_s = float(spec.get("heartbeat_s", 5.0))
        self.bytes_per_token = int(spec.get("bytes_per_token", 18_500))
        self.time_scale = float(spec.get("time_scale", 1.0))  # synthetic compute times scaled (tests: faster boards)
        self.boards: dict[str, SimBoard] = {}
        self.samples: dict[str, list] = {"dispatch_ms": [], "catalog_lag_ms": [], "board_ttft_ms": []}
        self.counts = {
            "heartbeats": 0,
            "runs": 0,
            "reports": 0,
            "uploads": 0,
            "fetches": 0,
            "fetch_misses": 0,
            "refused": 0,
            "errors": 0,
            "audits": 0,  # audit requests answered (inconclusive: a simulated board computes nothing)
        }
        self.errors: list[str] = []
        self.stopping = False

    # -- enrollment (threads: ``enroll`` is the board's own blocking code) ----------------------
    def enroll_all(self, threads: int = 16) -> float:
        import redis

        started = time.monotonic()
        sender = redis.Redis.from_url(self.redis_url)
        admin = CacheBox(self.cachebox_url)

        def send(fields: dict) -> None:
            message = InboxMessage(
                task=Task.ENROLL, body=EnrollRequest(**fields).dump()
            )  # as inference.board.send_enrollment
            sender.lpush(enroll_inbox_key(fields["device"]), json.dumps(message.dump(), separators=(",", ":")))

        def one(board: dict) -> None:
            keys = BoardKeys.generate()
            record, keys = enroll(
                admin, board["name"], keys, board["token"], send, timeout=float(self.spec.get("enroll_timeout_s", 900))
            )
            me = EdgeIdentity(board["name"], keys, record, admin)
            me._open_ring()
            me.read_producers()
            if me.ring is None:
                raise RuntimeError(f"board {board['name']} enrolled without its namespace's keys")
            self.boards[board["name"]] = SimBoard(me, rate_of(board["name"]))

        with ThreadPoolExecutor(threads) as pool:
            for future in [pool.submit(one, board) for board in self.spec["boards"]]:
                future.result()
        return time.monotonic() - started

    # -- the asyncio part -----------------------------------------------------------------------
    async def run(self) -> None:
        import redis.asyncio as aredis

        # A bounded pool that waits for a free connection (boards of one process share it).
        self.broker = aredis.Redis(
            connection_pool=aredis.BlockingConnectionPool.from_url(self.redis_url, max_connections=64, timeout=30)
        )
        if is_cluster_url(self.cachebox_url):  # entries, catalogs and stream events on a Valkey Cluster
            from redis.asyncio.cluster import ClusterNode, RedisCluster

            address = parse_cluster_url(self.cachebox_url)
            self.box = RedisCluster(
                startup_nodes=[ClusterNode(host, port) for host, port in address.nodes],
                username=address.username,
                password=address.password,
            )
        elif self.cachebox_url != self.redis_url:
            self.box = aredis.Redis(
                connection_pool=aredis.BlockingConnectionPool.from_url(
                    self.cachebox_url, max_connections=64, timeout=30
                )
            )
        else:
            self.box = self.broker
        tasks = [asyncio.create_task(self._heartbeats(board)) for board in self.boards.values()]
        tasks += [asyncio.create_task(self._sync_catalogs()), asyncio.create_task(self._consume())]
        stop_file = Path(self.spec["stop_file"])
        while not stop_file.exists():
            await asyncio.sleep(0.2)
        # Drain: answer what is queued or running, then stop.
        deadline = time.monotonic() + float(self.spec.get("drain_s", 60))
        while time.monotonic() < deadline:
            try:
                queued = await asyncio.wait_for(self._queued(), 10)
            except (asyncio.TimeoutError, OSError) as exc:
                self._error(f"drain: queues not read: {type(exc).__name__}: {exc}")
                break
            if not (self._running or queued):
                break
            await asyncio.sleep(0.2)
        else:
            self._error(f"drain: {self._running} runs still under way after {self.spec.get('drain_s', 60)} s")
        self.stopping = True
        Path(self.spec["out"]).write_text(json.dumps(self.results()))  # before closing: a stuck close loses nothing
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks, timeout=10)

    _running = 0

    async def _queued(self) -> int:
        pipe = self.broker.pipeline(transaction=False)
        for name in self.boards:
            pipe.llen(Queue.device(name))
        return sum(await pipe.execute())

    async def _send(self, task: Task, board: SimBoard, message, kind: Kind, expires_s: float | None = None) -> None:
        sealed = board.me.seal(message, kind)
        message = InboxMessage(task=task, body=sealed)  # as inference.board.send_to_control
        await self.broker.lpush(inbox_key(board.me.name), json.dumps(message.dump(), separators=(",", ":")))

    async def _heartbeats(self, board: SimBoard) -> None:
        await asyncio.sleep(random.uniform(0, self.heartbeat_s))  # boards start at different times
        while True:
            started = time.monotonic()
            try:
                status = BoardStatus(
                    pid=os.getpid(),
                    sent=time.time(),
                    model=SIM_MODEL,
                    fingerprint=SIM_FINGERPRINT,
                    threads=4,
                    heartbeat_s=self.heartbeat_s,
                    ram_tier={"budget_bytes": RAM_TIER_BYTES, "entries": len(board.held)},
                    # What a real board measures of itself at start and reports in every beat: the
                    # router weighs a board by it before its own runs are reported (a Pi Zero 2W is
                    # not taken for a Pi 5 meanwhile).
                    rates=BoardRates(
                        prefill_ms_per_token=board.rate_ms * self.time_scale,
                        decode_ms_per_token=board.rate_ms * DECODE_PER_PREFILL * self.time_scale,
                    ),
                    simulated=True,
                    catalogs={
                        board.me.record.cache_namespace: {
                            "approx_items": len(board.catalog),
                            "size_bytes": 1_198_160,
                            "fill_ratio": min(1.0, len(board.catalog) * 7 / 9_585_058),
                            "estimated_fp_rate": 0.0,
                            "configured_fp_rate": 0.01,
                            "last_sync": board.last_sync,
                        }
                    },
                )
                sealed = board.me.seal(Heartbeat(device=board.me.name, status=status), Kind.HEARTBEAT)
                raw = json.dumps(sealed, separators=(",", ":"))
                await self.broker.psetex(
                    heartbeat_key(board.me.name), max(60, int(self.heartbeat_s * 12)) * 1000, raw
                )  # as inference.board.push_heartbeat
                self.counts["heartbeats"] += 1
            except Exception as exc:  # noqa: BLE001 (counted and reported, the board beats on)
                self._error(f"heartbeat of {board.me.name}: {type(exc).__name__}: {exc}")
            await asyncio.sleep(max(0.0, self.heartbeat_s - (time.monotonic() - started)))

    async def _sync_catalogs(self) -> None:
        """Every board reads what was announced in its namespace's catalog log since its last read
        (one pipelined round trip per process per second: the cache box serves one read per board).
        The lag of a record is now minus the time in its stream id (the cache box's clock: this host)."""
        while True:
            started = time.monotonic()
            boards = list(self.boards.values())
            pipe = self.box.pipeline(transaction=False)
            for board in boards:
                name = catalog_key_names(board.me.record.cache_namespace)["log"]
                pipe.xrange(name, min=f"({board.last_id}" if board.last_id != "0" else "-", count=10_000)
            try:
                results = await pipe.execute()
            except Exception as exc:  # noqa: BLE001
                self._error(f"catalog sync: {type(exc).__name__}: {exc}")
                results = []
            now_ms = time.time() * 1000.0
            lags = self.samples["catalog_lag_ms"]
            for board, records in zip(boards, results):
                board.last_sync = now_ms / 1000.0
                for record_id, fields in records:
                    record_id = record_id.decode()
                    board.last_id = record_id
                    board.catalog.add(fields.get(b"k", b""))
                    if board.last_id != "0" and len(lags) < 200_000:
                        lags.append(now_ms - int(record_id.split("-")[0]))
            await asyncio.sleep(max(0.0, SYNC_INTERVAL_S - (time.monotonic() - started)))

    async def _consume(self) -> None:
        """Take run requests off every board's own queue (one BRPOP over all of them)."""
        names = [Queue.device(name) for name in self.boards]
        consumer = self.broker.client()
        while True:
            try:
                popped = await consumer.brpop(names, timeout=1)
            except Exception as exc:  # noqa: BLE001
                self._error(f"consume: {type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)
                continue
            if popped is None:
                continue
            queue, raw = popped
            board = self.boards.get(queue.decode().split(".", 1)[1])
            if board is None:
                self._error(f"a message on {queue!r}, which no board here serves")
                continue
            self._running += 1
            asyncio.create_task(self._serve(board, raw))

    async def _serve(self, board: SimBoard, raw: bytes) -> None:
        try:
            await self._answer(board, raw)
        except Exception as exc:  # noqa: BLE001
            self._error(f"run on {board.me.name}: {type(exc).__name__}: {exc}")
        finally:
            self._running -= 1

    async def _answer(self, board: SimBoard, raw: bytes) -> None:
        taken = time.time()
        task, args = task_args(raw)
        if task == Task.AUDIT_ENTRY.value:
            await self._audit(board, args[0])
            return
        if task != Task.RUN_PROMPT.value:
            self._error(f"{board.me.name}: unexpected task {task}")
            return
        envelope = args[0]
        try:
            body = board.me.open_request(envelope, Kind.RUN)
            request = RunRequest.parse(body)
        except (EnvelopeRefused, MessageRefused) as exc:
            self.counts["refused"] += 1
            self._error(f"{board.me.name}: request refused: {exc}")
            return
        self.samples["dispatch_ms"].append((taken - float(peek(envelope)["ts"])) * 1000.0)
        self.counts["runs"] += 1
        # The board serves its queue in order: a run waits for the one before it (a real board leaves it
        # on the broker meanwhile); it says "started" when it takes it.
        async with board.lock:
            await self._run(board, request)

    async def _audit(self, board: SimBoard, envelope: dict) -> None:
        """The control plane asks this board to recompute an entry it served (``inference.serving.audit``):
        a simulated board computes nothing, so its verdict is "inconclusive", sent as a real board's is."""
        try:
            request = AuditRequest.parse(board.me.open_request(envelope, Kind.AUDIT))
        except (EnvelopeRefused, MessageRefused) as exc:
            self.counts["refused"] += 1
            self._error(f"{board.me.name}: audit refused: {exc}")
            return
        self.counts["audits"] += 1
        verdict = AuditReport(
            device=board.me.name,
            request_id=request.request_id,
            entry=request.entry,
            verdict="inconclusive",
            detail="a simulated board computes nothing",
        )
        await self._send(Task.RECORD_AUDIT, board, verdict, Kind.AUDITED)

    async def _restore(self, board: SimBoard, key: bytes, name: str, tokens: int) -> tuple:
        """What a board restores of a prompt whose shared part (``tokens`` long) has entry ``key``
        (cache-box name ``name``): (ms, tokens matched, entries fetched, bytes fetched, tier). From its
        context (the last prompt) or its RAM tier without the network, else from the cache box when
        its catalog replica has the entry, else nothing."""
        if key in board.held:
            if next(reversed(board.held)) == key:
                return 0.0, tokens, [], 0, Tier.CONTEXT
            return tokens * RAM_RESTORE_MS_PER_TOKEN * self.time_scale, tokens, [], 0, Tier.LOCAL
        if key not in board.catalog:
            return 0.0, 0, [], 0, Tier.NONE
        me, namespace = board.me, board.me.record.cache_namespace
        began = time.perf_counter()
        blob = await self.box.get(name)
        if blob is None:
            self.counts["fetch_misses"] += 1
            return (time.perf_counter() - began) * 1000.0, 0, [], 0, Tier.NONE
        try:
            open_entry(blob, me.keychain().ring(namespace), len(blob) * 2)
        except UnknownProducer:  # a board enrolled after this one last read the table
            me.read_producers()
            open_entry(blob, me.keychain().ring(namespace), len(blob) * 2)
        self.counts["fetches"] += 1
        return (time.perf_counter() - began) * 1000.0, tokens, [name], len(blob), Tier.CACHEBOX

    async def _run(self, board: SimBoard, request: RunRequest) -> None:
        me = board.me
        channel = stream_channel(me.name, request.request_id)
        start = time.monotonic()
        if request.stream:
            await self.box.publish(
                channel,
                me.seal_event(
                    StreamEvent(type="stage", request_id=request.request_id, device=me.name, stage="started")
                ),
            )
        text = request.prompt_text
        tokens = max(1, round(len(text) / CHARS_PER_TOKEN))
        namespace = me.record.cache_namespace
        shared = (
            text[: text.rfind("\n")] if "\n" in text else text
        )  # the system prompt: the range shared by many requests
        shared_tokens = max(1, round(len(shared) / CHARS_PER_TOKEN))
        if request.tokenized is not None:  # the prompt's tokens as the control plane made them, as a board takes them
            tokens = len(request.tokenized.tokens)
            shared_tokens = min(tokens, request.tokenized.cuts[-1] if request.tokenized.cuts else shared_tokens)
        key = prompt_key(namespace, shared)
        name = entry_key_name(namespace, SIM_FINGERPRINT, key)
        fetch_ms, matched, fetched, fetched_bytes, tier = 0.0, 0, [], 0, Tier.NONE
        if request.use_cache:
            fetch_ms, matched, fetched, fetched_bytes, tier = await self._restore(board, key, name, shared_tokens)
        prefill_ms = (tokens - matched) * board.rate_ms * self.time_scale
        if request.use_cache:
            board.hold(key, shared_tokens * self.bytes_per_token)
        decode_ms = max(0, request.max_tokens - 1) * board.rate_ms * DECODE_PER_PREFILL * self.time_scale
        ttft_ms = fetch_ms + prefill_ms
        busy_until = start + (ttft_ms + decode_ms) / 1000.0
        await asyncio.sleep(max(0.0, start + ttft_ms / 1000.0 - time.monotonic()))
        answer = " ok" * request.max_tokens
        if request.stream:
            await self.box.publish(
                channel,
                me.seal_event(
                    StreamEvent(type="token", request_id=request.request_id, device=me.name, index=0, text=" ok")
                ),
            )
        await asyncio.sleep(max(0.0, busy_until - time.monotonic()))
        uploaded, uploaded_bytes = [], 0
        if request.use_cache and not matched:
            state = os.urandom(shared_tokens * self.bytes_per_token)
            header = EntryHeader(
                SIM_FINGERPRINT,
                namespace,
                0,
                shared_tokens,
                hashlib.blake2b(shared.encode(), digest_size=16).hexdigest(),
                0,
                device=me.name,
            )
            blob = encode_entry(header, state, me.keychain().ring(namespace))
            await self.box.set(name, blob, ex=int(self.spec.get("entry_ttl_s", 600)))
            await self.box.xadd(catalog_key_names(namespace)["log"], {"k": key}, maxlen=10_000, approximate=True)
            uploaded.append(
                StoredEntry(
                    name=name, namespace=namespace, model=SIM_FINGERPRINT, start=0, end=shared_tokens, bytes=len(blob)
                )
            )
            uploaded_bytes = len(blob)
            self.counts["uploads"] += 1
        breakdown = Breakdown(
            prefill_ms=round(prefill_ms, 3),
            redis_ms=round(fetch_ms, 3),
            fetch_ms=round(fetch_ms, 3),
            decode_ms=round(decode_ms, 3),
            ttft_ms=round(ttft_ms, 3),
            ttlt_ms=round(ttft_ms + decode_ms, 3),
            prompt_tokens=tokens,
            matched_tokens=matched,
            generated_tokens=request.max_tokens,
            state_bytes=fetched_bytes + uploaded_bytes,
            fetched_bytes=fetched_bytes,
            uploaded_bytes=uploaded_bytes,
            case=Case.FULL if matched >= tokens else (Case.PARTIAL if matched else Case.MISS),
            decision=(Decision.FETCH if tier == Tier.CACHEBOX else Decision.LOCAL)
            if matched
            else Decision.CATALOG_MISS,
            tier=tier,
            compute_profile="simulated",
        )
        self.samples["board_ttft_ms"].append(ttft_ms)
        if request.stream:
            done = StreamEvent(
                type="done",
                request_id=request.request_id,
                device=me.name,
                text=answer,
                finish_reason="length",
                breakdown=breakdown.as_dict(),
            )
            await self.box.publish(channel, me.seal_event(done))
        report = RunReport(
            device=me.name,
            request_id=request.request_id,
            meta=request.meta,
            prompt=text[:2000],
            text=answer,
            breakdown=breakdown,
            fetched=fetched,
            uploaded=uploaded,
        )
        await self._send(Task.RECORD_RUN, board, report, Kind.REPORT)
        self.counts["reports"] += 1

    def _error(self, text: str) -> None:
        self.counts["errors"] += 1
        if len(self.errors) < 50:
            self.errors.append(text[:300])
        log.warning("%s", text)

    enroll_s = 0.0

    def results(self) -> dict:
        return {
            "pid": os.getpid(),
            "boards": len(self.boards),
            "enroll_s": round(self.enroll_s, 3),
            "counts": self.counts,
            "errors": self.errors,
            "samples": self.samples,
        }


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s sim %(levelname)s %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    fleet = Fleet(spec)
    fleet.enroll_s = fleet.enroll_all()
    Path(spec["ready_file"]).write_text(json.dumps({"enroll_s": fleet.enroll_s}))
    asyncio.run(fleet.run())
    sys.stdout.flush()
    os._exit(0)  # the results are written; connections closing slowly keep nothing


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
