"""Chat messages to prompt tokens, on the board, through the model's own chat template.

The template (llama.cpp's, ``Vocabulary.render_chat``) is rendered with a sentinel in place of
each message's text, so what comes back splits into the template's own markup and the
places where the messages go. The markup is tokenized with its control tokens
(``<start_of_turn>`` and the like, ``special=True``); what a person wrote is tokenized as plain
text (``special=False``), so a message that contains ``<start_of_turn>`` stays text and cannot
open a turn of its own. A template that refuses a system message (some have no system role)
gets it folded into the first user turn.

Pure apart from the tokenizer: ``chat_prompt(vocabulary, messages)``, and ``follow_up`` for the
prefix a conversation's next turn will share (the board prepares it after each answer, while
``FollowUps`` sees its clients take such prefixes up).
"""

from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass
from typing import Sequence

from inference.engine.llama import Vocabulary
from inference.serving.run import Prompt, PromptError

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the rendered conversation, as a person reads it (the run's recorded prompt)
    tokens: list[int]  # what the model sees: BOS, markup with its control tokens, messages as text
    starts: tuple[int, ...] = ()  # where each message's text begins, in tokens

    @property
    def cuts(self) -> tuple[int, ...]:
        """Where prefills end a batch besides the grid: where each message after the first begins.
        A turn's prompt ends where the next turn's answer begins, so the next turn resumes from it
        (and from the answer, ``follow_up``) after the very batches its cold run computes."""
        return self.starts[1:]

    @property
    def prompt(self) -> Prompt:
        """What a strategy runs: the tokens, cut where the turns begin (the text for the record)."""
        return Prompt((self.text,), tuple(self.tokens), self.cuts)


def chat_prompt(
    vocabulary: Vocabulary, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True
) -> ChatPrompt:
    """The tokens of ``messages`` (role, content) through the model's chat template, ready for
    ``Board.run(text, tokens=...)``. Raises PromptError saying what to change."""
    pieces = _pieces(vocabulary, messages, add_generation_prompt)
    tokens = [vocabulary.bos] if vocabulary.bos is not None else []
    starts: list[int] = []
    for markup, text in pieces:
        if not markup:
            starts.append(len(tokens))
        if text:
            tokens += vocabulary.tokenize(text, add_bos=False, special=markup)
    return ChatPrompt(text="".join(text for _, text in pieces), tokens=tokens, starts=tuple(starts))


def chat_text(vocabulary: Vocabulary, messages: Sequence[tuple[str, str]]) -> str:
    """The text ``chat_prompt`` records for ``messages``, without tokenizing them (a board given
    their tokens, ``RunRequest.tokenized``)."""
    return "".join(text for _, text in _pieces(vocabulary, messages, True))


def _pieces(
    vocabulary: Vocabulary, messages: Sequence[tuple[str, str]], add_generation_prompt: bool
) -> list[tuple[bool, str]]:
    """The template's markup and the messages' text, in the order the template placed them."""
    if not messages:
        raise PromptError("the conversation is empty: send at least one message")
    for role, content in messages:
        if role not in ROLES:
            raise PromptError(f"unknown role {role!r}: use one of {', '.join(ROLES)}")
        if not content.strip():
            raise PromptError(f"a {role} message is empty: give it some text")
    # Templates trim what they place (Gemma's does); trimming here keeps text and tokens alike.
    contents = [content.strip() for _, content in messages]
    marker = f"\u2063EC{secrets.token_hex(6)}:"  # no message can contain a fresh random marker
    sentinels = [f"{marker}{index}\u2063" for index in range(len(messages))]
    rendered = _render(
        vocabulary, [(role, sentinel) for (role, _), sentinel in zip(messages, sentinels)], add_generation_prompt
    )

    # Markup, message, markup, message, ..., markup: in the order the template placed them.
    pieces: list[tuple[bool, str]] = []  # (is the template's markup, text)
    rest = rendered
    for index, sentinel in enumerate(sentinels):
        before, found, rest = rest.partition(sentinel)
        if not found:
            raise PromptError(
                f"the model's chat template dropped or reordered message {index} ({messages[index][0]}); send the conversation as system, user and assistant turns"
            )
        pieces += [(True, before), (False, contents[index])]
    pieces.append((True, rest))
    if marker in rest or any(marker in text for markup, text in pieces if markup):
        raise PromptError("the model's chat template repeated a message; send each message once")
    return pieces


def follow_up(vocabulary: Vocabulary, messages: Sequence[tuple[str, str]], answer: str) -> ChatPrompt | None:
    """The prefix every next turn of this conversation shares: ``messages``, the ``answer`` as the
    client sends it back, and the markup that opens the next user message (None when there is
    no answer to keep, or the template will not have it)."""
    if not answer.strip():
        return None
    try:
        whole = chat_prompt(vocabulary, [*messages, ("assistant", answer), ("user", "?")], add_generation_prompt=False)
    except PromptError:
        return None
    end = whole.starts[-1]
    return ChatPrompt(text="", tokens=whole.tokens[:end], starts=whole.starts[:-1])


def _render(vocabulary: Vocabulary, messages: list[tuple[str, str]], add_generation_prompt: bool) -> str:
    rendered = vocabulary.render_chat(messages, add_generation_prompt)
    if rendered is not None:
        return rendered
    if any(role == "system" for role, _ in messages):
        rendered = vocabulary.render_chat(fold_system(messages), add_generation_prompt)
        if rendered is not None:
            return rendered
    raise PromptError(
        "the model's chat template refuses this conversation; alternate user and assistant turns, starting with a user message"
    )


def fold_system(messages: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The conversation without system turns: their text opens the first user turn (what
    llama.cpp's own Gemma template does). A conversation with no user turn gets one."""
    system = "\n\n".join(content for role, content in messages if role == "system")
    rest = [(role, content) for role, content in messages if role != "system"]
    if not system:
        return rest
    for index, (role, content) in enumerate(rest):
        if role == "user":
            rest[index] = (role, f"{system}\n\n{content}")
            return rest
    return [("user", system), *rest]


class FollowUps:
    """Whether preparing a conversation's next turn pays on this board (pure).

    Preparing it costs the board one batch (40 to 80 ms here) right after an answer; a run that
    arrives meanwhile waits for it. That pays when the conversation goes on. A client that sends
    one question after another under the same system prompt never continues one, and each of its
    requests would wait behind the last one's preparation (``bench vs-server``, one board warm).
    So the board remembers each answered chat turn's next prefix, prepared (``prepared``) or only
    watched (``watched``: its tokens, no model work), and looks at each chat run it serves: one that
    goes on from such a prefix takes it up; a prefix no run took up within ``EXPIRE_RUNS`` chat
    runs (conversations interleave) was wasted. While the last outcomes are all wasted, the board
    prepares nothing and watches instead, so a client that turns to real conversations is seen at
    its first next turn without a preparation spent to find out.
    """

    EXPIRE_RUNS = 4
    OUTCOMES = 4  # the last outcomes that decide

    def __init__(self) -> None:
        self.pending: deque[list] = deque(maxlen=8)  # [length, key, runs seen since]
        self.outcomes: deque[bool] = deque(maxlen=self.OUTCOMES)

    @staticmethod
    def _key(tokens: Sequence[int]) -> int:
        return hash(tuple(tokens))

    def prepared(self, tokens: Sequence[int]) -> None:
        """The board prepared this prefix (a conversation's next turn)."""
        if tokens:
            self.pending.append([len(tokens), self._key(tokens), 0])

    def watched(self, tokens: Sequence[int]) -> None:
        """The board did not prepare this next turn's prefix: whether a run goes on from it counts
        all the same (the outcome that says whether preparing would have paid)."""
        self.prepared(tokens)

    def saw(self, tokens: Sequence[int]) -> None:
        """A chat run of these tokens arrived: it takes up a prefix it goes on from."""
        for entry in list(self.pending):
            length, key, seen = entry
            if len(tokens) >= length and self._key(tokens[:length]) == key:
                self.outcomes.append(True)
                self.pending.remove(entry)
            elif seen + 1 >= self.EXPIRE_RUNS:
                self.outcomes.append(False)
                self.pending.remove(entry)
            else:
                entry[2] = seen + 1

    def worth_preparing(self) -> bool:
        """Prepare the next turn now? Yes while any of the last outcomes was taken up, or too few
        are known; else it is only watched."""
        return len(self.outcomes) < 2 or any(self.outcomes)
