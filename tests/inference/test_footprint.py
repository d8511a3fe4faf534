"""A board's memory: its budget (pure), what /proc says, a board sized to 512 MB, its refusals,
and the heartbeat and device page that show it. The figures themselves come from
`python manage.py bench footprint`, never from a timed test."""

from __future__ import annotations

import json

import pytest

from dashboard.bench.footprint import Step, run_label, summarize_ttft, workload
from inference.engine.memory_plan import (
    MAX_RAM_TIER_BYTES,
    MIN_N_CTX,
    MemoryRefused,
    ModelFacts,
    budget_mb,
    check_lab_strategy,
    plan_memory,
)
from inference.engine.proc_memory import ProcessMemory, mapped_files, rss_bytes, tune_malloc
from tests.conftest import run_manage

GEMMA = ModelFacts(file_bytes=253_113_024, n_params=268_098_176, n_vocab=262_144, kv_bytes_per_token=18_432)
GRID = 128


# -- the plan (pure) ---------------------------------------------------------------------------
def test_a_512_mb_board_gets_the_smallest_context_no_ram_tier_and_grid_sized_batches():
    plan = plan_memory(512, GEMMA, n_ctx=4096, grid=GRID)
    assert plan.n_ctx == MIN_N_CTX == 1024
    assert GRID % plan.n_ubatch == 0 and plan.n_ubatch == 128  # grid batches are whole ubatches: the cold run's bits
    assert plan.ram_tier_bytes == 0  # on a small board the cache box is its memory
    assert not plan.repack
    assert plan.budget_mb == budget_mb(512) == pytest.approx(400, abs=1)
    assert plan.estimate_mb == pytest.approx(sum(plan.parts_mb.values()), abs=0.2)


def test_a_large_board_keeps_the_context_asked_for_and_the_full_ram_tier():
    plan = plan_memory(4096, GEMMA, n_ctx=4096, grid=GRID)
    assert (plan.n_ctx, plan.ram_tier_bytes, plan.repack) == (
        4096,
        MAX_RAM_TIER_BYTES,
        False,
    )  # repacked weights change the bits: only when asked
    assert plan_memory(4096, GEMMA, n_ctx=4096, grid=GRID, repack=True).repack  # asked for, and there is room
    assert plan.within_budget
    middling = plan_memory(768, GEMMA, n_ctx=4096, grid=GRID)
    assert (
        0 < middling.ram_tier_bytes < MAX_RAM_TIER_BYTES and middling.within_budget
    )  # the RAM tier is what the budget leaves


def test_an_explicit_ram_tier_and_a_smaller_context_asked_for_are_kept():
    plan = plan_memory(4096, GEMMA, n_ctx=2048, grid=GRID, ram_tier_bytes=0)
    assert plan.n_ctx == 2048 and plan.ram_tier_bytes == 0


def test_ubatch_divides_every_grid():
    for grid, expected in ((128, 128), (64, 64), (1024, 512), (96, 96), (768, 384)):
        assert plan_memory(4096, GEMMA, n_ctx=4096, grid=grid).n_ubatch == expected


def test_a_board_too_small_for_its_model_is_refused_with_the_numbers():
    with pytest.raises(MemoryRefused) as refused:
        plan_memory(256, GEMMA, n_ctx=4096, grid=GRID)
    message = str(refused.value)
    assert (
        "256 MB" in message
        and "model file (mapped) 241 MB" in message
        and "register the board with at least" in message
    )


