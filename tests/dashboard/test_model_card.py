"""Say what the model is (issue 42): each board's model card (name, size, base or
instruction-tuned, context) on the Run page, and, where a base model is chatted with, what to
expect. The cards are pure (``dashboard.pages.model_card``); the packaged model's is checked against the
GGUF file's own metadata; the Run page is rendered by Django's test client."""

from __future__ import annotations

import re
from html import unescape

import pytest
from django.urls import reverse

from dashboard import actions
from dashboard.models import Device
from dashboard.pages.model_card import PACKAGED, card_for
from tests.conftest import require


def test_the_packaged_model_is_described_as_the_base_gemma_3_270m():
    card = card_for("gemma-3-270m-q4_k_m.gguf")
    assert card is PACKAGED and card.known
    assert card.facts() == [
        "270M parameters",
        "Q4_K_M, 253 MB",
        "base model (pretrained, not instruction-tuned)",
        "trained context 32,768 tokens",
    ]
    assert "base model, not instruction-tuned" in card.chat_expectation() and "echoes" in card.chat_expectation()


@pytest.mark.parametrize(
    ("file", "parameters", "quantization", "tuned"),
    [
        ("gemma-3-270m-it-Q8_0.gguf", "270M", "Q8_0", True),
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "1B", "Q4_K_M", True),
        ("qwen2.5-0.5b-chat-f16.gguf", "0.5B", "F16", True),
        ("mystery.gguf", "", "", None),
    ],
)
def test_another_gguf_gets_what_its_file_name_says_and_no_more(file, parameters, quantization, tuned):
    card = card_for(file)
    assert (card.parameters, card.quantization, card.instruction_tuned) == (parameters, quantization, tuned)
    assert not card.known and card.context_length is None
    assert (card.chat_expectation() == "") is bool(tuned)  # an instruction-tuned model chats: nothing to warn of


@pytest.mark.model
def test_the_packaged_card_says_what_the_gguf_file_itself_says():
    """general.name, size label, no fine-tune (base), trained context and size, from the file."""
    gguf = require("gguf", "the lab extra installs gguf (make install)")
    from inference.engine.model_file import resolve_model

    path = resolve_model().path
    reader = gguf.GGUFReader(str(path))

    def field(name):
        found = reader.fields.get(name)
        return found.contents() if found is not None else None

    assert path.name == PACKAGED.file
    assert field("general.name").lower() == PACKAGED.name.lower() and field("general.size_label") == PACKAGED.parameters
    assert (
        field("general.finetune") is None and PACKAGED.instruction_tuned is False
    )  # no "it" fine-tune: the base model
    assert field("gemma3.context_length") == PACKAGED.context_length
    assert field("general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert round(path.stat().st_size / 1e6) == PACKAGED.file_mb


@pytest.mark.django_db
def test_the_run_page_shows_each_boards_model_card_and_warns_before_chatting_with_a_base_model(admin_client):
    base, _ = actions.register_device(None, name="base-board", kind="", cpu_threads=1, memory_mb=512)
    tuned, _ = actions.register_device(None, name="tuned-board", kind="", cpu_threads=1, memory_mb=512)
    actions.register_device(
        None, name="silent-board", kind="", cpu_threads=1, memory_mb=512
    )  # no heartbeat yet: no card
    Device.objects.filter(pk=base.pk).update(
        status={"model": "gemma-3-270m-q4_k_m.gguf", "memory": {"n_ctx": 2048}, "catalogs": {}}
    )
    Device.objects.filter(pk=tuned.pk).update(status={"model": "gemma-3-270m-it-Q8_0.gguf", "memory": {"n_ctx": 4096}})
    page = admin_client.get(reverse("run")).content.decode()
    found = re.finditer(r'<p class="model-card" data-model="([^"]+)">(.*?)</p>', page, re.S)
    cards = {m.group(1): unescape(re.sub(r"<[^>]+>", "", m.group(2))) for m in found}
    assert set(cards) == {"gemma-3-270m-q4_k_m.gguf", "gemma-3-270m-it-Q8_0.gguf"}
    assert cards["gemma-3-270m-q4_k_m.gguf"] == (
        "Gemma 3 270M gemma-3-270m-q4_k_m.gguf: 270M parameters · Q4_K_M, 253 MB · base model (pretrained, not instruction-tuned) · "
        "trained context 32,768 tokens. On base-board (context 2,048)."
    )
    assert (
        "instruction-tuned" in cards["gemma-3-270m-it-Q8_0.gguf"]
        and "tuned-board (context 4,096)" in cards["gemma-3-270m-it-Q8_0.gguf"]
    )
    chat = page[page.index('id="chat"') : page.index('id="chat-log"')]
    notes = re.findall(r'class="warning-box chat-model-note" data-model="([^"]+)">([^<]*)<', chat)
    assert [model for model, _ in notes] == ["gemma-3-270m-q4_k_m.gguf"]  # the tuned model chats: no note for it
    assert unescape(notes[0][1]).startswith("base-board: Gemma 3 270M is a base model, not instruction-tuned")
