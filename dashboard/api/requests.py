"""The body of an API request, checked field by field: a bad one is a 400 naming the field.

Fields follow OpenAI's chat and completions APIs; what EdgeCache cannot do (more than one
choice, tools, log probabilities, ...) is refused with the reason rather than ignored. The
extension object ``edgecache`` chooses a board (``device``) or runs a PML prompt against a
stored schema (``schema`` + ``pml``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from django.conf import settings

from inference.contract.messages import MAX_PROMPT_CHARS, MAX_STOP_CHARS, MAX_STOPS, MAX_TOKENS

from .errors import ApiError, bad_request

ROLES = ("system", "user", "assistant")
_ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role

# Accepted only at their "off" value: anything else asks for what EdgeCache does not do.
_UNSUPPORTED = {
    "tools": "tools (function calling)",
    "tool_choice": "tools (function calling)",
    "functions": "function calling",
    "function_call": "function calling",
    "parallel_tool_calls": "tools (function calling)",
    "logprobs": "log probabilities",
    "top_logprobs": "log probabilities",
    "logit_bias": "logit bias",
    "audio": "audio output",
    "prediction": "predicted outputs",
    "presence_penalty": "presence penalties",
    "frequency_penalty": "frequency penalties",
    "echo": "echoing the prompt",
    "suffix": "suffixes",
    "web_search_options": "web search",
}
_OFF = (None, False, 0, 0.0, [], {}, "")


@dataclass
class ApiRequest:
    kind: str  # "chat" or "completion"
    model: str
    messages: list[dict] = field(default_factory=list)  # [{"role", "content"}] (chat)
    prompt: str = ""  # (completion)
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    user: str = ""
    prompt_cache_key: str = ""
    device: str = ""  # edgecache.device
    schema: str = ""  # edgecache.schema (a stored schema's name)
    pml: str = ""  # edgecache.pml
    strategy: str = ""  # edgecache.strategy: a lab strategy (approximate), e.g. "kv-prediction:6"
    use_cache: bool = (
        True  # edgecache.cache: false runs it cold (no cache tier read or written), to check answers against
    )

    @property
    def prompt_param(self) -> str:
        """The field a prompt error names."""
        if self.pml:
            return "edgecache.pml"
        return "messages" if self.kind == "chat" else "prompt"

    @property
    def snippet(self) -> str:
        """A few words of the prompt, for the run's title."""
        if self.pml:
            text = self.pml
        elif self.messages:
            text = self.messages[-1]["content"]
        else:
            text = self.prompt
        return " ".join(text.split())[:80]


MAX_JSON_DEPTH = 32  # OpenAI's bodies nest a few levels; deeper is refused before anything walks it


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"")
    except RecursionError:
        raise bad_request(
            f"The request body nests too deeply (more than {MAX_JSON_DEPTH} levels); send OpenAI's request shape."
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(
            f"The request body is not valid JSON ({exc}); send a JSON object with Content-Type: application/json."
        ) from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(body).__name__}.")
    if json_depth(body) > MAX_JSON_DEPTH:
        raise bad_request(
            f"The request body nests too deeply (more than {MAX_JSON_DEPTH} levels); send OpenAI's request shape."
        )
    return body