def test_a_lab_strategy_that_would_not_fit_is_refused_with_the_numbers():
    with pytest.raises(MemoryRefused) as refused:
        check_lab_strategy("early-exit", GEMMA, n_ctx=1024, memory_mb=512, rss_mb=410.0)
    message = str(refused.value)
    assert "early-exit" in message and "PyTorch" in message and "410 MB" in message and "512 MB" in message
    check_lab_strategy("early-exit", GEMMA, n_ctx=4096, memory_mb=8192, rss_mb=600.0)  # room for it
    check_lab_strategy("early-exit", GEMMA, n_ctx=4096, memory_mb=0, rss_mb=600.0)  # memory not registered: not checked
    with pytest.raises(MemoryRefused):
        check_lab_strategy("kv-prediction:6", GEMMA, n_ctx=1024, memory_mb=512, rss_mb=410.0)
    check_lab_strategy("anchors", GEMMA, n_ctx=1024, memory_mb=512, rss_mb=410.0)  # the board's own model: nothing more


# -- /proc (real) ------------------------------------------------------------------------------
def test_process_memory_sees_memory_this_process_touches():
    before = ProcessMemory.read()
    assert before.rss_mb > 0 and before.peak_rss_mb >= before.rss_mb and before.pss_mb > 0
    block = bytearray(64 * 1024 * 1024)
    block[::4096] = b"x" * len(block[::4096])  # touch every page
    after = ProcessMemory.read()
    assert after.anon_mb - before.anon_mb > 50 and after.peak_rss_mb >= after.rss_mb
    del block
    assert any("python" in path or "libc" in path for path in mapped_files())
    assert tune_malloc() is True  # glibc here
    assert abs(rss_bytes() / 2**20 - ProcessMemory.read().rss_mb) < 16  # the cheap reading agrees


# -- the bench's runs (pure) ---------------------------------------------------------------------
def test_the_ram_tier_gives_way_to_the_processs_rss_under_a_registered_budget():
    from cachebox.entry import EntryHeader
    from inference.tiers.local import RamEntries

    header = EntryHeader.__new__(EntryHeader)  # the tier never reads it
    rss = {"now": 500}  # what the process holds besides the entries' bytes, which count as they are kept
    tier = RamEntries(budget_bytes=1000, rss_limit_bytes=750, rss=lambda: rss["now"] + tier.size_bytes)
    for number in range(3):
        rss["now"] += 100  # the new blob is resident before the tier keeps it
        tier.put(f"e{number}", header, b"x" * 100, 0)
        rss["now"] -= 100  # kept: counted in the tier's bytes from now on
    assert (
        len(tier) == 2 and tier.get("e0") is None and tier.get("e2") is not None
    )  # the oldest left: 500 + 2 x 100 + 100 > 750
    assert tier.status()["evicted_for_rss"] == 1
    rss["now"] = 900  # the process grew beyond its budget by itself: the tier keeps nothing new
    tier.put("big", header, b"x" * 100, 0)
    assert len(tier) == 0 and tier.status()["refused"] == 1
    unbounded = RamEntries(budget_bytes=250)  # no registered memory: the byte budget alone
    for number in range(3):
        unbounded.put(f"e{number}", header, b"x" * 100, 0)
    assert len(unbounded) == 2


def test_the_footprint_workload_mixes_every_kind_of_run():
    steps = workload(50)
    assert len(steps) == 50
    kinds = [step.kind for step in steps]
    assert kinds.count("chat") == 4 and kinds.count("schema") == 2
    assert kinds.count("cold") >= 10
    prompts = [step.prompt for step in steps if step.kind == "prompt"]
    assert len(prompts) > len(set(prompts))  # repeats: full hits
    assert [step.turn for step in steps if step.kind == "chat"] == [0, 1, 2, 3]


def test_ttft_is_compared_only_between_runs_served_the_same_way():
    sized = [{"kind": "cold", "ttft_ms": 100.0}, {"kind": "prompt", "case": "full", "tier": "cachebox", "ttft_ms": 6.0}]
    unsized = [{"kind": "cold", "ttft_ms": 80.0}, {"kind": "prompt", "case": "full", "tier": "local", "ttft_ms": 3.0}]
    rows = summarize_ttft(sized, unsized)
    assert rows["cold"]["ratio"] == 1.25
    assert rows["prompt:full:cachebox"]["ratio"] is None and rows["prompt:full:local"]["sized_ms"] is None
    assert run_label({"kind": "chat", "case": "partial", "tier": "context"}) == "chat:partial:context"
    assert Step("cold", 1).prompt == 1


