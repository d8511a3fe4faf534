"""Forms of the control plane: register a device, run a prompt."""

from __future__ import annotations

import json
import re

from django import forms
from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.utils.html import escape

from cachebox.errors import InvalidNamespace
from cachebox.keys import check_namespace
from cachebox.link import LINK_PRESETS
from cachebox.signing import private_namespace
from dashboard import mmlu
from dashboard.actions.runs import split_segments
from dashboard.models import CacheEntry, Schema
from dashboard.pages.stats import (
    ANSWERED,
    CANCELLED_RUNS,
    FAILED,
    namespace_choices,
    outcome_q,
    sees_every_namespace,
    visible_devices,
    visible_schemas,
)
from inference.contract.messages import RunRequest
from inference.serving.breakdown import Case, Decision
from inference.serving.pml import PMLError, parse_prompt, parse_schema

from .actions import run_request as asked_run
from .models import Device, Namespace, SavedPrompt

MAX_PROMPT_CHARS = 32_000  # the Run page's limit, in the text boxes (counter) and here (form error)
MAX_CHAT_TURNS = 64  # turns a Run page chat sends back (the board's context ends it sooner)


def lf(text: str) -> str:
    """``text`` with the line endings a browser posts (CRLF, by the HTML standard) as typed: LF.
    The same prompt then has the same tokens, and keys, from the Run page, the API and ``infer``;
    and its length is what the page's counter counted."""
    return (text or "").replace("\r\n", "\n").replace("\r", "\n")


SCHEMA_IN_PROMPT = re.compile(r"""<prompt\b[^>]*?\bschema\s*=\s*["']([^"']+)["']""")


def _limit_without_cut(field: forms.Field, limit: int) -> None:
    """Show ``limit`` on the widget (the page counts characters against it) without the HTML
    ``maxlength`` that lets a browser cut a paste silently: the form refuses what is longer."""
    field.widget.attrs.pop("maxlength", None)
    field.widget.attrs["data-maxlength"] = str(limit)


def _too_long(what: str, value: str, limit: int, advice: str) -> forms.ValidationError:
    return forms.ValidationError(
        f"{what} has {len(value):,} characters; at most {limit:,} are accepted. {advice}", code="max_length"
    )


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
        choices=[("custom", "custom (fields below)")]
        + [(key, profile.label if profile else "none (unshaped)") for key, profile in LINK_PRESETS.items()],
        initial="none",
        help_text="fills bandwidth and round-trip time",
    )

    class Meta:
        model = Device
        fields = [
            "name",
            "namespace",
            "kind",
            "cpu_threads",
            "memory_mb",
            "link_preset",
            "link_bandwidth_mbps",
            "link_rtt_ms",
        ]

    NAME_LIMIT = 40  # Device.name's max_length

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["namespace"].required = False  # empty: the default namespace
        self.fields["namespace"].empty_label = None
        name = self.fields["name"]
        # Help texts are rendered as HTML: "<name>" would be swallowed as a tag.
        name.help_text = escape(
            f"at most {self.NAME_LIMIT} characters: letters, digits, '-' and '_'; the board's queue is device.<name>"
        )
        _limit_without_cut(name, self.NAME_LIMIT)
        _limit_without_cut(self.fields["kind"], self.fields["kind"].max_length)
        name.error_messages["max_length"] = (
            f"A device name has at most {self.NAME_LIMIT} characters; this one has %(show_value)d: shorten it."
        )

    @staticmethod
    def link_presets() -> dict:
        """The link presets as the page's script fills the bandwidth and RTT fields from them."""
        return {
            key: ({"bandwidth_mbps": profile.bandwidth_mbps, "rtt_ms": profile.rtt_ms} if profile else None)
            for key, profile in LINK_PRESETS.items()
        }

    def clean_name(self):
        name = self.cleaned_data.get("name")
        if name and Device.objects.filter(name=name).exclude(pk=self.instance.pk).exists():
            raise forms.ValidationError(
                f"A device named {name!r} is registered already: choose another name (or rotate that device's token on its page).",
                code="unique",
            )
        return name

    def clean_namespace(self):
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
    namespace = forms.ChoiceField(
        required=False, help_text="the namespace whose keys, users and boards may use it; shared: every namespace"
    )

    class Meta:
        model = Schema
        fields = ["source", "namespace"]
        widgets = {"source": forms.Textarea(attrs={"rows": 18, "spellcheck": "false"})}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)

        self.fields["namespace"].choices = [("", "shared with every namespace")] + [
            (name, name) for name in Namespace.objects.values_list("name", flat=True)
        ]


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
            raise forms.ValidationError(
                f"Namespace {namespace!r} is not one of yours ({mine}): leave it empty to use each device's own."
            )
        return namespace


