"""The command-line surface, run as a user would: fresh processes, real model, real servers."""

import json
import os

import pytest

from tests.conftest import run_manage

pytestmark = [pytest.mark.model, pytest.mark.cachebox]


def run_in(home, *args):
    """A command on the embedded defaults of a checkout whose data lives in ``home``."""
    return run_manage(*args, env={"EDGECACHE_HOME": str(home), "EDGECACHE_N_CTX": "2048"}, unset=("REDIS_URL",))


def test_infer_after_infer_hits_through_the_embedded_cache_box(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is Paris. The capital of Italy is", encoding="utf-8")
    home = tmp_path / "home"
    try:
        first = run_in(home, "infer", "--prompt-file", str(prompt), "--max-tokens", "3", "--json")
        assert first.returncode == 0, first.stderr.decode()
        second = run_in(home, "infer", "--prompt-file", str(prompt), "--max-tokens", "3", "--json")
        assert second.returncode == 0, second.stderr.decode()
        cold, hit = json.loads(first.stdout), json.loads(second.stdout)
        assert (cold["case"], hit["case"]) == ("miss", "full")
        assert hit["text"] == cold["text"]
        assert hit["ttft_ms"] < cold["ttft_ms"]
        assert b"llama" not in first.stderr.lower()  # llama.cpp's chatter stays out of the terminal
        status = run_in(home, "cachebox", "status")
        assert b"up" in status.stdout and b"entries" in status.stdout
    finally:
        stopped = run_in(home, "cachebox", "stop")
    assert b"stopped" in stopped.stdout


def test_plain_output_shows_the_answer_and_a_breakdown(tmp_path, valkey_url):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("One, two, three,", encoding="utf-8")
    done = run_manage(
        "infer", "--prompt-file", str(prompt), "--max-tokens", "2", "--no-cache", env={"REDIS_URL": valkey_url}
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.strip()
    assert b"TTFT" in done.stderr and b"off" in done.stderr


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", b"is empty"),
        (b"   \n\t ", b"is empty"),
        (b"caf\xe9 au lait", b"not UTF-8"),
        ("word " * 5000, b"context holds"),
    ],
)
def test_bad_prompt_files_fail_with_one_clear_line(tmp_path, valkey_url, content, message):
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(content if isinstance(content, bytes) else content.encode())
    done = run_manage("infer", "--prompt-file", str(prompt), env={"REDIS_URL": valkey_url, "EDGECACHE_N_CTX": "2048"})
    assert done.returncode != 0
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr.decode()


def test_missing_prompt_file_and_bad_options(tmp_path, valkey_url):
    done = run_manage("infer", "--prompt-file", str(tmp_path / "nope.txt"), env={"REDIS_URL": valkey_url})
    assert done.returncode != 0 and b"does not exist" in done.stderr
    prompt = tmp_path / "p.txt"
    prompt.write_text("hello")
    done = run_manage("infer", "--prompt-file", str(prompt), "--top-p", "0", env={"REDIS_URL": valkey_url})
    assert done.returncode != 0 and b"top_p" in done.stderr
    done = run_manage("infer", "--prompt-file", str(prompt), "--namespace", "bad space", env={"REDIS_URL": valkey_url})
    assert done.returncode != 0 and b"invalid namespace" in done.stderr