# -- a real board sized to 512 MB --------------------------------------------------------------
@pytest.fixture(scope="module")
def small_board(tmp_path_factory, request, engine):
    """A board started as an edge process starts it, registered with 512 MB, on the session
    engine's threads (a prompt's state is the same bits on any number of threads, but a decode
    step is not: its answer is compared with the session engine's)."""
    from cachebox.signing import Keychain, derive_keyring, shared_producer_ring
    from inference.board.config import BoardConfig
    from inference.board.runtime import Board

    url = request.getfixturevalue("valkey_url")
    ring = shared_producer_ring(derive_keyring(b"k" * 32, "footprint", 1))
    board = Board.start(
        BoardConfig(
            device="small",
            namespace="footprint",
            redis_url=url,
            threads=engine.config.threads(),
            memory_mb=512,
            n_ctx=4096,
        ),
        keys=Keychain(lambda ns: ring),
        background_sync=False,
    )
    yield board
    board.store.flush("footprint")
    board.close()


@pytest.mark.model
@pytest.mark.cachebox
def test_a_board_registered_with_512_mb_sizes_its_engine_and_answers_as_an_unsized_one(small_board, engine):
    from dashboard.mmlu import build_prompts

    board = small_board
    assert board.engine.n_ctx == 1024 and board.engine.config.n_ubatch == 128 and not board.engine.config.repack
    assert board.prefix.ram is None  # no RAM tier: the cache box serves its repeats
    prompt = build_prompts("astronomy", 5, 1)[0].segments
    first = board.run(prompt, max_tokens=4, namespace="footprint")
    again = board.run(prompt, max_tokens=4, namespace="footprint")
    engine.clear()
    from inference.serving.prefix import PrefixServing

    unsized = PrefixServing(engine, None).run(
        prompt, max_tokens=4, use_cache=False
    )  # n_ctx 2048, n_ubatch 512: the session's engine
    assert first.tokens == again.tokens == unsized.tokens
    memory = board.status()["memory"]
    assert memory["memory_mb"] == 512 and memory["budget_mb"] == pytest.approx(400, abs=1)
    assert memory["rss_mb"] > 200 and memory["peak_rss_mb"] >= memory["rss_mb"]


@pytest.mark.model
@pytest.mark.cachebox
def test_a_small_board_restores_what_a_board_with_a_larger_context_stored_and_answers_as_cold(small_board, engine):
    """Contexts of 1024 and 2048 tokens give the same state bits: one fingerprint, shared entries."""
    from dashboard.mmlu import build_prompts
    from inference.board.config import BoardConfig
    from inference.board.runtime import Board

    assert small_board.engine.fingerprint == engine.fingerprint and small_board.engine.n_ctx != engine.n_ctx
    prompt = build_prompts("astronomy", 5, 3)[2].segments
    large = Board(
        engine,
        small_board.store,
        BoardConfig(device="large", namespace="footprint", context_reuse=False, ram_tier_bytes=0),
        background_sync=False,
        keys=small_board.keys,
    )
    stored = large.run(prompt, max_tokens=4, namespace="footprint")
    assert stored.uploaded
    small_board.catalogs.sync_all()
    small_board.engine.clear()
    hit = small_board.run(prompt, max_tokens=4, namespace="footprint")
    assert hit.breakdown.case == "full" and hit.breakdown.tier == "cachebox"
    assert hit.tokens == stored.tokens


