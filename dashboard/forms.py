"""Forms of the control plane: register a device, run a prompt."""

from __future__ import annotations

from django import forms

from cachebox.errors import InvalidNamespace
from cachebox.keys import check_namespace
from cachebox.link import LINK_PRESETS
from inference import mmlu
from .cli import split_segments
from inference.models import Schema
from inference.pml import PMLError, parse_prompt, parse_schema

from .actions import PromptSpec
from .models import Device, SavedPrompt
from .stats import sees_every_namespace, visible_devices

MAX_PROMPT_CHARS = 32_000


def _clean_namespace(value: str) -> str:
    """An optional namespace field: empty, or usable in cache keys."""
    namespace = (value or "").strip()
    if namespace:
        try:
            check_namespace(namespace)
        except InvalidNamespace as exc:
            raise forms.ValidationError(str(exc))
    return namespace


class DeviceForm(forms.ModelForm):
    link_preset = forms.ChoiceField(
        choices=[("custom", "custom (fields below)")] + [(key, profile.label if profile else "none (unshaped)") for key, profile in LINK_PRESETS.items()],
        initial="none",
        help_text="fills bandwidth and round-trip time",
    )

    class Meta:
        model = Device
        fields = ["name", "namespace", "kind", "cpu_threads", "memory_mb", "link_preset", "link_bandwidth_mbps", "link_rtt_ms"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["namespace"].required = False  # empty: the default namespace
        self.fields["namespace"].empty_label = None

    def clean_namespace(self):
        from .models import Namespace

        return self.cleaned_data.get("namespace") or Namespace.objects.get_or_create(name="default")[0]

    def clean_cpu_threads(self):
        threads = self.cleaned_data["cpu_threads"]
        if not 1 <= threads <= 256:
            raise forms.ValidationError("CPU threads must be between 1 and 256.")
        return threads

    def clean(self):
        data = super().clean()
        preset = data.get("link_preset")
        if preset and preset != "custom":
            profile = LINK_PRESETS[preset]
            data["link_bandwidth_mbps"] = profile.bandwidth_mbps if profile else None
            data["link_rtt_ms"] = profile.rtt_ms if profile else None
        bandwidth, rtt = data.get("link_bandwidth_mbps"), data.get("link_rtt_ms")
        if bandwidth is not None and bandwidth <= 0:
            self.add_error("link_bandwidth_mbps", "Bandwidth must be positive (leave it empty for an unshaped link).")
        if rtt is not None and rtt < 0:
            self.add_error("link_rtt_ms", "Round-trip time cannot be negative.")
        return data

    def save(self, commit=True):
        device = super().save(commit=False)
        device.link_bandwidth_mbps = self.cleaned_data.get("link_bandwidth_mbps")
        device.link_rtt_ms = self.cleaned_data.get("link_rtt_ms")
        if commit:
            device.save()
        return device


class SchemaForm(forms.ModelForm):
    class Meta:
        model = Schema
        fields = ["source"]
        widgets = {"source": forms.Textarea(attrs={"rows": 18, "spellcheck": "false"})}


class _ForUser:
    """A form whose device choices are the devices its user may see (a device of another
    tenant, even named in a hand-made POST, is "not one of the available choices")."""

    def _scope_to(self, user) -> None:
        self.user = user
        self.fields["devices"].queryset = visible_devices(user).filter(revoked_at__isnull=True)

    def _check_namespace_is_theirs(self, namespace: str) -> str:
        if not namespace or sees_every_namespace(self.user):
            return namespace
        devices = list(visible_devices(self.user))
        theirs = {device.namespace_id for device in devices} | {device.cache_namespace for device in devices}
        if namespace not in theirs:
            mine = ", ".join(sorted({device.namespace_id for device in devices})) or "none"
            raise forms.ValidationError(f"Namespace {namespace!r} is not one of yours ({mine}): leave it empty to use each device's own.")
        return namespace


class EncodeForm(_ForUser, forms.Form):
    devices = forms.ModelMultipleChoiceField(queryset=Device.objects.none(), widget=forms.CheckboxSelectMultiple)
    namespace = forms.CharField(required=False, max_length=64, help_text="cache namespace (empty: each device's own; a board refuses any other)")

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self._scope_to(user)

    def clean_namespace(self):
        return self._check_namespace_is_theirs(_clean_namespace(self.cleaned_data.get("namespace")))


class RunForm(_ForUser, forms.Form):
    SOURCES = [("text", "Free text"), ("mmlu", "MMLU question"), ("saved", "Saved prompt"), ("pml", "Schema prompt (PML)")]

    devices = forms.ModelMultipleChoiceField(queryset=Device.objects.none(), widget=forms.CheckboxSelectMultiple)
    source = forms.ChoiceField(choices=SOURCES, initial="text", widget=forms.RadioSelect)
    text = forms.CharField(widget=forms.Textarea(attrs={"rows": 6}), required=False, max_length=MAX_PROMPT_CHARS)
    split_on = forms.CharField(required=False, max_length=20, help_text=r"optional: cut the text after each of these (e.g. \n\n)")
    topic = forms.ChoiceField(required=False, initial="astronomy")
    shots = forms.IntegerField(min_value=0, max_value=5, initial=5, required=False)
    question = forms.IntegerField(min_value=1, initial=1, required=False, help_text="which target question of the topic")
    saved_prompt = forms.ModelChoiceField(queryset=SavedPrompt.objects.all(), required=False)
    schema = forms.ModelChoiceField(queryset=Schema.objects.all(), required=False)
    pml = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 5, "spellcheck": "false"}), required=False, max_length=MAX_PROMPT_CHARS, label="PML prompt"
    )
    max_tokens = forms.IntegerField(min_value=1, max_value=256, initial=8)
    namespace = forms.CharField(required=False, max_length=64, help_text="cache namespace (empty: each device's own; a board refuses any other)")
    use_cache = forms.BooleanField(required=False, initial=True)

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        self._scope_to(user)
        try:
            self.fields["topic"].choices = [(topic, topic) for topic in mmlu.topics()]
        except FileNotFoundError:
            self.fields["topic"].choices = []

    def clean_namespace(self):
        return self._check_namespace_is_theirs(_clean_namespace(self.cleaned_data.get("namespace")))

    def clean(self):
        data = super().clean()
        source = data.get("source")
        if source == "text":
            if not (data.get("text") or "").strip():
                self.add_error("text", "Write a prompt, or pick an MMLU question or a saved prompt.")
        elif source == "mmlu":
            topic, shots, number = data.get("topic"), data.get("shots"), data.get("question")
            if topic and shots is not None and number:
                try:
                    data["mmlu_prompt"] = mmlu.build_prompts(topic, shots, 1, start=number - 1)[0]
                except (mmlu.UnknownTopic, ValueError) as exc:
                    self.add_error("question", str(exc))
            else:
                self.add_error("topic", "Choose a topic, a number of shots and a question.")
        elif source == "saved" and not data.get("saved_prompt"):
            self.add_error("saved_prompt", "Choose a saved prompt.")
        elif source == "pml":
            schema = data.get("schema")
            if not schema:
                self.add_error("schema", "Choose a schema.")
            else:
                try:
                    parse_prompt(data.get("pml") or "", parse_schema(schema.source))
                except PMLError as exc:
                    self.add_error("pml", str(exc))
        return data

    def prompt_spec(self) -> PromptSpec:
        data = self.cleaned_data
        common = dict(max_tokens=data["max_tokens"], namespace=data.get("namespace", ""), use_cache=data.get("use_cache", False))
        if data["source"] == "mmlu":
            prompt = data["mmlu_prompt"]
            title = f"MMLU {prompt.target.topic}, {len(prompt.examples)}-shot, question {data['question']}"
            return PromptSpec(prompt.segments, "mmlu", title, prompt.target.answer, **common)
        if data["source"] == "pml":
            title = f"PML {data['schema'].name}: " + " ".join((data["pml"] or "").split())[:60]
            return PromptSpec([], "pml", title, schema=data["schema"].source, pml=data["pml"], **common)
        if data["source"] == "saved":
            saved = data["saved_prompt"]
            return PromptSpec(split_segments(saved.text, saved.split_on), "saved", saved.name, **common)
        text = data["text"]
        return PromptSpec(split_segments(text, data.get("split_on")), "text", " ".join(text.split())[:80], **common)


class ConfirmForm(forms.Form):
    confirm = forms.BooleanField(required=True, label="Yes, I am sure")


class FlushForm(forms.Form):
    namespace = forms.CharField(required=False, max_length=64)
    model = forms.RegexField(regex=r"^[0-9a-f]{16}$", required=False, help_text="model fingerprint (16 hex characters)")
    confirm = forms.BooleanField(required=True, label="Yes, delete these entries")

    def clean(self):
        data = super().clean()
        if not data.get("namespace") and not data.get("model"):
            raise forms.ValidationError("Give a namespace, a model, or both: flushing everything is done per namespace.")
        if data.get("namespace"):
            try:
                check_namespace(data["namespace"])
            except InvalidNamespace as exc:
                self.add_error("namespace", str(exc))
        return data
