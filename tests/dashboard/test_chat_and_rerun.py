"""The dashboard tells the truth: the Run page's chat, prompts
typed with CRLF, "Run again", and the "Confusing" list. Django's test client against the real
control plane (Valkey for the registry and the channel layer); what a browser shows is in
tests/browser/test_browser_chat_and_rerun.py.
"""

from __future__ import annotations

import html
import json
import re
import uuid

import pytest
from django.urls import reverse

from dashboard import actions, mmlu
from dashboard.api.requests import parse_request
from dashboard.models import CacheEntry, Device, Dispatch, InferenceRun, Namespace
from inference.contract.messages import CANCELLED
from tests.dashboard.test_dashboard import (  # noqa: F401  (fixtures)
    control_plane,
    enrolled,
    plain_client,
    register,
    result_payload,
    sent_tasks,
    staff_client,
)

pytestmark = [pytest.mark.django_db, pytest.mark.cachebox]


def post_run(client, data: dict):
    return client.post(reverse("run"), data, HTTP_ACCEPT="application/json")


# -- 1. the chat ----------------------------------------------------------------------------------
def test_the_run_page_opens_on_chat_with_sampling_controls(staff_client, control_plane):
    page = staff_client.get(reverse("run")).content.decode()
    assert re.search(r'<input type="radio" name="source" value="chat"[^>]*checked', page)
    for field in (
        "id_message",
        "id_system",
        "id_history",
        "id_temperature",
        "id_top_p",
        "id_seed",
        "id_max_tokens",
        "chat-new",
    ):
        assert f'id="{field}"' in page, field


def test_a_chat_turn_is_sent_as_messages_with_its_sampling_in_the_signed_request(
    staff_client, control_plane, sent_tasks
):
    device, _ = register()
    history = [{"role": "user", "content": "Name a ferry port."}, {"role": "assistant", "content": "Dover."}]
    response = post_run(
        staff_client,
        {
            "devices": [device.pk],
            "source": "chat",
            "system": "Be terse.",
            "history": json.dumps(history),
            "message": "And in France?\r\nOne word.",
            "max_tokens": 32,
            "temperature": 0.7,
            "top_p": 0.9,
            "seed": 7,
            "use_cache": "on",
        },
    )
    assert response.status_code == 200, response.content
    (call,) = sent_tasks
    message = call["args"][0]  # opened as the board opens it: signed by the control plane
    assert message["segments"] == []
    assert message["messages"] == [
        {"role": "system", "content": "Be terse."},
        *history,
        {"role": "user", "content": "And in France?\nOne word."},
    ]
    assert (
        message["sampling"]["temperature"] == 0.7
        and message["sampling"]["top_p"] == 0.9
        and message["sampling"]["seed"] == 7
    )
    assert (
        message["max_tokens"] == 32
        and message["meta"]["source"] == "chat"
        and message["meta"]["title"].startswith("Chat: And in France?")
    )


def test_a_chat_talks_to_one_board_and_needs_a_message(staff_client, control_plane, sent_tasks):
    zero, _ = register("zero")
    pi5, _ = register("pi5")
    both = post_run(staff_client, {"devices": [zero.pk, pi5.pk], "source": "chat", "message": "Hello", "max_tokens": 4})
    assert both.status_code == 400 and "one board" in json.dumps(both.json()["errors"]["devices"])
    empty = post_run(staff_client, {"devices": [zero.pk], "source": "chat", "message": "  ", "max_tokens": 4})
    assert empty.status_code == 400 and "message" in empty.json()["errors"]
    forged = post_run(
        staff_client,
        {"devices": [zero.pk], "source": "chat", "message": "Hi", "history": '[{"role": "tool"}]', "max_tokens": 4},
    )
    assert forged.status_code == 400 and "New chat" in json.dumps(forged.json()["errors"]["history"])
    assert sent_tasks == []


def test_a_cancelled_run_keeps_what_was_streamed_on_its_card_and_its_page(staff_client, control_plane):
    device, token = register()
    keys = enrolled(device, token)
    payload = result_payload(device, keys, text=" Lisbon, Porto and", error=CANCELLED)
    run = actions.record_run(payload)
    assert actions.run_json(run)["cancelled"] is True and actions.run_json(run)["text"] == " Lisbon, Porto and"
    page = staff_client.get(reverse("run-detail", args=[run.pk])).content.decode()
    assert 'id="run-cancelled"' in page and "Lisbon, Porto and" in page


