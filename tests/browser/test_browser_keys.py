"""The API keys page in Chromium on a 390 px phone screen (issue 42, item 9): a key is created, shown
once under one heading, copied exactly by its copy button, and stays on the screen; the official
`openai` client is served with it, and refused (401) once the page has revoked it. Against the
real stack (tests/stack.py); no board is needed (the models list answers without one)."""

from __future__ import annotations

import pytest

from tests.conftest import require
from tests.stack import ADMIN_PASSWORD, SCREENSHOTS, browser, log_in, stack, stack_env  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.cachebox]  # and browser, from the folder

openai = require("openai", "the test extra installs openai (make install)")


def test_a_key_made_on_a_phone_is_copied_whole_and_refused_by_the_api_once_revoked(stack, browser):
    from playwright.sync_api import expect

    context = log_in(browser, stack["url"], "admin", ADMIN_PASSWORD, width=390)
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=stack["url"])
    page = context.new_page()
    page.goto(stack["url"] + "/keys/")
    page.select_option("#id_namespace", "default")
    page.fill("#id_name", "phone-app")
    page.click("#api-key-create")

    expect(page.locator("h1")).to_have_count(1)
    expect(page.locator("h1")).to_have_text("API key created")
    key = page.locator("#api-key").inner_text().strip()
    assert key.startswith("ec-") and len(key) > 40
    page.locator("#api-key + button[data-copy]").click()
    expect(page.locator("#api-key ~ .copy-status")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == key
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing runs off the screen
    box = page.locator("#api-key").bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 390
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "api-key-390.png"), full_page=True)
    page.reload()  # shown once: the page leads back to the list, without the key
    expect(page.locator("h1")).to_have_text("API keys")
    assert key not in page.content()

    client = openai.OpenAI(api_key=key, base_url=stack["url"] + "/v1", max_retries=0, timeout=60)
    client.models.list()  # served (no board online: an empty list)

    row = page.locator("#api-key-table tr", has_text="phone-app")
    row.get_by_role("link", name="Revoke").click()
    expect(page.locator("h1")).to_contain_text("Revoke the API key")
    page.check("#id_confirm")
    page.get_by_role("button", name="Confirm").click()
    expect(page.locator(".messages")).to_contain_text("its next request is refused (401)")
    expect(page.locator("#api-key-table tr", has_text="phone-app")).to_contain_text("revoked")
    with pytest.raises(openai.AuthenticationError) as refused:
        client.models.list()
    assert refused.value.status_code == 401
    context.close()