@pytest.mark.model
@pytest.mark.cachebox
def test_a_strategy_the_memory_cannot_hold_is_a_clear_error_in_the_runs_report(small_board):
    import uuid

    from inference import board as edge
    from inference.contract.messages import RunRequest

    request = RunRequest.parse(
        {
            "request_id": str(uuid.uuid4()),
            "segments": ["Q: 2+2?\nA:"],
            "max_tokens": 2,
            "strategy": "early-exit:top-prob:0.9",
        }
    )
    report = edge.serve(small_board, request)
    assert "cannot run early-exit" in report.error and "PyTorch" in report.error and "512 MB" in report.error
    assert not any(spec.name == "early-exit" for spec in small_board._opened)  # refused before loading ~1 GB


@pytest.mark.model
def test_a_board_whose_memory_cannot_hold_the_model_refuses_before_making_its_context():
    from inference.board.config import BoardConfig
    from inference.board.runtime import Board

    with pytest.raises(MemoryRefused, match="registered with 256 MB"):
        Board.start(
            BoardConfig(device="tiny", redis_url="redis://127.0.0.1:9/0", memory_mb=256, connect_timeout=0.1),
            keys=None,
            background_sync=False,
        )


# -- the control plane shows it ---------------------------------------------------------------------
@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_device_page_shows_the_boards_rss_against_its_registered_memory(
    settings, valkey_url, client, django_user_model
):
    from dashboard import actions
    from inference.board import devices as registry

    settings.REDIS_URL = valkey_url
    device, token = actions.register_device(None, name="zero", kind="Pi Zero 2W", cpu_threads=1, memory_mb=512)
    assert registry.lookup(actions.cachebox(), "zero").memory_mb == 512  # boards receive it in their record
    from tests.dashboard.test_dashboard import enrolled, heartbeat

    keys = enrolled(device, token)
    memory = {
        "rss_mb": 412.3,
        "peak_rss_mb": 419.0,
        "pss_mb": 300.0,
        "memory_mb": 512,
        "budget_mb": 399.4,
        "n_ctx": 1024,
    }
    assert actions.record_heartbeat(heartbeat(keys, {"catalogs": {}, "memory": memory})) is not None
    device.refresh_from_db()
    assert actions.device_json(device)["memory"] == "412 MB RSS (peak 419 MB) of 512 MB; budget 399 MB, peak over it"
    client.force_login(django_user_model.objects.create_user("alice", password="pw-alice-123", is_staff=True))
    page = client.get("/devices/zero/").content.decode()
    assert "412 MB RSS (peak 419 MB) of 512 MB" in page


# -- the bench ----------------------------------------------------------------------------------------
@pytest.mark.model
@pytest.mark.cachebox
def test_bench_footprint_measures_a_board_process_and_saves_its_parts(tmp_path, valkey_url):
    out = tmp_path / "footprint.json"
    done = run_manage(
        "bench",
        "footprint",
        "--memory-mb",
        "512",
        "--runs",
        "4",
        "--no-compare",
        "--json",
        str(out),
        env={"REDIS_URL": valkey_url},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()
    doc = json.loads(out.read_text())
    assert (doc["bench"], doc["format"], doc["memory_mb"], doc["runs"]) == ("footprint", 1, 512, 4)
    assert 250 < doc["peak_rss_mb"] < 512 and 0 < doc["pss_mb"] <= doc["peak_rss_mb"] + 1
    parts = {row["part"]: row["mb"] for row in doc["parts"]}
    assert parts["model weights (mapped GGUF file)"] > 200 and parts[
        "KV cache (n_ctx x state bytes per token)"
    ] == pytest.approx(18, abs=1)
    sized = doc["boards"]["sized"]
    assert sized["n_ctx"] == 1024 and sized["ram_tier_bytes"] == 0
    assert not set(sized["heavy_modules"]) & {
        "torch",
        "plotly",
        "channels",
        "uvicorn",
        "psycopg",
    }  # (kombu peeks at django.utils where Django is installed)
    assert doc["agreement_with_cold"] in (None, 1.0)
    assert out.with_suffix(".html").exists() and b"peak RSS" in done.stdout