# -- 2. B8: CRLF from a textarea ------------------------------------------------------------------
def test_a_prompt_typed_with_crlf_is_sent_as_the_api_and_infer_send_it(staff_client, control_plane, sent_tasks):
    device, _ = register()
    typed = (
        "Ferry timetable:\nDover 08:00\nCalais 09:30\n\nWhich leaves first?\nAnswer: "  # its last space is a token too
    )
    response = post_run(
        staff_client,
        {
            "devices": [device.pk],
            "source": "text",
            "text": typed.replace("\n", "\r\n"),
            "max_tokens": 4,
            "use_cache": "on",
        },
    )
    assert response.status_code == 200
    from_page = sent_tasks[0]["args"][0]["segments"]
    from_api = parse_request({"model": "m", "prompt": typed}, "completion").prompt
    assert from_page == [from_api] == [typed]  # same text: same tokens, same cache keys
    # The routing keys (what the router and the cache look up) are the same too.
    dispatch = Dispatch.objects.get(request_id=sent_tasks[0]["args"][0]["request_id"])
    from dashboard import actions, router

    api_like = actions.run_request([from_api], max_tokens=4)  # as the API builds its run
    assert dispatch.routing["prompt"] and dispatch.routing["prompt"] == router.history(device, api_like)["prompt"]


def test_the_counter_and_the_server_agree_on_a_prompt_with_line_breaks(staff_client, control_plane, sent_tasks):
    from dashboard.forms import MAX_PROMPT_CHARS

    device, _ = register()
    lines = ("x" * 99 + "\n") * (MAX_PROMPT_CHARS // 100)
    assert len(lines) == MAX_PROMPT_CHARS  # what the page's counter counts: it fits
    fits = post_run(
        staff_client, {"devices": [device.pk], "source": "text", "text": lines.replace("\n", "\r\n"), "max_tokens": 4}
    )
    assert fits.status_code == 200, fits.content[:300]
    over = post_run(staff_client, {"devices": [device.pk], "source": "text", "text": lines + "y", "max_tokens": 4})
    assert over.status_code == 400 and f"{MAX_PROMPT_CHARS + 1:,} characters" in json.dumps(
        over.json()["errors"]["text"]
    )


# -- 3. B9: Run again -----------------------------------------------------------------------------
def test_a_run_keeps_the_tokens_and_sampling_it_asked_for(control_plane):
    device, token = register()
    keys = enrolled(device, token)
    request_id = str(uuid.uuid4())
    Dispatch.objects.create(
        request_id=request_id,
        kind="run",
        device=device,
        namespace="default",
        request={
            "request_id": request_id,
            "max_tokens": 128,
            "sampling": {"temperature": 0.0, "top_k": 40, "top_p": 0.95, "seed": None},
        },
    )
    payload = result_payload(
        device, keys, request_id=request_id, error=CANCELLED, breakdown={"generated_tokens": 10, "ttft_ms": 5.0}
    )
    run = actions.record_run(payload)
    assert run.breakdown["asked"]["max_tokens"] == 128 and run.breakdown["generated_tokens"] == 10


def test_run_again_refills_an_mmlu_question_and_the_tokens_asked_for(staff_client, control_plane):
    device, _ = register()
    mmlu_run = InferenceRun.objects.create(
        device=device,
        source="mmlu",
        title="MMLU astronomy, 5-shot, question 3",
        prompt="The following are …\nAnswer:",
        text=" B",
        expected_answer="C",
        breakdown={"generated_tokens": 1, "asked": {"max_tokens": 2}},
    )
    form = staff_client.get(reverse("run") + f"?again={mmlu_run.pk}").context["form"]
    assert (
        form.initial["source"] == "mmlu"
        and form.initial["topic"] == "astronomy"
        and form.initial["shots"] == 5
        and form.initial["question"] == 3
    )
    assert form.initial["max_tokens"] == 2

    cancelled = InferenceRun.objects.create(
        device=device,
        source="text",
        title="Tell me",
        prompt="Tell me about ferries.",
        text=" They",
        error=CANCELLED,
        breakdown={"generated_tokens": 10, "asked": {"max_tokens": 128, "temperature": 0.5, "seed": 3}},
    )
    form = staff_client.get(reverse("run") + f"?again={cancelled.pk}").context["form"]
    assert (
        form.initial["source"] == "text"
        and form.initial["max_tokens"] == 128
        and form.initial["temperature"] == 0.5
        and form.initial["seed"] == 3
    )

    chat = InferenceRun.objects.create(
        device=device,
        source="chat",
        title="Chat: why",
        prompt="<start_of_turn>user…",
        text="Because.",
        breakdown={
            "asked": {
                "max_tokens": 16,
                "messages": [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "Why?"},
                ],
            }
        },
    )
    form = staff_client.get(reverse("run") + f"?again={chat.pk}").context["form"]
    assert form.initial["source"] == "chat" and form.initial["message"] == "Why?"
    assert json.loads(form.initial["history"]) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
    ]