class EncodeForm(_ForUser, forms.Form):
    devices = forms.ModelMultipleChoiceField(queryset=Device.objects.none(), widget=forms.CheckboxSelectMultiple)
    namespace = forms.CharField(
        required=False, max_length=64, help_text="cache namespace (empty: each device's own; a board refuses any other)"
    )

    def __init__(self, *args, user, schema: Schema | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._scope_to(user)
        if schema is not None and schema.namespace:  # a namespace's schema is encoded by its own boards only
            self.fields["devices"].queryset = self.fields["devices"].queryset.filter(namespace_id=schema.namespace)

    def clean_namespace(self):
        return self._check_namespace_is_theirs(_clean_namespace(self.cleaned_data.get("namespace")))


class RunForm(_ForUser, forms.Form):
    SOURCES = [
        ("chat", "Chat"),
        ("text", "Free text (no chat template)"),
        ("mmlu", "MMLU question"),
        ("saved", "Saved prompt"),
        ("pml", "Schema prompt (PML)"),
    ]

    devices = forms.ModelMultipleChoiceField(
        queryset=Device.objects.none(), widget=forms.CheckboxSelectMultiple, required=False
    )
    any_board = forms.BooleanField(
        required=False,
        label="any board",
        help_text="one run, on the board expected to answer first: the one holding the longest prefix of the prompt, "
        "weighed with its queue (of the ticked devices, or of every board of the namespace named below, else of your current "
        "namespace: never another tenant's)",
    )
    source = forms.ChoiceField(choices=SOURCES, initial="chat", widget=forms.RadioSelect)
    # A chat: the system prompt, the turns so far (JSON, kept by the page) and the next message.
    system = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 2}),
        required=False,
        label="System prompt",
        help_text="optional: how the model should answer",
    )
    history = forms.CharField(widget=forms.HiddenInput, required=False)
    message = forms.CharField(widget=forms.Textarea(attrs={"rows": 3}), required=False, label="Message")
    # Not stripped: a prompt's last space or line break changes its tokens (and its cache keys).
    text = forms.CharField(widget=forms.Textarea(attrs={"rows": 6}), required=False, strip=False)
    split_on = forms.CharField(
        required=False, max_length=20, help_text=r"optional: cut the text after each of these (e.g. \n\n)"
    )
    topic = forms.ChoiceField(required=False, initial="astronomy")
    shots = forms.IntegerField(min_value=0, max_value=5, initial=5, required=False)
    question = forms.IntegerField(
        min_value=1, initial=1, required=False, help_text="which target question of the topic"
    )
    saved_prompt = forms.ModelChoiceField(queryset=SavedPrompt.objects.all(), required=False)
    schema = forms.ModelChoiceField(
        queryset=Schema.objects.all(),
        required=False,
        empty_label="the one the prompt names",
        help_text='optional when the prompt names a known schema (<prompt schema="...">)',
    )
    pml = forms.CharField(
        widget=forms.Textarea(attrs={"rows": 5, "spellcheck": "false"}), required=False, label="PML prompt"
    )
    max_tokens = forms.IntegerField(min_value=1, max_value=256, initial=64)
    temperature = forms.FloatField(
        min_value=0.0, max_value=2.0, initial=0.0, required=False, help_text="0: greedy (the same answer every time)"
    )
    top_p = forms.FloatField(min_value=0.01, max_value=1.0, initial=0.95, required=False, label="Top-p")
    seed = forms.IntegerField(
        min_value=0, max_value=2**63 - 1, required=False, help_text="optional: the same seed samples the same answer"
    )
    namespace = forms.CharField(
        required=False,
        max_length=64,
        help_text="optional: the namespace (tenant) whose cache entries the run uses; empty: each board's own. A board serves its own "
        "namespace only, and 'any board' chooses among the boards of this namespace (empty: your current one)",
    )
    use_cache = forms.BooleanField(required=False, initial=True)
    STRATEGIES = (
        [("exact", "exact (prefix serving)")]
        + [(f"kv-prediction:{k}", f"KV prediction, {k} auxiliary layers (lab, approximate)") for k in (3, 6, 9)]
        + [
            ("anchors", "anchor tokens: earlier parts keep only their last token (lab, approximate)"),
            ("anchors-tuned", "anchor tokens on the anchor-tuned model (lab, approximate)"),
            ("early-exit:top-prob:0.8", "early exit while decoding, top probability >= 0.8 (lab, approximate)"),
            (
                "early-exit:similarity:0.98",
                "early exit while decoding, hidden-state similarity >= 0.98 (lab, approximate)",
            ),
        ]
    )
    strategy = forms.ChoiceField(
        choices=STRATEGIES,
        initial="exact",
        required=False,
        help_text="lab strategies answer from an approximate KV cache (predicted, seed 001; pruned to anchor tokens, seed 004) "
        "or leave the network early while decoding (seed 002): approximate answers; they never use the cache box",
    )

    def __init__(self, *args, user, current_namespace: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self._scope_to(user)
        self.current_namespace = current_namespace  # where "any board" routes when no namespace is named
        self.fields["schema"].queryset = visible_schemas(user)
        try:
            self.fields["topic"].choices = [(topic, topic) for topic in mmlu.topics()]
        except FileNotFoundError:
            self.fields["topic"].choices = []
        for name in ("text", "pml", "message", "system"):
            _limit_without_cut(self.fields[name], MAX_PROMPT_CHARS)

    def clean_namespace(self):
        namespace = self._check_namespace_is_theirs(_clean_namespace(self.cleaned_data.get("namespace")))
        if namespace:
            devices = list(self.fields["devices"].queryset)
            known = set(Namespace.objects.values_list("name", flat=True)) | {
                device.cache_namespace for device in devices
            }
            if namespace not in known:
                names = ", ".join(sorted(set(namespace_choices(self.user)))) or "none"
                raise forms.ValidationError(
                    f"There is no namespace {namespace!r} (yours: {names}): leave it empty to use each board's own.",
                    code="unknown",
                )
        return namespace

    def _check_boards_serve(self, data: dict) -> None:
        """A board serves its own namespace only (it refuses a run of any other): a run named to
        another namespace, or "any board" over boards of several, is refused here, not failed there."""
        namespace = data.get("namespace") or ""
        devices = list(data.get("devices") or ())
        if namespace and "namespace" not in self.errors:
            foreign = [
                device.name for device in devices if namespace not in (device.namespace_id, device.cache_namespace)
            ]
            if foreign:
                verb = "serves" if len(foreign) == 1 else "serve"
                self.add_error(
                    "namespace",
                    f"{', '.join(foreign)} {verb} another namespace and would refuse a run of {namespace!r}: "
                    f"leave Namespace empty, or tick boards of {namespace!r}.",
                )
                return
        if not data.get("any_board") or "namespace" in self.errors:
            return
        if not namespace and devices:
            tenants = sorted({device.namespace_id for device in devices})
            if len(tenants) > 1:
                self.add_error(
                    "any_board",
                    f"'any board' sends the run to one namespace's boards; the ticked devices are of {', '.join(tenants)}: "
                    "tick boards of one, or name it in Namespace.",
                )
                return
            namespace = tenants[0]
        data["route_namespace"] = namespace or self.current_namespace
        if not data["route_namespace"]:
            self.add_error(
                "any_board",
                "You are a member of no namespace: there is no board to send it to (a staff member adds you to one).",
            )

    def route_candidates(self) -> list[Device]:
        """The boards "any board" chooses among: the ticked ones, or every one the user may send to,
        of the run's namespace only (``route_namespace``): a run never goes to another tenant's board."""
        data = self.cleaned_data
        namespace = data.get("route_namespace") or ""
        devices = list(data.get("devices") or ()) or list(self.fields["devices"].queryset)
        return [device for device in devices if namespace in (device.namespace_id, device.cache_namespace)]

    def clean_text(self):
        text = lf(self.cleaned_data.get("text"))
        if len(text) > MAX_PROMPT_CHARS:
            raise _too_long(
                "The prompt",
                text,
                MAX_PROMPT_CHARS,
                "Nothing was sent: shorten it (a board's context holds a few thousand tokens).",
            )
        return text

    def clean_pml(self):
        pml = lf(self.cleaned_data.get("pml"))
        if len(pml) > MAX_PROMPT_CHARS:
            raise _too_long("The PML prompt", pml, MAX_PROMPT_CHARS, "Nothing was sent: shorten it.")
        return pml

    def clean_message(self):
        message = lf(self.cleaned_data.get("message"))
        if len(message) > MAX_PROMPT_CHARS:
            raise _too_long("The message", message, MAX_PROMPT_CHARS, "Nothing was sent: shorten it.")
        return message

    def clean_system(self):
        return lf(self.cleaned_data.get("system"))

    def clean_history(self):
        """The chat's turns so far, as the page keeps them: [{"role", "content"}, ...] alternating
        user and assistant (an assistant turn may be a cancelled, partial answer)."""
        raw = self.cleaned_data.get("history") or ""
        if not raw.strip():
            return []
        try:
            turns = json.loads(raw)
        except ValueError:
            raise forms.ValidationError("The conversation could not be read: press New chat and start again.")
        if not isinstance(turns, list) or len(turns) > MAX_CHAT_TURNS:
            raise forms.ValidationError(f"A conversation holds at most {MAX_CHAT_TURNS} turns: press New chat.")
        history = []
        for turn in turns:
            if (
                not isinstance(turn, dict)
                or turn.get("role") not in ("user", "assistant")
                or not isinstance(turn.get("content"), str)
            ):
                raise forms.ValidationError("The conversation could not be read: press New chat and start again.")
            if turn["content"].strip():
                history.append((turn["role"], lf(turn["content"])))
        return history

    def _schema_named_in(self, pml: str) -> Schema | None:
        """The schema a PML prompt names (``<prompt schema="travel">``), when it is a known one."""
        found = SCHEMA_IN_PROMPT.search(pml or "")
        return visible_schemas(self.user).filter(name=found.group(1)).first() if found else None

    def clean(self):
        data = super().clean()
        if not data.get("devices") and not data.get("any_board") and "devices" not in self.errors:
            self.add_error("devices", "Tick the devices to run it on, or 'any board'.")
        source = data.get("source")
        if source == "chat":
            if "message" not in self.errors and not (data.get("message") or "").strip():
                self.add_error("message", "Write a message.")
            if len(data.get("devices") or ()) > 1:
                self.add_error("devices", "A chat talks to one board: tick one device (or 'any board').")
            turns = (
                [("system", data.get("system") or "")]
                + list(data.get("history") or [])
                + [("user", data.get("message") or "")]
            )
            if sum(len(content) for _, content in turns) > MAX_PROMPT_CHARS:
                self.add_error(
                    "message",
                    f"The conversation is over {MAX_PROMPT_CHARS:,} characters: press New chat to start another.",
                )
        elif source == "text":
            if "text" not in self.errors and not (data.get("text") or "").strip():
                self.add_error("text", "Write a prompt, or pick an MMLU question or a saved prompt.")
        elif source == "mmlu":
            topic, shots, number = data.get("topic"), data.get("shots"), data.get("question")
            if topic and shots is not None and number:
                try:
                    available = mmlu.target_count(topic, shots)
                except mmlu.UnknownTopic as exc:
                    available = None
                    self.add_error("topic", str(exc))
                if available is not None and number > available:
                    self.add_error(
                        "question",
                        f"{topic} has {available:,} questions at {shots} shots: choose a question from 1 to {available:,}.",
                    )
                    return data
                try:
                    data["mmlu_prompt"] = mmlu.build_prompts(topic, shots, 1, start=number - 1)[0]
                except (mmlu.UnknownTopic, ValueError) as exc:
                    self.add_error("question", str(exc))
            else:
                self.add_error("topic", "Choose a topic, a number of shots and a question.")
        elif source == "saved" and not data.get("saved_prompt"):
            self.add_error("saved_prompt", "Choose a saved prompt.")
        elif source == "pml":
            schema = data.get("schema") or self._schema_named_in(data.get("pml"))
            if schema is not None:
                data["schema"] = schema
            if "pml" in self.errors:
                pass  # too long: said already
            elif not schema:
                found = SCHEMA_IN_PROMPT.search(data.get("pml") or "")
                known = ", ".join(visible_schemas(self.user).values_list("name", flat=True)) or "none yet"
                if found:
                    self.add_error(
                        "schema",
                        f"The prompt names schema {found.group(1)!r}, which is not known (known: {known}): choose one.",
                    )
                else:
                    self.add_error(
                        "schema", f'Choose a schema, or name one in the prompt (<prompt schema="...">; known: {known}).'
                    )
            else:
                try:
                    parse_prompt(data.get("pml") or "", parse_schema(schema.source))
                except PMLError as exc:
                    self.add_error("pml", str(exc))
                foreign = [
                    device.name
                    for device in data.get("devices") or ()
                    if schema.namespace and device.namespace_id != schema.namespace
                ]
                if foreign:
                    self.add_error(
                        "schema",
                        f"Schema {schema.name!r} belongs to namespace {schema.namespace!r}: {', '.join(foreign)} may not run it.",
                    )
        self._check_boards_serve(data)
        if data.get("source") == "pml" and (data.get("strategy") or "exact") != "exact":
            self.add_error(
                "strategy", "A schema prompt is served from exact cached modules: choose the exact strategy for it."
            )
        return data

    def run_request(self) -> RunRequest:
        """What the form asks for, as the board's ``RunRequest`` (``dispatch_run`` gives each device its id)."""
        data = self.cleaned_data
        strategy = data.get("strategy") or "exact"
        common = dict(
            max_tokens=data["max_tokens"],
            namespace=data.get("namespace", ""),
            use_cache=data.get("use_cache", False),
            strategy="" if strategy == "exact" else strategy,
            sampling=self.sampling(),
        )
        if data["source"] == "chat":
            system = (data.get("system") or "").strip()
            messages = (
                ([("system", system)] if system else []) + list(data.get("history") or []) + [("user", data["message"])]
            )
            return asked_run(
                source="chat", title="Chat: " + " ".join(data["message"].split())[:74], messages=messages, **common
            )
        if data["source"] == "mmlu":
            prompt = data["mmlu_prompt"]
            title = f"MMLU {prompt.target.topic}, {len(prompt.examples)}-shot, question {data['question']}"
            return asked_run(
                prompt.segments, source="mmlu", title=title, expected_answer=prompt.target.answer, **common
            )
        if data["source"] == "pml":
            title = f"PML {data['schema'].name}: " + " ".join((data["pml"] or "").split())[:60]
            return asked_run(source="pml", title=title, schema=data["schema"].source, pml=data["pml"], **common)
        if data["source"] == "saved":
            saved = data["saved_prompt"]
            return asked_run(split_segments(lf(saved.text), saved.split_on), source="saved", title=saved.name, **common)
        text = data["text"]
        return asked_run(
            split_segments(text, data.get("split_on")), source="text", title=" ".join(text.split())[:80], **common
        )

    def sampling(self) -> dict:
        """The sampling controls as the run request's ``SamplingSpec`` takes them (empty fields: its defaults)."""
        data = self.cleaned_data
        chosen = {"temperature": data.get("temperature"), "top_p": data.get("top_p"), "seed": data.get("seed")}
        return {name: value for name, value in chosen.items() if value is not None}


class LoginForm(AuthenticationForm):
    """Django's login form, its refusal said once, in one sentence."""

    error_messages = {
        **AuthenticationForm.error_messages,
        "invalid_login": "Wrong username or password (both are case-sensitive): try again.",
    }


class ConfirmForm(forms.Form):
    confirm = forms.BooleanField(required=True, label="Yes, I am sure")


class ApiKeyForm(forms.Form):
    """A new API key: the namespace it reaches (one the user may manage), what it is for, its rate."""

    namespace = forms.ModelChoiceField(
        queryset=None, empty_label=None, help_text="the tenant whose boards (and cache entries) the key reaches"
    )
    name = forms.CharField(
        max_length=100, required=False, help_text="what it is for (shown in this list and in its runs' titles)"
    )
    rate_per_minute = forms.IntegerField(label="Requests per minute", min_value=0, required=False)

    def __init__(self, *args, namespaces, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields[
            "rate_per_minute"
        ].help_text = f"empty: EDGECACHE_API_RATE ({settings.EDGECACHE_API_RATE}); 0: no limit"
        self.fields["namespace"].queryset = namespaces
        self.fields["namespace"].to_field_name = "name"


def model_names() -> dict[str, str]:
    """{model fingerprint: model file name} as the boards report them in their heartbeats."""
    from django.db.models.fields.json import KeyTextTransform

    # The two keys read by the database, one row per pair: decoding every device's whole status
    # was most of the Cache page's time with 1,000 boards (it is read twice a page).
    pairs = (
        Device.objects.exclude(status={})
        .annotate(fingerprint=KeyTextTransform("fingerprint", "status"), model_file=KeyTextTransform("model", "status"))
        .filter(fingerprint__isnull=False, model_file__isnull=False)
        .values_list("fingerprint", "model_file")
        .order_by("fingerprint", "model_file")
        .distinct()
    )
    names = {}
    for fingerprint, model in pairs:
        if fingerprint and model:
            names.setdefault(fingerprint[:16], model)
    return names


def model_label(fingerprint: str, names: dict[str, str]) -> str:
    name = names.get(fingerprint)
    return f"{name} ({fingerprint})" if name else f"{fingerprint} (no board reports this model now)"


class FlushForm(forms.Form):
    """Flush by namespace and/or model, chosen from those the cache box holds (or any namespace
    that exists): a name typed wrong can no longer delete nothing without a word.

    It opens on the operator's current namespace (``current``); every namespace (every tenant's
    entries) is a choice of its own at the end of the list, and takes the words ``EVERY_WORDS``
    typed as well as the tick."""

    EVERY = "*"  # the namespace choice "every namespace" (no namespace name holds a '*')
    EVERY_WORDS = "every namespace"

    namespace = forms.ChoiceField(
        required=True,
        error_messages={"required": "Choose a namespace (or, at the end of the list, every namespace)."},
        help_text="opens on your current namespace; every namespace is the last choice",
    )
    model = forms.ChoiceField(required=False)
    confirm = forms.BooleanField(required=True, label="Yes, delete these entries")
    confirm_every = forms.CharField(
        required=False,
        max_length=40,
        label="To flush every namespace",
        help_text=f"type “{EVERY_WORDS}”: every tenant's entries are deleted",
        widget=forms.TextInput(attrs={"autocomplete": "off"}),
    )

    def __init__(self, *args, current: str | tuple[str, ...] = "", **kwargs):
        super().__init__(*args, **kwargs)

        held = set(CacheEntry.objects.values_list("namespace", flat=True).distinct())

        private = {  # boards that share nothing (Device.cache_namespace), read without their status
            private_namespace(namespace, name)
            for namespace, name in Device.objects.filter(namespace__share_across_devices=False).values_list(
                "namespace_id", "name"
            )
        }
        namespaces = sorted(held | private | set(Namespace.objects.values_list("name", flat=True)))
        self.fields["namespace"].choices = [
            (name, name if name in held else f"{name} (no entries)") for name in namespaces
        ] + [(self.EVERY, "every namespace (every tenant's entries)")]
        preferred = [name for name in ((current,) if isinstance(current, str) else current) if name in namespaces]
        self.fields["namespace"].initial = preferred[0] if preferred else (namespaces[0] if namespaces else None)
        names = model_names()
        models = sorted(set(CacheEntry.objects.values_list("model", flat=True).distinct()))
        self.fields["model"].choices = [("", "every model")] + [
            (fingerprint, model_label(fingerprint, names)) for fingerprint in models
        ]
        known = ", ".join(namespaces) or "none yet"
        self.fields["namespace"].error_messages["invalid_choice"] = (
            f"There is no namespace %(value)r here (known: {known}): choose one from the list."
        )
        self.fields["model"].error_messages["invalid_choice"] = (
            "The cache box holds no entry of model %(value)r: choose one from the list."
        )

    def clean(self):
        data = super().clean()
        if data.get("namespace") == self.EVERY:
            if (data.get("confirm_every") or "").strip().lower() != self.EVERY_WORDS:
                self.add_error(
                    "confirm_every",
                    f"Flushing every namespace deletes every tenant's entries: type “{self.EVERY_WORDS}” to confirm, "
                    "or choose one namespace.",
                )
            elif not data.get("model"):
                self.add_error(
                    "model",
                    "Flushing every namespace is done per model: choose one (or flush one namespace at a time).",
                )
            data["namespace"] = ""  # every namespace
        return data


class RunFilterForm(forms.Form):
    """The Runs page's filters (every one optional), over the runs its user may see."""

    device = forms.ChoiceField(required=False)
    namespace = forms.ChoiceField(required=False)
    case = forms.ChoiceField(required=False, choices=[("", "any")] + [(case.value, case.value) for case in Case])
    decision = forms.ChoiceField(
        required=False, choices=[("", "any")] + [(d.value, d.value) for d in Decision if d.value]
    )
    # How the run ended ("error" in the address, as before): a cancelled run is no failed one.
    error = forms.ChoiceField(
        required=False,
        choices=[("", "any"), ("no", "answered"), ("yes", "failed"), ("cancelled", "cancelled")],
        label="Outcome",
    )
    since = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        label=f"From ({settings.TIME_ZONE})",
    )
    until = forms.DateTimeField(
        required=False,
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format="%Y-%m-%dT%H:%M"),
        label=f"To ({settings.TIME_ZONE})",
    )
    q = forms.CharField(required=False, max_length=200, label="Prompt contains")

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        devices = list(visible_devices(user).order_by("name"))
        self.fields["device"].choices = [("", "any")] + [(d.name, d.name) for d in devices]
        self.fields["namespace"].choices = [("", "any")] + [(n, n) for n in sorted({d.namespace_id for d in devices})]

    def apply(self, runs):
        """``runs`` narrowed by the filters that are valid (an invalid one is shown, not applied)."""
        self.is_valid()
        data = getattr(self, "cleaned_data", {})
        if data.get("device"):
            runs = runs.filter(device__name=data["device"])
        if data.get("namespace"):
            runs = runs.filter(device__namespace_id=data["namespace"])
        if data.get("case"):
            runs = runs.filter(case=data["case"], error="")
        if data.get("decision"):
            runs = runs.filter(breakdown__decision=data["decision"])
        outcome = {"yes": FAILED, "no": ANSWERED, "cancelled": CANCELLED_RUNS}.get(data.get("error") or "")
        if outcome:
            runs = runs.filter(outcome_q(outcome))
        if data.get("since"):
            runs = runs.filter(created__gte=data["since"])
        if data.get("until"):
            runs = runs.filter(created__lte=data["until"])
        if data.get("q"):
            runs = runs.filter(pk__in=_runs_containing(runs, data["q"]))
        return runs


SEARCHED_RUNS = (
    5000  # newest runs a "prompt contains" search opens (prompts are sealed at rest: SQL cannot look inside)
)


def _runs_containing(runs, text: str) -> list[int]:
    """Ids of the newest ``SEARCHED_RUNS`` of ``runs`` whose prompt or title holds ``text`` (any case),
    read and opened in Python: the prompt column is sealed (dashboard.security.at_rest)."""
    wanted = text.casefold()
    newest = runs.order_by("-created").values_list("pk", "title", "prompt")[:SEARCHED_RUNS]
    return [
        pk for pk, title, prompt in newest if wanted in (title or "").casefold() or wanted in (prompt or "").casefold()
    ]