def json_depth(value) -> int:
    """How deeply ``value`` (parsed JSON) nests lists and objects; iterative, so any depth is safe."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_request(body: dict, kind: str) -> ApiRequest:
    """An ``ApiRequest`` from a chat (``kind="chat"``) or completions body; ApiError(400) naming the bad field."""
    for name, what in _UNSUPPORTED.items():
        value = body.get(name)
        if value not in _OFF:
            raise bad_request(
                f"EdgeCache does not support {what} ('{name}'); leave it out.", param=name, code="unsupported_parameter"
            )
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise bad_request(
            'EdgeCache answers plain text only: leave \'response_format\' out or set it to {"type": "text"}.',
            param="response_format",
            code="unsupported_parameter",
        )
    modalities = body.get("modalities")
    if modalities not in (None, ["text"]):
        raise bad_request(
            "EdgeCache answers text only: leave 'modalities' out or set it to [\"text\"].",
            param="modalities",
            code="unsupported_parameter",
        )
    n = _int(body, "n", 1, None, default=1)
    if n != 1:
        raise bad_request(
            f"'n' must be 1: EdgeCache returns one choice per request (got {n}); send {n} requests for {n} answers.",
            param="n",
        )
    best_of = _int(body, "best_of", 1, None, default=1)
    if best_of != 1:
        raise bad_request("'best_of' must be 1: EdgeCache returns one choice per request.", param="best_of")

    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise bad_request("'model' is required: GET /v1/models lists the models of your online boards.", param="model")
    request = ApiRequest(kind=kind, model=model.strip())

    extension = body.get("edgecache")
    if extension is not None:
        if not isinstance(extension, dict):
            raise bad_request(
                '\'edgecache\' must be an object such as {"device": "NAME"} or {"schema": "NAME", "pml": "<prompt ...>"}.',
                param="edgecache",
            )
        unknown = sorted(set(extension) - {"device", "schema", "pml", "strategy", "cache"})
        if unknown:
            raise bad_request(
                f"Unknown field 'edgecache.{unknown[0]}': the extension takes device, schema, pml, strategy and cache.",
                param=f"edgecache.{unknown[0]}",
            )
        request.use_cache = extension.get("cache") is None or _bool(extension, "cache", "edgecache.cache")
        request.strategy = _str(extension, "strategy", "edgecache.strategy", 64)
        request.device = _str(extension, "device", "edgecache.device", 64)
        request.schema = _str(extension, "schema", "edgecache.schema", 64)
        request.pml = _str(extension, "pml", "edgecache.pml", MAX_PROMPT_CHARS)
        if bool(request.schema) != bool(request.pml):
            raise bad_request(
                "A PML run needs both 'edgecache.schema' (a stored schema's name) and 'edgecache.pml' (the <prompt>).",
                param="edgecache.schema" if not request.schema else "edgecache.pml",
            )

    if kind == "chat":
        request.messages = _messages(body.get("messages"), allow_empty=bool(request.pml))
    else:
        request.prompt = _prompt(body.get("prompt"), allow_empty=bool(request.pml))

    limit = _int(body, "max_completion_tokens", 1, MAX_TOKENS, default=None)
    if limit is None:
        limit = _int(body, "max_tokens", 1, MAX_TOKENS, default=None)
    request.max_tokens = limit if limit is not None else min(settings.EDGECACHE_API_MAX_TOKENS, MAX_TOKENS)
    request.temperature = _number(body, "temperature", 0.0, 2.0, default=1.0)
    request.top_p = _number(body, "top_p", 0.0, 1.0, default=1.0, open_low=True)
    request.seed = _int(body, "seed", 0, 2**63 - 1, default=None)
    request.stop = _stop(body.get("stop"))
    request.stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise bad_request(
                "'stream_options' must be an object such as {\"include_usage\": true}.", param="stream_options"
            )
        request.include_usage = _bool(options, "include_usage", "stream_options.include_usage")
    request.user = _str(body, "user", "user", 256)
    request.prompt_cache_key = _str(body, "prompt_cache_key", "prompt_cache_key", 256)
    return request


def _messages(value, *, allow_empty: bool) -> list[dict]:
    if value is None and allow_empty:
        return []
    if not isinstance(value, list):
        raise bad_request('\'messages\' must be a list of {"role", "content"} objects.', param="messages")
    if not value:
        if allow_empty:
            return []
        raise bad_request(
            '\'messages\' is empty: send at least one message, e.g. [{"role": "user", "content": "Hello"}].',
            param="messages",
        )
    if allow_empty:
        raise bad_request(
            "A PML run takes its prompt from 'edgecache.pml': send 'messages' as [] or leave it out.", param="messages"
        )
    messages = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise bad_request(f"'{where}' must be an object with 'role' and 'content'.", param=where)
        role = _ROLE_ALIASES.get(message.get("role"), message.get("role"))
        if role not in ROLES:
            raise bad_request(
                f"'{where}.role' must be one of {', '.join(ROLES)} (got {message.get('role')!r}); EdgeCache has no tools.",
                param=f"{where}.role",
            )
        content = _content(message.get("content"), f"{where}.content")
        if not content.strip():
            raise bad_request(f"'{where}.content' is empty: every message needs some text.", param=f"{where}.content")
        messages.append({"role": role, "content": content})
    if sum(len(message["content"]) for message in messages) > MAX_PROMPT_CHARS:
        raise bad_request(f"The messages are over {MAX_PROMPT_CHARS} characters.", param="messages")
    return messages


def _content(value, where: str) -> str:
    """A message's text: a string, or a list of text parts (other parts are refused)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(
                    f'\'{where}[{index}]\' must be a text part {{"type": "text", "text": ...}}: EdgeCache\'s models read text only.',
                    param=f"{where}[{index}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"'{where}' must be a string (or a list of text parts).", param=where)


def _prompt(value, *, allow_empty: bool) -> str:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if value is None or value == "":
        if allow_empty:
            return ""
        raise bad_request("'prompt' is required: send the text to complete.", param="prompt")
    if allow_empty:
        raise bad_request("A PML run takes its prompt from 'edgecache.pml': leave 'prompt' out.", param="prompt")
    if not isinstance(value, str):
        raise bad_request(
            "'prompt' must be one string (EdgeCache completes one prompt per request, and takes no token ids).",
            param="prompt",
        )
    if not value.strip():
        raise bad_request("'prompt' is empty: send the text to complete.", param="prompt")
    if len(value) > MAX_PROMPT_CHARS:
        raise bad_request(f"'prompt' is over {MAX_PROMPT_CHARS} characters.", param="prompt")
    return value


def _stop(value) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(stop, str) for stop in stops):
        raise bad_request("'stop' must be a string or a list of strings.", param="stop")
    if len(stops) > MAX_STOPS:
        raise bad_request(f"'stop' takes at most {MAX_STOPS} strings.", param="stop")
    for stop in stops:
        if not stop or len(stop) > MAX_STOP_CHARS:
            raise bad_request(f"Each stop string has 1 to {MAX_STOP_CHARS} characters.", param="stop")
    return stops


def _int(body: dict, name: str, low: int, high: int | None, *, default):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer.", param=name)
    if value < low or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise bad_request(f"'{name}' must be {bounds} (got {value}).", param=name)
    return value


def _number(body: dict, name: str, low: float, high: float, *, default: float, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number.", param=name)
    if value > high or value < low or (open_low and value == low):
        raise bad_request(
            f"'{name}' must be {'above' if open_low else 'at least'} {low:g} and at most {high:g} (got {value:g}).",
            param=name,
        )
    return float(value)


def _bool(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"'{param or name}' must be true or false.", param=param or name)
    return value


def _str(body: dict, name: str, param: str, max_length: int) -> str:
    value = body.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise bad_request(f"'{param}' must be a string.", param=param)
    if len(value) > max_length:
        raise bad_request(f"'{param}' is over {max_length} characters.", param=param)
    return value


__all__ = ["ApiError", "ApiRequest", "parse_body", "parse_request"]