# -- 5. the "Confusing" list ----------------------------------------------------------------------
def test_a_question_past_the_topic_says_which_questions_exist(staff_client, control_plane, sent_tasks):
    device, _ = register()
    available = mmlu.target_count("astronomy", 5)
    response = post_run(
        staff_client,
        {
            "devices": [device.pk],
            "source": "mmlu",
            "topic": "astronomy",
            "shots": 5,
            "question": 99999,
            "max_tokens": 4,
        },
    )
    message = json.dumps(response.json()["errors"]["question"])
    assert (
        response.status_code == 400 and f"choose a question from 1 to {available}" in message and "99998" not in message
    )
    last = post_run(
        staff_client,
        {
            "devices": [device.pk],
            "source": "mmlu",
            "topic": "astronomy",
            "shots": 5,
            "question": available,
            "max_tokens": 4,
        },
    )
    assert last.status_code == 200


def test_one_date_format_on_a_page(staff_client, control_plane):
    from datetime import timedelta

    from django.utils import timezone

    device, _ = register()
    Device.objects.filter(pk=device.pk).update(
        last_seen=timezone.now() - timedelta(hours=2), enrolled_at=timezone.now() - timedelta(days=1)
    )
    page = staff_client.get(reverse("device-detail", args=["zero"])).content.decode()
    assert re.search(r"enrolled \d{4}-\d\d-\d\d \d\d:\d\d", page) and re.search(
        r"Token issued \d{4}-\d\d-\d\d \d\d:\d\d", page
    )
    assert re.search(r'Last seen <span data-role="last-seen">\d{4}-\d\d-\d\d \d\d:\d\d</span>', page)
    assert (
        '<meta name="edgecache-time-zone" content="UTC">' in page
    )  # the live script writes dates in the server's zone
    assert not re.search(r"\b(a\.m\.|p\.m\.|midnight|noon)", page)


def test_register_form_labels_and_a_duplicate_name_marked_on_its_field(staff_client, control_plane):
    register("zero")
    response = staff_client.post(
        reverse("device-register"),
        {"name": "zero", "kind": "", "cpu_threads": 1, "memory_mb": 512, "link_preset": "none"},
    )
    page = response.content.decode()
    assert ">CPU threads:</label>" in page and ">Memory (MB):</label>" in page
    assert response.context["form"].errors["name"] == [
        "A device named 'zero' is registered already: choose another name (or rotate that device's token on its page)."
    ]
    assert re.search(r'<input[^>]*name="name"[^>]*aria-invalid="true"', page)


def test_reloading_the_token_page_does_not_post_again_nor_show_the_token_again(staff_client, control_plane):
    posted = staff_client.post(
        reverse("device-register"),
        {"name": "ferry", "kind": "", "cpu_threads": 1, "memory_mb": 512, "link_preset": "none"},
    )
    assert posted.status_code == 302 and posted["Location"] == reverse("device-token", args=["ferry"])
    shown = staff_client.get(posted["Location"])
    token = shown.context["token"]
    assert token in shown.content.decode() and "no-store" in shown["Cache-Control"]
    reloaded = staff_client.get(posted["Location"], follow=True)  # a reload is a GET: nothing registered, no token
    assert token not in reloaded.content.decode() and "was shown once" in reloaded.content.decode()
    assert Device.objects.filter(name="ferry").count() == 1


def test_an_export_says_which_filter_it_did_not_apply(plain_client, control_plane):
    Namespace.objects.create(name="other")
    url = reverse("runs-export-json") + "?namespace=other"
    body = plain_client.get(url).json()
    assert "namespace" in body["filters_not_applied"]
    csv = plain_client.get(reverse("runs-export-csv") + "?namespace=other")
    assert "namespace" in csv["X-EdgeCache-Filters-Not-Applied"] and "unfiltered" in csv["Content-Disposition"]
    assert "filters_not_applied" not in plain_client.get(reverse("runs-export-json")).json()


