"""Starting a board on another machine (issue 42, item 1): every page that says how shows the
board's own install (`make install-board`) and entry point (`edgecache-board`), and, to staff, the
cache box's address as a board elsewhere reaches it (EDGECACHE_PUBLIC_REDIS_URL, else derived from
the running cache box), with a copy button.

The pure address and command tests and the pages' Django tests run in milliseconds; the last test
takes the command from the rendered token page in Chromium (its copy button, its box at 390 px)
and runs it, as shown, in a board-only environment (tests/inference/test_board_install.py's) against a
running control plane (tests/stack.py): the board enrolls.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from html import unescape
from types import SimpleNamespace

import pytest
from django.test import Client
from django.urls import reverse

from dashboard.pages import board_start
from dashboard.pages.board_start import BoardAddress, board_address, start_command, without_credentials
from tests.inference.test_board_install import board_env  # noqa: F401  (fixture: the board-only virtualenv)
from tests.stack import ADMIN_PASSWORD, SCREENSHOTS, browser, log_in, shell, stack, stack_env  # noqa: F401  (fixtures)

COMMAND = re.compile(r'<pre id="edge-command" class="command">(.*?)</pre>', re.S)


def text_of(html: str) -> str:
    """What a browser shows (and a copy button copies) of ``html``: its text, unescaped."""
    return unescape(re.sub(r"<[^>]+>", "", html))


# -- the address and the command (pure) -------------------------------------------------------------
def test_a_boards_address_never_carries_the_deployments_credentials():
    assert without_credentials("redis://default:s3cret@cache.lan:6379/0") == "redis://cache.lan:6379/0"
    tls = "rediss://user:p%40ss@10.0.0.5:6380/0?ssl_cert_reqs=required"
    assert without_credentials(tls) == "rediss://10.0.0.5:6380/0?ssl_cert_reqs=required"
    assert without_credentials("redis://cache.lan:6379/0") == "redis://cache.lan:6379/0"


def test_the_public_address_wins_then_redis_url_then_the_embedded_valkeys_bind(settings):
    settings.EDGECACHE_CACHEBOX_URL = ""
    settings.REDIS_URL_IS_EMBEDDED, settings.REDIS_URL = True, "redis://default:pw@127.0.0.1:6390/0"
    settings.EDGECACHE_PUBLIC_REDIS_URL = "redis://admin:pw@cachebox.example.org:6390/0"
    assert board_address() == BoardAddress("redis://cachebox.example.org:6390/0", source="EDGECACHE_PUBLIC_REDIS_URL")
    settings.EDGECACHE_PUBLIC_REDIS_URL = ""
    settings.EDGECACHE_EMBEDDED_BIND = ("127.0.0.1", "192.168.4.2")
    assert board_address() == BoardAddress("redis://192.168.4.2:6390/0", source="the embedded Valkey")
    settings.EDGECACHE_EMBEDDED_BIND = ("127.0.0.1",)
    alone = board_address()
    assert alone.redis_url == "redis://127.0.0.1:6390/0" and alone.local_only  # the page says so, and what to set
    settings.REDIS_URL_IS_EMBEDDED, settings.REDIS_URL = False, "redis://default:pw@10.1.2.3:6379/0"
    settings.EDGECACHE_CACHEBOX_URL = "redis+cluster://u:p@10.1.2.4:7000,10.1.2.5:7000"
    assert board_address() == BoardAddress(
        "redis://10.1.2.3:6379/0", cachebox_url="redis+cluster://10.1.2.4:7000,10.1.2.5:7000"
    )


def test_the_start_command_is_the_boards_entry_point_with_the_address_for_staff_only():
    address = BoardAddress("redis://cachebox.example.org:6390/0")
    command = start_command("zero", "AbC_123-xyz", address)
    assert (
        command
        == "REDIS_URL=redis://cachebox.example.org:6390/0 .venv-board/bin/edgecache-board --name zero --token AbC_123-xyz"
    )
    assert start_command("zero") == ".venv-board/bin/edgecache-board --name zero"  # a member's: no address
    # A token may begin with "-": as `--token -x` argparse would read an option without its value.
    assert shlex.split(start_command("zero", "-dash", address))[-1] == "--token=-dash"


# -- the pages --------------------------------------------------------------------------------------
@pytest.fixture
def public(settings):
    settings.EDGECACHE_PUBLIC_REDIS_URL = "redis://cachebox.example.org:6390/0"
    settings.EDGECACHE_CACHEBOX_URL = ""
    return "REDIS_URL=redis://cachebox.example.org:6390/0 .venv-board/bin/edgecache-board"


@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_token_page_shows_the_install_the_command_with_the_public_address_and_a_copy_button(
    admin_client, public, settings, valkey_url
):
    settings.REDIS_URL = valkey_url
    fields = {
        "name": "far-board",
        "namespace": "default",
        "kind": "",
        "cpu_threads": 1,
        "memory_mb": 512,
        "link_preset": "custom",
    }
    page = admin_client.post(reverse("device-register"), fields, follow=True).content.decode()
    command = text_of(COMMAND.search(page).group(1))
    token = text_of(re.search(r'<pre id="device-token" class="command">(.*?)</pre>', page).group(1))
    # A token that starts with "-" is written --token=TOKEN, one word (else it would read as an option).
    token_words = [f"--token={token}"] if token.startswith("-") else ["--token", token]
    for word in token_words:  # each word kept whole: lines wrap at spaces only
        assert f'<span class="word">{word}</span>' in page
    assert command == f"{public} --name far-board " + " ".join(token_words)
    assert "make install-board" in page and "pip install ." in page and "python manage.py edge" not in page
    assert page.count('aria-label="Copy the start command"') == 1 and 'aria-label="Copy the token"' in page
    assert "EDGECACHE_PUBLIC_REDIS_URL" in page and "loopback" not in page


@pytest.mark.django_db
@pytest.mark.cachebox
def test_the_dashboards_empty_state_gives_staff_the_command_and_members_no_address(
    admin_client, django_user_model, public, settings, valkey_url
):
    settings.REDIS_URL = valkey_url
    page = admin_client.get(reverse("home")).content.decode()
    assert text_of(COMMAND.search(page).group(1)) == f"{public} --name NAME --token TOKEN"
    member = Client()
    member.force_login(django_user_model.objects.create_user("mo", password="pw-mo-12345"))
    assert "cachebox.example.org" not in member.get(reverse("home")).content.decode()


@pytest.mark.django_db
def test_the_run_pages_hints_start_the_board_with_its_entry_point_and_the_address_for_staff(
    admin_client, django_user_model, public
):
    prefix = re.compile(r'data-start-prefix="([^"]*)"')
    assert unescape(prefix.search(admin_client.get(reverse("run")).content.decode()).group(1)) == public
    member = Client()
    member.force_login(django_user_model.objects.create_user("mo", password="pw-mo-12345"))
    page = member.get(reverse("run")).content.decode()
    assert unescape(prefix.search(page).group(1)) == board_start.ENTRY_POINT and "cachebox.example.org" not in page


def test_the_embedded_valkey_on_loopback_is_said_to_reach_this_machine_only(settings):
    settings.EDGECACHE_PUBLIC_REDIS_URL, settings.EDGECACHE_CACHEBOX_URL = "", ""
    settings.REDIS_URL_IS_EMBEDDED, settings.REDIS_URL = True, "redis://default:pw@127.0.0.1:6390/0"
    settings.EDGECACHE_EMBEDDED_BIND = ("127.0.0.1",)
    shown = board_start.shown_to(SimpleNamespace(is_staff=True), "zero", "tok")
    assert shown["address"].local_only
    assert (
        shown["command"] == "REDIS_URL=redis://127.0.0.1:6390/0 .venv-board/bin/edgecache-board --name zero --token tok"
    )
    assert board_start.shown_to(SimpleNamespace(is_staff=False), "zero")["address"] is None


# -- the command, as shown, starts a board on "another machine" ------------------------------------
@pytest.mark.install
@pytest.mark.browser
@pytest.mark.processes
@pytest.mark.cachebox
def test_the_command_on_the_token_page_enrolls_a_board_from_the_board_only_environment(
    stack, browser, board_env, tmp_path
):  # noqa: F811
    from playwright.sync_api import expect

    from inference.engine.model_file import resolve_model

    context = log_in(browser, stack["url"], "admin", ADMIN_PASSWORD, width=390)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=stack["url"])
    page = context.new_page()
    page.goto(stack["url"] + "/devices/register/")
    page.fill("#id_name", "elsewhere")
    page.fill("#id_memory_mb", "1024")
    page.click("#register-submit")
    expect(page.locator("h1")).to_have_text("elsewhere is registered")
    box = page.locator("#edge-command")
    command = box.inner_text().strip()
    token = page.locator("#device-token").inner_text().strip()
    assert (
        command.startswith("REDIS_URL=redis://127.0.0.1:")
        and ".venv-board/bin/edgecache-board --name elsewhere --token" in command
    )
    assert token in command and "default:" not in command  # no credentials: the board logs in as itself

    # Copy puts exactly the command on the clipboard.
    page.locator(".board-start button[data-copy]").click()
    expect(page.locator(".board-start .copy-status")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == command
    # At 390 px the command's box stays on the screen, and the token is never cut across lines.
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    box = page.locator("#edge-command").bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390
    assert (
        page.evaluate(LINES_OF, token) == 1
    )  # the token on one line (the box scrolls where a line is too short for it)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "token-390.png"), full_page=True)

    # The board's machine: `make install-board` made .venv-board there (the board-only venv). The
    # model file comes from EDGECACHE_MODEL, as on a board whose model lives elsewhere.
    machine = tmp_path / "board-machine"
    machine.mkdir()
    (machine / ".venv-board").symlink_to(board_env.parent.parent)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(machine),
        "EDGECACHE_HOME": str(machine / ".edgecache"),
        "EDGECACHE_MODEL": str(resolve_model().path),
        "EDGECACHE_N_CTX": "2048",
    }
    log = open(machine / "board.log", "wb")
    board = subprocess.Popen(
        ["bash", "-c", command], cwd=machine, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 180
        while "enrolled" not in (state := shell(stack, _ENROLLED).strip().splitlines()[-1]):
            output = (machine / "board.log").read_text(errors="replace")[-3000:]
            assert board.poll() is None, output
            assert time.monotonic() < deadline, f"not enrolled after 180 s ({state}): {output}"
            time.sleep(1)
        page.goto(stack["url"] + "/devices/elsewhere/")
        expect(page.locator('h1 [data-role="online"]')).to_have_text("online", timeout=120_000)
    finally:
        os.killpg(board.pid, signal.SIGTERM)
        try:
            board.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(board.pid, signal.SIGKILL)
            board.wait()
        log.close()
        context.close()


# The lines the token's text takes in the start command's box.
LINES_OF = """(token) => {
  const walker = document.createTreeWalker(document.getElementById('edge-command'), NodeFilter.SHOW_TEXT);
  let node;
  while ((node = walker.nextNode()) && !node.data.includes(token)) {}
  const range = document.createRange();
  const at = node.data.indexOf(token);
  range.setStart(node, at);
  range.setEnd(node, at + token.length);
  return new Set(Array.from(range.getClientRects()).map((r) => Math.round(r.top))).size;
}"""
_ENROLLED = (
    "from dashboard.models import Device\n"
    "d = Device.objects.get(name='elsewhere')\n"
    "print('enrolled' if d.enrolled_at else 'waiting')\n"
)
