"""`bench vs-server`: the pure parts (workloads, the peer's balancers, the summary maths, the
targets, the report and the README table) in milliseconds, and one smoke run of both systems
through their OpenAI APIs on two prompts (skipped, saying why, only where llama-server cannot be
built). The figures themselves come from `python manage.py bench vs-server`, never from a test."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dashboard.bench import llama_server, vs_server
from dashboard.bench import side_by_side as sbs
from inference.engine.memory_plan import budget_mb
from tests.conftest import ROOT


# -- workloads ----------------------------------------------------------------------------------
def test_interleave_takes_one_of_each_group_in_turn_and_keeps_the_longer_tails():
    assert sbs.interleave([[1, 2, 3], ["a"], [10, 20]]) == [1, "a", 10, 2, 20, 3]


def test_the_many_prompts_workload_interleaves_topics_and_only_each_topics_first_prompt_is_cold():
    requests = sbs.many_prompts({"t1": ["a1", "a2", "a3"], "t2": ["b1", "b2", "b3"]})
    assert [r.prompt for r in requests] == ["a1", "b1", "a2", "b2", "a3", "b3"]
    assert [r.warm for r in requests] == [False, False, True, True, True, True]
    assert [r.index for r in requests] == list(range(6)) and {r.kind for r in requests} == {"completion"}


def test_the_warm_workload_repeats_the_prompt_then_asks_each_question_under_the_same_system_prompt():
    requests = sbs.one_board_warm("PROMPT", repeats=3, questions=sbs.QUESTIONS[:4])
    assert [r.prompt for r in requests[:3]] == ["PROMPT"] * 3 and [r.warm for r in requests[:3]] == [False, True, True]
    asked = requests[3:]
    assert [r.messages[-1][1] for r in asked] == list(sbs.QUESTIONS[:4])
    assert {r.messages[0] for r in asked} == {("system", sbs.SYSTEM_PROMPT)}
    assert [r.warm for r in asked] == [False, True, True, True] and {r.kind for r in asked} == {"chat"}


def test_the_warm_workloads_questions_each_stand_alone_while_a_chats_turns_carry_over():
    history: dict[int, list] = {}
    questions = [r for r in sbs.one_board_warm("Q: 1+1? A:", 1, sbs.QUESTIONS[:3]) if r.kind == "chat"]
    for request in questions:
        assert sbs.chat_messages(request, history.get(request.conversation, [])) == [
            {"role": "system", "content": sbs.SYSTEM_PROMPT},
            {"role": "user", "content": request.messages[-1][1]},
        ]
        sbs.remember(history, request, "an answer")
    assert history == {}  # the same system prompt, never the earlier questions and answers
    turn = sbs.chat([["first?", "second?"]])[0]
    sbs.remember(history, turn, "yes")
    assert history == {0: [("first?", "yes")]}


def test_a_chat_turn_carries_its_conversations_earlier_questions_and_answers():
    requests = sbs.chat()
    assert [r.conversation for r in requests[:6]] == [0, 1, 2, 0, 1, 2]
    second = requests[3]
    messages = sbs.chat_messages(second, [(sbs.CHATS[0][0], "Water, a coat and a map.")])
    assert messages == [
        {"role": "system", "content": sbs.CHAT_SYSTEM},
        {"role": "user", "content": sbs.CHATS[0][0]},
        {"role": "assistant", "content": "Water, a coat and a map."},
        {"role": "user", "content": sbs.CHATS[0][1]},
    ]
    assert second.warm and not requests[0].warm


# -- balancers ----------------------------------------------------------------------------------
def test_round_robin_visits_every_server_in_turn():
    balancer = sbs.RoundRobin(3)
    assert [balancer.pick("anything") for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_prefix_hash_sends_prompts_sharing_their_first_tokens_to_one_server_and_spreads_others():
    tokenize = lambda text: [ord(c) for c in text]  # noqa: E731 (one token per character)
    balancer = sbs.PrefixHash(4, tokenize, prefix_tokens=8)
    assert balancer.pick("SHAREDxx question one") == balancer.pick("SHAREDxx another question")
    chosen = {balancer.pick(f"{n:03d} topic and the rest") for n in range(40)}
    assert len(chosen) == 4  # different prefixes land on every server
    assert all(0 <= balancer.pick(f"p{n}") < 4 for n in range(20))


def test_a_balancer_needs_a_server():
    with pytest.raises(ValueError):
        sbs.RoundRobin(0)


# -- summary maths ------------------------------------------------------------------------------
def _sample(ttft, warm=True, text="A", cold="A", error="", **more):
    return {
        "ttft_ms": ttft,
        "total_ms": ttft + 100,
        "warm": warm,
        "text": text,
        "cold_text": cold,
        "tokens": 4,
        "http_bytes": 1000,
        "error": error,
        **more,
    }


def test_summary_reports_percentiles_throughput_bytes_rss_and_agreement_and_leaves_errors_out():
    samples = [
        _sample(100, warm=False),
        _sample(10),
        _sample(20, text="B"),
        _sample(30),
        _sample(999, error="HTTP 500"),
    ]
    s = sbs.summarize(samples, elapsed_s=2.0, peak_rss_mb={"b0": 400.0, "b1": 420.5})
    assert s["requests"] == 5 and s["errors"] == 1 and s["error_examples"] == ["HTTP 500"]
    assert s["ttft_ms"]["p50"] == 25.0  # of 10, 20, 30, 100 (linear between ranks)
    assert s["warm_ttft_ms"]["p50"] == 20.0 and s["cold_ttft_ms"]["p50"] == 100.0
    assert s["tokens"] == 16 and s["tokens_per_s"] == 8.0 and s["requests_per_s"] == 2.0
    assert s["http_bytes"] == 4000
    assert s["peak_rss_mb_max"] == 420.5
    assert s["agreement"] == 0.75  # one of four answers differs from its cold answer


def test_agreement_ignores_requests_without_a_cold_answer_and_is_none_without_any():
    assert sbs.agreement([_sample(1, cold=None), _sample(1)]) == 1.0
    assert sbs.agreement([_sample(1, cold=None)]) is None


def test_the_api_overhead_is_the_first_chunk_minus_the_boards_own_ttft():
    samples = [
        _sample(60, board_ttft_ms=10, api_ms=5, queue_ms=20),
        _sample(80, board_ttft_ms=20, api_ms=7, queue_ms=30),
    ]
    overhead = sbs.summarize(samples, elapsed_s=1)["api_overhead_ms"]
    assert overhead["first_chunk_minus_board_ttft_ms_p50"] == 55.0
    assert overhead["api_ms_p50"] == 6.0 and overhead["queue_ms_p50"] == 25.0
    assert sbs.summarize([_sample(60)], elapsed_s=1)["api_overhead_ms"] is None


def test_each_systems_own_warm_prefill_is_summarized_and_bounds_the_warm_ratio():
    ours = sbs.summarize(
        [
            _sample(90, warm=False, prefill_ms=800.0),
            _sample(60, prefill_ms=40.0),
            _sample(70, prefill_ms=50.0),
            _sample(20, prefill_ms=None),
        ],
        elapsed_s=1,
    )
    assert (
        ours["warm_prefill_ms"]["p50"] == 45.0
    )  # warm requests that prefilled; the cold one and a full hit without a figure left out
    theirs = sbs.summarize([_sample(80, prefill_ms=60.0), _sample(70, prefill_ms=55.0)], elapsed_s=1)
    floor = sbs.warm_floor({"one-board-warm": {"systems": {sbs.EDGECACHE: ours, sbs.PEER: theirs}}})
    assert floor == {
        "edgecache_prefill_p50_ms": 45.0,
        "peer_prefill_p50_ms": 57.5,
        "peer_warm_ttft_p50_ms": 75.0,
        "ratio": 0.6,
    }
    assert "45.0 ms (p50), 0.6 of llama-server's whole warm TTFT (75.0 ms" in sbs.floor_text(floor)
    # results saved before the figure existed, or a run without the warm workload: no floor, no text
    assert sbs.warm_floor({"one-board-warm": {"systems": {sbs.EDGECACHE: _system(50), sbs.PEER: _system(60)}}}) is None
    assert sbs.warm_floor({}) is None and sbs.floor_text(None) == ""


def _system(p50, warm=None, rss=400.0, agree=1.0):
    p50, warm = float(p50), float(warm) if warm is not None else None
    return {
        "ttft_ms": {"p50": p50, "p99": p50 * 2},
        "warm_ttft_ms": {"p50": warm if warm is not None else p50, "p99": None},
        "peak_rss_mb_max": rss,
        "agreement": agree,
        "total_s": 1.0,
        "tokens_per_s": 10.0,
        "http_bytes": 2048,
        "cache_bytes": 0,
    }


def test_targets_compare_warm_ttft_the_best_peer_balancer_agreement_and_memory():
    workloads = {
        "one-board-warm": {
            "systems": {sbs.EDGECACHE: _system(50, warm=30, rss=500), sbs.PEER: _system(110, warm=100, rss=420)}
        },
        "fleet-wifi4": {
            "systems": {sbs.EDGECACHE: _system(200), sbs.ROUND_ROBIN: _system(900), sbs.PREFIX_HASH: _system(500)}
        },
    }
    found = {t["name"].split(":")[0]: t for t in sbs.targets(workloads)}
    assert found["one board, warm"]["value"] == 0.3 and found["one board, warm"]["met"] is True
    assert (
        found["fleet on Wi-Fi 4"]["value"] == 0.4 and found["fleet on Wi-Fi 4"]["met"] is True
    )  # against prefix-hash, the better one
    assert found["one-board-warm"]["value"] == 1.0 and found["one-board-warm"]["met"] is True
    memory = found["peak RSS per board / llama-server's (largest of every workload)"]
    assert memory["value"] == round(500 / 420, 3) and memory["met"] is False


def test_with_the_same_memory_the_target_is_each_boards_peak_against_what_both_may_hold():
    workloads = {"chat": {"systems": {sbs.EDGECACHE: _system(10, rss=590), sbs.PEER: _system(20, rss=430)}}}
    found = {t["name"]: t for t in sbs.targets(workloads, shared_mb=600.0)}
    shared = found["peak RSS per board / the memory both may hold (llama-server's idle RSS + --cache-ram)"]
    assert shared["value"] == round(590 / 600, 3) and shared["met"] is True
    assert found["peak RSS per board / llama-server's (largest of every workload)"]["met"] is False  # still reported
    assert not any(
        "may hold" in t["name"] for t in sbs.targets(workloads)
    )  # boards registered by hand: no shared figure


def test_a_board_is_registered_so_that_its_budget_is_llama_servers_idle_rss_plus_its_cache():
    memory = vs_server.SharedMemory.equal_to_peer(361.24, 256)
    assert memory.shared_mb == 617.2 and memory.board_ram_tier_mb is None  # the board's planner sizes its tier
    assert memory.shared_mb <= budget_mb(memory.board_registered_mb) < memory.shared_mb + 1
    by_hand = vs_server.SharedMemory.registered(2048, 256)
    assert by_hand.shared_mb is None and by_hand.board_ram_tier_mb == 256
    assert "by hand" in by_hand.as_dict()["rule"]


def test_where_boards_cannot_be_hosts_the_fleet_is_paced_in_process_and_the_bench_says_why(monkeypatch):
    from dashboard.hosts import network as hosts

    monkeypatch.setattr(hosts, "unavailable_reason", lambda: "boards as hosts need root")
    said = []
    assert vs_server.FleetHosts.create("wifi4", 765, said.append) is None
    assert "boards as hosts need root" in said[0] and "paced in EdgeCache's sockets" in said[0]
    assert vs_server.link_shaping(None).startswith("in-process")


def test_a_boards_ready_line_gives_its_ram_tier_and_estimate():
    line = "board b0 ready (m.gguf, 2 threads, loopback to the cache box, namespace n, 792 MB registered: context 4096, RAM tier 128 MB, about 603 MB, signing keys"
    assert vs_server.board_plan("earlier lines\n" + line) == {"ram_tier_mb": 128, "estimate_mb": 603}
    assert vs_server.board_plan("board b0 ready (memory not registered: default buffers, ") is None


def test_a_workload_not_run_has_no_target():
    names = [t["name"] for t in sbs.targets({"chat": {"systems": {sbs.EDGECACHE: _system(10), sbs.PEER: _system(20)}}})]
    assert not any("warm" in n or "Wi-Fi" in n for n in names)


# -- what people read ---------------------------------------------------------------------------
def _document():
    workloads = {
        "one-board-warm": {
            "description": "warm",
            "systems": {sbs.EDGECACHE: _system(50, warm=30), sbs.PEER: _system(110, warm=100)},
        },
        "chat": {"description": "chat", "systems": {sbs.EDGECACHE: _system(40), sbs.PEER: _system(45, agree=0.9)}},
    }
    return {
        "bench": "vs-server",
        "format": 1,
        "machine": {"date": "2026-11-24T20:00:00Z", "cpu_count": 2, "cpu": "Test CPU"},
        "peer": {"version": "version: 1 (abc)", "flags": "-c 4096"},
        "settings": {"model": "gemma.gguf", "n_ctx": 4096},
        "workloads": workloads,
        "targets": sbs.targets(workloads),
        "summary": "two workloads",
    }


def test_the_readme_table_has_one_row_per_workload_and_system_and_replaces_only_its_markers():
    table = sbs.readme_table([_document()])
    rows = [line for line in table.splitlines() if line.startswith("| one-board-warm") or line.startswith("| chat")]
    assert len(rows) == 4
    assert "| one-board-warm | EdgeCache | 50.0 | 100.0 | 30.0 |" in table
    readme = f"intro\n{sbs.README_BEGIN}\nold figures\n{sbs.README_END}\noutro\n"
    replaced = sbs.replace_readme_table(readme, table)
    assert replaced.startswith("intro\n") and replaced.endswith("\noutro\n") and "old figures" not in replaced
    assert sbs.replace_readme_table(replaced, table) == replaced  # regenerating changes nothing
    with pytest.raises(ValueError, match="markers"):
        sbs.replace_readme_table("no markers", table)
    assert "bench vs-server` makes one" in sbs.readme_table([])


def test_the_readme_keeps_each_workloads_newest_figures_when_a_run_measured_some_workloads_only():
    older = _document()
    newer = {
        **_document(),
        "machine": {"date": "2026-11-25T08:00:00Z"},
        "workloads": {"chat": {"systems": {sbs.EDGECACHE: _system(33), sbs.PEER: _system(44)}}},
    }
    workloads = sbs.newest_workloads([newer, older])
    assert list(workloads) == ["one-board-warm", "chat"]
    assert (
        workloads["chat"]["systems"][sbs.EDGECACHE]["ttft_ms"]["p50"] == 33.0
        and workloads["chat"]["date"] == "2026-11-25"
    )
    assert workloads["one-board-warm"]["date"] == "2026-11-24"
    assert "| chat | EdgeCache | 33.0 |" in sbs.readme_table([newer, older])


def test_the_report_draws_one_chart_per_workload_with_both_systems(tmp_path):
    path = sbs.report(tmp_path / "vs.html", _document())
    page = path.read_text()
    assert page.count('class="chart"') == 2
    assert "one-board-warm" in page and "llama-server" in page and "version: 1 (abc)" in page
    assert sbs.headline(_document()).startswith("one board, warm 0.3x (met")
    assert any("one-board-warm" in line and "EdgeCache" in line for line in sbs.lines(_document()))


@pytest.mark.django_db
def test_an_api_request_asks_for_a_cold_run_with_edgecache_cache_false():
    from types import SimpleNamespace

    from dashboard.api.errors import ApiError
    from dashboard.api.requests import parse_request
    from dashboard.api.views import _run_request

    key = SimpleNamespace(name="tester", key_prefix="ec-test", namespace_id="")
    chat = {"model": "gemma", "messages": [{"role": "user", "content": "Hi"}]}
    assert _run_request(key, parse_request(chat, "chat"), "").use_cache is True
    assert _run_request(key, parse_request({**chat, "edgecache": {"cache": True}}, "chat"), "").use_cache is True
    assert _run_request(key, parse_request({**chat, "edgecache": {"cache": False}}, "chat"), "").use_cache is False
    with pytest.raises(ApiError) as refused:
        parse_request({**chat, "edgecache": {"cache": "no"}}, "chat")
    assert refused.value.param == "edgecache.cache"


def test_the_bench_is_registered_under_its_name():
    from dashboard.bench import get

    assert get("vs-server").name == "vs-server"


def test_the_peer_is_unavailable_with_what_to_install_where_build_tools_are_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("EDGECACHE_PEERS_DIR", str(tmp_path))
    monkeypatch.setattr(llama_server.shutil, "which", lambda tool: None)
    with pytest.raises(llama_server.PeerUnavailable, match="cmake.*C\\+\\+ compiler.*apt-get install"):
        llama_server.ensure(lambda line: None)
    assert llama_server.binary_path("9.9.9") == tmp_path / "llama-server-9.9.9-wheel" / "llama-server"


def test_the_peer_keeps_the_wheels_libraries_by_the_names_its_binary_asks_for(tmp_path):
    """The wheel holds each library three times (libllama.so, .so.0, .so.0.5.0); the binary asks
    for the .so.0 names, and only those are copied beside it."""
    for name in (
        "libllama.so",
        "libllama.so.0",
        "libllama.so.0.5.0",
        "libggml-base.so",
        "libggml-base.so.0",
        "libggml-base.so.0.25.3",
        "notes.txt",
    ):
        (tmp_path / name).write_text(name)
    assert [path.name for path in llama_server.wheel_libraries(tmp_path)] == ["libggml-base.so.0", "libllama.so.0"]
    # The wheel this machine installed has every library the peer links.
    installed = {path.name for path in llama_server.wheel_libraries()}
    assert {"libllama.so.0", "libggml.so.0", "libggml-base.so.0", "libggml-cpu.so.0", "libmtmd.so.0"} <= installed


def test_a_second_caller_waits_for_the_build_under_way_and_does_not_build_again(monkeypatch, tmp_path):
    """The test run builds the peer in the background; the test that needs it waits for that build
    (its lock) and takes its binary, instead of starting a second build beside it."""
    import fcntl
    import threading

    monkeypatch.setenv("EDGECACHE_PEERS_DIR", str(tmp_path))
    monkeypatch.setattr(llama_server, "missing_tools", lambda: [])
    monkeypatch.setattr(llama_server, "_build_peer", lambda *args: pytest.fail("built a second time"))
    binary = llama_server.binary_path()
    binary.parent.parent.mkdir(parents=True, exist_ok=True)
    waiting, found = threading.Event(), []
    with open(binary.parent.with_name(binary.parent.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # "another process" is building
        caller = threading.Thread(
            target=lambda: found.append(
                llama_server.ensure(lambda line: waiting.set() if line.startswith("Waiting") else None)
            )
        )
        caller.start()
        assert waiting.wait(30), "the caller did not wait for the build under way"
        binary.parent.mkdir()
        binary.write_text("built")  # the other build finishes...
    # ... and its lock goes with it
    caller.join(30)
    assert found == [binary]


# -- the smoke run: both systems, two prompts ---------------------------------------------------
@pytest.mark.processes
@pytest.mark.model
@pytest.mark.cachebox
@pytest.mark.peer
@pytest.mark.timeout(1800)  # the first run on a machine builds the peer (~5 minutes on 2 cores, more under load)
def test_both_systems_answer_the_same_two_prompts_through_their_apis(tmp_path):
    missing = llama_server.missing_tools()
    if missing and not llama_server.binary_path().exists():
        pytest.skip(f"llama-server cannot be built here: no {', '.join(missing)}")
    out = tmp_path / "vs.json"
    done = subprocess.run(
        [
            sys.executable,
            "manage.py",
            "bench",
            "vs-server",
            "--workloads",
            "one-board-warm",
            "--repeats",
            "2",
            "--questions",
            "0",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,  # the first run on a machine builds the peer (~5 minutes on 2 cores)
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["bench"] == "vs-server" and doc["peer"]["version"]
    systems = doc["workloads"]["one-board-warm"]["systems"]
    for name in (sbs.EDGECACHE, sbs.PEER):
        figures = systems[name]
        assert figures["requests"] == 2 and figures["errors"] == 0, figures
        assert figures["ttft_ms"]["p50"] > 0 and figures["peak_rss_mb_max"] > 100
        assert figures["agreement"] is not None
    assert systems[sbs.EDGECACHE]["agreement"] == 1.0  # a cached answer is the cold answer
    assert systems[sbs.EDGECACHE]["cached_tokens"] > 0  # the repeat was served from its cache
    # each system's own prefill, as it reported it: the cold request prefilled; EdgeCache's repeat
    # (a full hit: the stored logits) none at all, llama-server's its last token again
    samples = doc["workloads"]["one-board-warm"]["samples"]
    for name in (sbs.EDGECACHE, sbs.PEER):
        cold, warm = samples[name]
        assert not cold["warm"] and cold["prefill_ms"] > 0 and warm["warm"], samples[name]
    assert samples[sbs.EDGECACHE][1]["prefill_ms"] == 0 and samples[sbs.PEER][1]["prefill_ms"] > 0
    assert systems[sbs.EDGECACHE]["warm_prefill_ms"]["p50"] == 0
    memory = doc["memory"]  # both given the same memory: the board planned within llama-server's idle RSS + --cache-ram
    assert memory["shared_mb"] == round(memory["peer_idle_rss_mb"] + memory["peer_cache_ram_mb"], 1)
    plan = doc["workloads"]["one-board-warm"]["board_plan"]
    assert plan["ram_tier_mb"] > 0 and plan["estimate_mb"] <= round(
        budget_mb(memory["board_registered_mb"])
    )  # its ready line rounds to the MB
    assert out.with_suffix(".html").exists()


def test_the_balancer_streams_each_request_from_the_server_its_policy_picks():
    import http.client
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from dashboard.bench.vs_server import Balancer

    def upstream(number):
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for piece in (f"data: server {number}\n\n", f"data: {body['prompt']}\n\n"):
                    data = piece.encode()
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.write(b"0\r\n\r\n")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    servers = [upstream(0), upstream(1)]
    try:
        with Balancer([f"http://127.0.0.1:{s.server_address[1]}" for s in servers], sbs.RoundRobin(2)) as balancer:
            answers = []
            for prompt in ("first", "second", "third"):
                connection = http.client.HTTPConnection(*balancer.url.removeprefix("http://").split(":"))
                connection.request(
                    "POST",
                    "/v1/completions",
                    body=json.dumps({"prompt": prompt}),
                    headers={"Content-Type": "application/json"},
                )
                response = connection.getresponse()
                answers.append((response.status, response.getheader("X-Upstream"), response.read().decode()))
                connection.close()
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()
    assert answers == [
        (200, "0", "data: server 0\n\ndata: first\n\n"),
        (200, "1", "data: server 1\n\ndata: second\n\n"),
        (200, "0", "data: server 0\n\ndata: third\n\n"),
    ]


def test_every_fleet_workload_names_a_link_the_boards_know():
    """fleet-loopback asked LINK_PRESETS for 'loopback', which it has not: the whole bench stopped."""
    from cachebox.link import LINK_PRESETS
    from dashboard.bench import vs_server

    fleets = [name for name in vs_server.WORKLOADS if name.startswith("fleet-")]
    assert sorted(vs_server.FLEET_LINKS) == sorted(fleets)
    assert all(link in LINK_PRESETS for link in vs_server.FLEET_LINKS.values())
    assert LINK_PRESETS[vs_server.FLEET_LINKS["fleet-loopback"]] is None  # unshaped