def cache_entry(namespace: str, model: str, start: int = 0, end: int = 128, key: str | None = None) -> CacheEntry:
    return CacheEntry.objects.create(
        key=key or f"ec:e:{namespace}:{model}:{{{uuid.uuid4().hex}}}",
        namespace=namespace,
        model=model,
        start=start,
        end=end,
        bytes=1000,
    )


def test_the_cache_page_chooses_namespace_and_model_by_name_and_says_when_nothing_matches(staff_client, control_plane):
    device, _ = register()
    Device.objects.filter(pk=device.pk).update(
        status={"model": "gemma-3-270m-it-Q8_0.gguf", "fingerprint": "00ff00ff00ff00ff"}
    )
    cache_entry("default", "00ff00ff00ff00ff")
    page = staff_client.get(reverse("cache")).content.decode()
    assert re.search(r'<select name="namespace"', page) and re.search(r'<select name="model"', page)
    assert "gemma-3-270m-it-Q8_0.gguf (00ff00ff00ff00ff)" in page
    unknown = staff_client.post(
        reverse("cache-flush"), {"namespace": "defualt", "confirm": "on"}, follow=True
    ).content.decode()
    assert "no namespace &#x27;defualt&#x27; here" in unknown and "Deleted" not in unknown
    Namespace.objects.create(name="empty")
    nothing = staff_client.post(
        reverse("cache-flush"), {"namespace": "empty", "confirm": "on"}, follow=True
    ).content.decode()
    assert "Nothing to delete: the cache box holds no entry of namespace empty" in nothing


def test_an_entry_a_chat_turn_stored_after_its_answer_says_what_it_holds(control_plane, monkeypatch):
    """A chat's next-turn prefix covers the prompt and the answer: its words come from both."""
    from dashboard.pages import entry_preview

    class Words:  # a vocabulary of one token per word (the real one needs the model file)
        def tokenize(self, text, add_bos=True, special=False):
            return ([0] if add_bos else []) + [hash(word) for word in text.split()]

        def detokenize(self, tokens):
            return " ".join(self.words.get(token, "?") for token in tokens)

    words = Words()
    prompt, answer = "user: Name a port. model:", " Dover is busy."
    words.words = {hash(word): word for word in (prompt + answer).split()}
    monkeypatch.setattr(entry_preview, "_vocabulary", lambda model: words)
    device, _ = register()
    entry = cache_entry("default", "00ff00ff00ff00ff", start=6, end=9)  # BOS and the prompt's 5 words come first
    InferenceRun.objects.create(
        device=device,
        source="api",
        prompt=prompt,
        text=answer,
        breakdown={"entries": {"stored": [{"name": entry.key, "start": 6, "end": 9, "piece": ""}]}},
    )
    assert entry_preview.previews([entry])[entry.key] == "…Dover is busy."


def test_the_api_key_page_names_a_real_model(staff_client, control_plane):
    staff_client.user.is_superuser = True
    staff_client.user.save()
    device, _ = register()
    Device.objects.filter(pk=device.pk).update(
        status={"model": "gemma-3-270m-it-Q8_0.gguf", "fingerprint": "00ff00ff00ff00ff"}
    )
    response = staff_client.post(
        reverse("admin:dashboard_apikey_add"),
        {"name": "ci", "namespace": "default", "rate_per_minute": 60},
        follow=True,
    )
    page = html.unescape(re.sub(r"<[^>]+>", "", response.content.decode()))  # as the page shows it
    assert '"model": "gemma-3-270m-it-Q8_0.gguf"' in page and '"MODEL"' not in page


def test_metrics_opens_in_a_labelled_new_tab(staff_client, control_plane):
    page = staff_client.get(reverse("home")).content.decode()
    link = re.search(r'<a [^>]*id="nav-metrics"[^>]*>[^<]*', page).group(0)
    assert 'target="_blank"' in link and "new tab" in link


def test_only_staff_see_the_cache_box_address(django_user_model, control_plane):
    from django.test import Client

    address = actions.cachebox().safe_url
    line = re.compile(r'<span id="cachebox-line">(.*?)</span>', re.S)
    staff, member = Client(), Client()
    staff.force_login(django_user_model.objects.create_user("carol", password="pw-carol-123", is_staff=True))
    member.force_login(django_user_model.objects.create_user("dave", password="pw-dave-123"))
    assert address in line.search(staff.get(reverse("home")).content.decode()).group(1)
    page = member.get(reverse("home")).content.decode()
    assert line.search(page).group(1) == "Cache box" and address not in page
