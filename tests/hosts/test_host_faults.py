"""A board rides out its network: boards as hosts (``tests/hosts.py``) whose link goes down in the
middle of a fetch, whose cache box restarts empty, whose broker restarts. The board finishes the
run from compute and reports it; when the network returns it carries on without a restart (the
same process), and the runs keep the cold answer.

``zero``: 512 MB, Wi-Fi 4 shaped by the kernel, compute paced to a Pi Zero 2W (so it fetches);
``lan``: Gigabit, this machine's speed, stores the entries ``zero`` fetches and the cold answers.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
import redis

from cachebox import embedded
from cachebox.keys import device_key_name
from dashboard import mmlu
from tests.hosts.harness import hosted_plane, until

pytestmark = [pytest.mark.model, pytest.mark.cachebox]  # and hosts, from the folder


@pytest.fixture(scope="module")
def prompts():
    # A and B are fetched over Wi-Fi 4 (five shots: megabytes, so a fetch can be cut half-way);
    # zero computes C and D itself at a Pi Zero's pace, so they are short (D still fills a range).
    picked = {}
    for key, topic, shots in (
        ("A", "astronomy", 5),
        ("B", "high_school_biology", 5),
        ("C", "world_religions", 2),
        ("D", "college_physics", 1),
    ):
        picked[key] = mmlu.build_prompts(topic, shots, 1)[0].segments
    return picked


@pytest.fixture(scope="module")
def plane(tmp_path_factory, prompts):
    plane = hosted_plane(tmp_path_factory.mktemp("faults"), f"ef{uuid.uuid4().hex[:3]}")
    try:
        boards = {}
        for name, memory, link, extra in (
            ("zero", 512, "wifi4", {"EDGECACHE_COMPUTE_PROFILE": "pi-zero-2w"}),
            ("lan", 2048, "gigabit", {}),
        ):
            token = plane.register(name, memory_mb=memory, threads=1, link=link)
            boards[name] = plane.start_board(name, token, memory_mb=memory, threads=1, link=link, extra=extra)
        for name, (_, process) in boards.items():
            plane.wait_ready(name, process)
        plane.zero_host, plane.zero = boards["zero"]
        plane.cold = {
            key: run["text"]
            for key, run in zip(
                "ABCD",
                plane.wait_runs(
                    plane.dispatch([{"device": "lan", "segments": prompts[key], "use_cache": False} for key in "ABCD"])
                ),
            )
        }
        yield plane
    finally:
        plane.close()


def _store_on_lan(plane, prompts, keys: str) -> None:
    runs = plane.wait_runs(plane.dispatch([{"device": "lan", "segments": prompts[key]} for key in keys]))
    assert all(run["uploaded_bytes"] > 0 for run in runs), runs
    until(lambda: plane.catalog_items("zero") >= 4 * len(keys), 60, "zero's catalog to learn lan's entries")


def _downloaded(host) -> int:
    """Bytes the hub has sent to the board (its downloads), from the hub's end of the veth."""
    return int(Path(f"/sys/class/net/{host.plan.hub_end}/statistics/tx_bytes").read_text())


def test_a_link_that_goes_down_during_a_fetch_ends_in_a_computed_run_and_the_board_reconnects(plane, prompts):
    _store_on_lan(plane, prompts, "A")
    before = _downloaded(plane.zero_host)
    [request_id] = plane.dispatch([{"device": "zero", "segments": prompts["A"], "title": "link down"}])
    until(lambda: _downloaded(plane.zero_host) - before > 4_000_000, 120, "zero to be half-way through its fetch")
    plane.zero_host.link_down()
    try:
        until(lambda: "computing locally" in plane.log("board-zero"), 60, "zero to give up the fetch")
        given_up = plane.run(request_id)  # its report cannot leave while the link is down; the control
        assert given_up is None or given_up["error"].startswith("lost: ")  # plane may give the quiet board's run up
    finally:
        plane.zero_host.link_up()
    # The answer the board computed during the outage reaches the control plane when the link
    # returns (and replaces the run given up on, if it was).
    until(lambda: (plane.run(request_id) or {}).get("error", "none yet") == "", 180, "zero's computed answer to arrive")
    run = plane.run(request_id)
    print(
        f"link down mid-fetch: {run['case']}, {run['fetched_bytes'] / 1e6:.2f} MB fetched before the cut, decision {run['breakdown']['decision']}, TTFT {run['ttft_ms']:.0f} ms"
    )
    assert not run["error"] and run["cachebox_unavailable"]
    assert run["text"] == plane.cold["A"]  # what arrived before the cut was used, the rest computed: the cold answer

    _store_on_lan(plane, prompts, "B")
    [after] = plane.wait_runs(
        plane.dispatch([{"device": "zero", "segments": prompts["B"], "title": "after the link returned"}]), timeout=180
    )
    assert after["case"] == "full" and not after["cachebox_unavailable"] and after["text"] == plane.cold["B"]
    assert plane.zero.poll() is None  # the same process: no restart


def test_a_cache_box_restarted_empty_is_ridden_out(plane, prompts):
    plane.stop_cachebox()
    [down] = plane.wait_runs(
        plane.dispatch([{"device": "zero", "segments": prompts["C"], "title": "cache box down"}]), timeout=300
    )
    assert not down["error"] and down["cachebox_unavailable"] and down["text"] == plane.cold["C"]

    plane.start_cachebox()  # empty: no entries, no catalogs, no device records
    records = redis.Redis.from_url(embedded.url_for(plane.cachebox_dir, password=plane.cachebox_password))
    # The board serves on with its last record; its next heartbeat has the control plane publish it again.
    until(lambda: records.exists(device_key_name("zero")), 60, "zero's record to be published again")
    [after] = plane.wait_runs(
        plane.dispatch([{"device": "zero", "segments": prompts["D"], "title": "after the cache box returned"}]),
        timeout=300,
    )
    assert (
        not after["error"] and not after["cachebox_unavailable"] and after["uploaded_bytes"] > 0
    )  # reconnected: it shares again
    assert after["text"] == plane.cold["D"]
    assert plane.zero.poll() is None and "stopping" not in plane.log("board-zero")


def test_a_broker_restart_is_ridden_out(plane, prompts):
    plane.stop_broker()
    stopped = time.time()
    plane.start_broker()  # empty: queues and their messages are gone
    until(lambda: plane.heartbeats_after("zero", stopped), 120, "zero's heartbeats to reach the control plane again")
    [after] = plane.wait_runs(
        plane.dispatch([{"device": "zero", "segments": prompts["D"], "title": "after the broker returned"}]),
        timeout=300,
    )
    assert not after["error"] and after["text"] == plane.cold["D"]
    assert plane.zero.poll() is None