def test_infer_answers_when_the_cache_box_is_down(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Two plus two is", encoding="utf-8")
    done = run_manage(
        "infer",
        "--prompt-file",
        str(prompt),
        "--max-tokens",
        "2",
        "--json",
        env={"REDIS_URL": "redis://127.0.0.1:9/0", "EDGECACHE_N_CTX": "2048"},
    )
    assert done.returncode == 0, done.stderr.decode()
    result = json.loads(done.stdout)
    assert result["cachebox"] == "unavailable" and result["text"]


def test_bench_cases_writes_the_papers_figures(tmp_path, valkey_url):
    out = tmp_path / "cases.json"
    done = run_manage(
        "bench",
        "cases",
        "--topic",
        "astronomy",
        "--prompts",
        "2",
        "--shots",
        "3",
        "--max-tokens",
        "2",
        "--json",
        str(out),
        env={"REDIS_URL": valkey_url, "EDGECACHE_N_CTX": "2048"},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()
    doc = json.loads(out.read_text())
    assert set(doc["cases"]) == {"1", "2", "3", "4", "5"}
    for row in doc["cases"].values():
        assert {"ttft_ms", "ttlt_ms", "breakdown_ms", "matched_tokens", "prompt_tokens", "state_bytes"} <= set(row)
    one, two, four, five = doc["cases"]["1"], doc["cases"]["2"], doc["cases"]["4"], doc["cases"]["5"]
    assert one["matched_tokens"] == 0 and one["cases_seen"]["miss"] == 2
    # Ranges are whole batches of the 128-token grid: the 15-token instruction alone is not one;
    # instruction + three examples reuse up to the last grid point before the question.
    assert two["matched_tokens"] == 0 and four["matched_tokens"] % 128 == 0
    assert 0 < four["matched_tokens"] < five["matched_tokens"] == five["prompt_tokens"]
    assert five["breakdown_ms"]["prefill_ms"] == 0
    assert doc["greedy_agreement"] == 1.0 and set(doc["accuracy"]) == {"1", "5"}
    assert doc["machine"]["model"] == "gemma-3-270m-q4_k_m.gguf" and doc["n"] == 2
    assert b"full-hit TTFT / cold TTFT" in done.stdout


def test_bench_cases_unknown_topic_is_a_clear_error(valkey_url):
    done = run_manage("bench", "cases", "--topic", "cooking", env={"REDIS_URL": valkey_url})
    assert done.returncode != 0 and b"unknown MMLU topic 'cooking'" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_make_run_says_which_of_its_processes_ended_and_how():
    """A board that crashed at start (llama.cpp's AMX kernels did) left `make run` silent."""
    import io
    import subprocess
    import sys

    from django.core.management.base import OutputWrapper

    from dashboard.management.commands.run import Command

    command = Command()
    said = io.StringIO()
    command.stderr = OutputWrapper(said)
    crashed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"])
    command._watch("board pi5", crashed).join(timeout=30)
    assert "board pi5 ended (signal SIGSEGV); its log is above" in said.getvalue()
    stopped = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = command._watch("board zero", stopped)
    command._stop([stopped])  # Ctrl-C: the processes it stops are not reported
    watcher.join(timeout=30)
    assert not watcher.is_alive() and "board zero" not in said.getvalue()


def test_make_run_starts_its_demo_boards_below_the_control_planes_cpu_priority():
    """Demo boards share this machine's cores with the web process: a board computing on every core
    must not starve the API (the threads llama.cpp starts run at the board's priority too)."""
    import os
    import subprocess
    import sys

    from dashboard.management.commands.run import BOARD_NICE, board_command

    probe = "import os, threading; seen = []; t = threading.Thread(target=lambda: seen.append(os.getpriority(os.PRIO_PROCESS, 0))); t.start(); t.join(); print(os.nice(0), seen[0])"
    out = subprocess.run(
        board_command([sys.executable, "-c", probe]), capture_output=True, text=True, timeout=60, check=True
    ).stdout.split()
    here = os.nice(0)
    assert [int(value) for value in out] == [min(19, here + BOARD_NICE)] * 2


def test_make_run_starts_its_control_worker_between_the_web_process_and_the_boards():
    """The control worker records each run's report just as its client's next request comes: it
    yields the cores to the web process (the API's answers), and takes them before the boards."""
    import os
    import subprocess

    from dashboard.management.commands.run import BOARD_NICE, CONTROL_NICE, control_worker_command
    from dashboard.outbox import control_worker_argv

    argv = control_worker_command("control")
    assert argv[-len(control_worker_argv("control", "warning")) :] == control_worker_argv("control", "warning")
    niced = subprocess.run(
        [*argv[: -len(control_worker_argv("control", "warning"))], "sh", "-c", "nice"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert int(niced) == min(19, os.nice(0) + CONTROL_NICE) and 0 < CONTROL_NICE < BOARD_NICE


def test_a_demo_board_gets_no_control_plane_variable_and_its_worker_never_sets_django_up(monkeypatch):
    """make run's boards share this machine, not the control plane's settings: they inherited
    DJANGO_SETTINGS_MODULE, and Celery's Django fixup then set Django up in each board worker (the
    control plane's settings, which read its secrets folder, and every app: 41 MB of RSS)."""
    from celery.fixups.django import DjangoFixup

    from dashboard.management.commands.run import CONTROL_PLANE_ONLY, board_environment
    from inference.board.app import board_app

    environ = {
        "PATH": "/usr/bin",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "EDGECACHE_N_CTX": "2048",
        **{name: "secret" for name in CONTROL_PLANE_ONLY},
    }
    assert board_environment(environ) == {
        "PATH": "/usr/bin",
        "REDIS_URL": "redis://127.0.0.1:6379/0",
        "EDGECACHE_N_CTX": "2048",
    }
    assert {"DJANGO_SETTINGS_MODULE", "DATABASE_URL", "EDGECACHE_ADMIN_PASSWORD"} <= CONTROL_PLANE_ONLY
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "dashboard.settings")  # a board started from the control plane's shell
    app = board_app("redis://127.0.0.1:1/0")
    assert not any(isinstance(fixup, DjangoFixup) for fixup in app._fixups)


def test_a_demo_board_started_by_make_run_cannot_open_the_control_planes_secrets(tmp_path, monkeypatch, settings):
    """The probe: `make run`'s boards ran as the control plane's user, beside `cachebox_password` and
    `signing_secret`, and could read them. As root, `make run` starts each board as
    EDGECACHE_BOARD_USER (`nobody`) with a folder of its own: every file of the secrets folder and
    of the state folder is refused to it, while its own keys folder is its to write."""
    import subprocess
    import sys
    from pathlib import Path

    from dashboard.management.commands.run import DEMO_BOARDS, Command, demo_board_account

    if os.geteuid() != 0:
        pytest.skip(
            "only root can start the boards as another user (not root: docs/operations.md says what protects the secrets)"
        )
    monkeypatch.setenv("EDGECACHE_HOME", str(tmp_path / ".edgecache"))  # the boards' folders go beside it
    secrets = [path for path in Path(settings.EDGECACHE_SECRETS_DIR).rglob("*") if path.is_file()]
    state = [path for path in Path(settings.EDGECACHE_HOME).rglob("*") if path.is_file()]
    assert {path.name for path in secrets} >= {"secret_key", "signing_secret"}, secrets
    probe = (
        "import json, os, sys\n"
        "opened = []\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        open(path, 'rb').close(); opened.append(path)\n"
        "    except PermissionError:\n"
        "        pass\n"
        "keys = os.environ['EDGECACHE_BOARD_KEYS_DIR']; os.makedirs(keys, exist_ok=True)\n"
        "open(os.path.join(keys, 'mine.key'), 'w').write('x')\n"
        "json.dump({'uid': os.getuid(), 'opened': opened, 'env': sorted(os.environ)}, open(os.path.join(os.environ['HOME'], 'probe.json'), 'w'))\n"
    )
    account = demo_board_account()
    assert account is not None and account[0] != 0
    command = Command()
    board = command._start_board(
        DEMO_BOARDS[1], "a-token", None, account, argv=[sys.executable, "-c", probe, *map(str, secrets + state)]
    )
    assert board.wait(timeout=60) == 0
    home = tmp_path / ".edgecache-boards" / DEMO_BOARDS[1]["name"]
    found = json.loads((home / "probe.json").read_text())
    assert found["uid"] == account[0]
    assert found["opened"] == [], f"the board read {found['opened']}"
    assert (home / "keys" / "mine.key").read_text() == "x" and home.stat().st_mode & 0o777 == 0o700
    assert not {"DJANGO_SECRET_KEY", "EDGECACHE_SIGNING_SECRET", "DATABASE_URL"} & set(found["env"])
    subprocess.run(["rm", "-rf", str(tmp_path / ".edgecache-boards")], check=True)


def test_make_run_says_its_demo_boards_run_as_this_user_when_it_is_not_root(monkeypatch):
    """Not root, a process cannot change user: the boards run as this one (make run warns), and a
    URL they are given carries no credentials either way."""
    from dashboard.management.commands import run

    monkeypatch.setattr(run.os, "geteuid", lambda: 1000)
    assert run.demo_board_account({"EDGECACHE_BOARD_USER": "nobody"}) is None
    monkeypatch.setattr(run.os, "geteuid", lambda: 0)
    assert run.demo_board_account({"EDGECACHE_BOARD_USER": ""}) is None
    with pytest.raises(run.CommandError, match="names no account"):
        run.demo_board_account({"EDGECACHE_BOARD_USER": "no-such-user-here"})
    env = run.board_environment(
        {
            "REDIS_URL": "redis://default:hunter2@127.0.0.1:6379/0",
            "EDGECACHE_SIGNING_SECRET": "s",
            "DJANGO_SECRET_KEY": "k",
        }
    )
    assert env == {"REDIS_URL": "redis://127.0.0.1:6379/0"}
