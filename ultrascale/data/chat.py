"""Conversations for supervised fine-tuning: the model's own chat template, the loss on the assistant's turns.

A record is a conversation: ``{"messages": [{"role", "content"}, ...]}`` (roles ``system``, ``user``,
``assistant``, ``tool``), or TRL's conversational prompt-completion form, ``{"prompt": [...], "completion":
[...]}`` (both message lists; only the completion's assistant turns are learned). It is rendered and tokenized
by ``tokenizer.apply_chat_template`` exactly as TRL's ``SFTTrainer`` does (``tokenize=True``, no special tokens
added beyond the template's own), so the token ids are the ones the model is prompted with at inference.

Which tokens are learned:

* A template that marks generations (``{% generation %}`` ... ``{% endgeneration %}``): transformers'
  ``return_assistant_tokens_mask``, the tokens inside the markers. This is TRL's ``assistant_only_loss``.
* A template without markers: rendering the conversation's prefixes. With ``T(k)`` the tokens of turns
  ``0..k`` rendered alone and ``G(k)`` those of turns ``0..k-1`` with the generation prompt, assistant turn
  ``k`` is ``T(k)[len(G(k)):]`` (its header, the generation prompt, is not learned), provided every ``T(k)``
  and ``G(k)`` is a prefix of the whole conversation's tokens. A template for which that does not hold (one that
  renders earlier turns differently once later ones follow, or whose tokens merge across a turn boundary) is
  refused, naming the record: which tokens are the assistant's cannot be told, and is never guessed.
  What the template writes after a turn's end-of-turn token (ChatML's newline) belongs to no turn.

The end-of-turn token (``end_of_turn``, by default the tokenizer's EOS) is learned with its turn unless
``learn_end_of_turn=False``. ``learn="last"`` keeps the last assistant turn only; ``learn="all"`` every token.

A conversation longer than ``seq_len + 1`` tokens is cut after its last assistant turn that fits (whole turns
dropped from the end), or refused with ``truncation="error"``; one left without a learned token is skipped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ultrascale.data.errors import DataError

__all__ = ["LEARN", "ROLES", "TRUNCATION", "ChatEncoder", "Conversation", "conversation_of", "resolve_chat_template"]

ROLES = ("system", "user", "assistant", "tool")
LEARN = ("assistant", "last", "all")
"""Which tokens carry a loss: every assistant turn; the last assistant turn; every token of the conversation."""
TRUNCATION = ("drop_turns", "error")

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Conversation:
    """One record's messages, checked."""

    messages: list[dict[str, Any]]
    first_learned: int
    """Index of the first message whose assistant turns may be learned: 0, or the prompt's length in TRL's
    prompt-completion form (the prompt's own assistant turns are context)."""
    where: str
    """``FILE:LINE`` or ``FOLDER row N``: where the record is, for every message about it."""


def conversation_of(record: dict[str, Any], messages_field: str, where: str) -> Optional[Conversation]:
    """The record's conversation; None where it is not one (no `messages_field`, no message-list prompt and
    completion). ValueError naming `where` and the field for a malformed one."""
    if messages_field in record:
        messages = _messages(record[messages_field], messages_field, where)
        return Conversation(messages, 0, where)
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        head = _messages(prompt, "prompt", where, allow_empty=True)
        tail = _messages(completion, "completion", where)
        return Conversation(head + tail, len(head), where)
    return None


def _messages(value: Any, field: str, where: str, allow_empty: bool = False) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise DataError(f"{where}: field `{field}` must be a list of {{\"role\", \"content\"}} messages, got "
                         f"{type(value).__name__}")
    if not value and not allow_empty:
        raise DataError(f"{where}: field `{field}` is an empty conversation")
    for i, message in enumerate(value):
        at = f"{where}: field `{field}[{i}]`"
        if not isinstance(message, dict):
            raise DataError(f"{at} must be a {{\"role\", \"content\"}} object, got {type(message).__name__}")
        for key in ("role", "content"):
            if key not in message:
                raise DataError(f"{at} has no `{key}`; keys present: {sorted(message)}")
        if message["role"] not in ROLES:
            raise DataError(f"{at}.role is {message['role']!r}; known roles: {', '.join(ROLES)}")
        if not isinstance(message["content"], str):
            raise DataError(f"{at}.content must be a string, got {type(message['content']).__name__}")
    return list(value)


def resolve_chat_template(given: Optional[str], tokenizer: Any, tokenizer_path: str) -> str:
    """The Jinja template to render with: `given` (the text, or a file holding it), else the tokenizer's own."""
    if given is not None:
        if "{%" in given or "{{" in given:
            return given
        path = Path(given)
        if not path.is_file():
            raise FileNotFoundError(f"`chat_template={given!r}` is neither a Jinja template (no {{% or {{{{ in it) "
                                    "nor a file")
        return path.read_text(encoding="utf-8")
    own = getattr(tokenizer, "chat_template", None)
    if isinstance(own, dict):  # several named templates: transformers renders the "default" one
        own = own.get("default")
    if not own:
        raise ValueError(f"the tokenizer in `tokenizer_path={tokenizer_path!r}` has no chat template (a base model's): "
                         "give one with `chat_template:` (the Jinja text, or a file holding it)")
    return own


@dataclass
class ChatCounts:
    """What encoding did to the conversations, for one warning."""

    cut: int = 0
    """Conversations longer than ``seq_len + 1`` tokens whose last turns were dropped."""
    skipped: int = 0
    """Conversations without a learned token once cut (or at all)."""


class ChatEncoder:
    """Conversations into ``(ids, learned)``: token ids and, per id, whether it is a target.

    Args:
        tokenizer: a transformers tokenizer (fast, where the template has generation markers).
        template: the Jinja chat template's text.
        max_ids: ids a conversation may keep (``seq_len + 1``: the inputs are ``ids[:-1]``).
        learn: one of :data:`LEARN`.
        learn_end_of_turn: whether the end-of-turn ids inside a learned turn are learned.
        end_of_turn: the end-of-turn token's text; None: the tokenizer's EOS.
        truncation: one of :data:`TRUNCATION`.
    """

    def __init__(self, tokenizer: Any, template: str, max_ids: int, *, learn: str = "assistant",
                 learn_end_of_turn: bool = True, end_of_turn: Optional[str] = None,
                 truncation: str = "drop_turns") -> None:
        if learn not in LEARN:
            raise ValueError(f"`learn={learn!r}` must be one of {', '.join(LEARN)}")
        if truncation not in TRUNCATION:
            raise ValueError(f"`truncation={truncation!r}` must be one of {', '.join(TRUNCATION)}")
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError(f"conversations need a fast tokenizer (a tokenizer.json: its offsets place each turn's "
                             f"tokens); {type(tokenizer).__name__} is not one")
        self.tokenizer = tokenizer
        self.template = template
        self.max_ids = max_ids
        self.learn = learn
        self.learn_end_of_turn = learn_end_of_turn
        self.truncation = truncation
        self.marked = bool(_GENERATION_MARKER.search(template))
        """The template marks generations: transformers' assistant mask is the answer."""
        token = end_of_turn if end_of_turn is not None else tokenizer.eos_token
        if token is None:
            raise ValueError("the tokenizer has no EOS token: name the template's end-of-turn token with `end_of_turn:`")
        ids = tokenizer.convert_tokens_to_ids([token])
        if not ids or ids[0] is None or ids[0] == tokenizer.unk_token_id:
            raise ValueError(f"`end_of_turn={token!r}` is not a token of the tokenizer")
        self.end_of_turn_id = int(ids[0])
        self.counts = ChatCounts()

    # ------------------------------------------------------------------ rendering

    def _render(self, conversation: Conversation, messages: Sequence[dict[str, Any]], *, tokenize: bool,
                generation_prompt: bool = False, assistant_mask: bool = False) -> Any:
        try:
            return self.tokenizer.apply_chat_template(
                list(messages), chat_template=self.template, tokenize=tokenize, return_dict=tokenize,
                add_generation_prompt=generation_prompt, return_assistant_tokens_mask=assistant_mask,
            )
        except Exception as error:  # jinja's TemplateError, raise_exception() in the template, a missing key
            raise DataError(f"{conversation.where}: the chat template failed to render this conversation "
                             f"({type(error).__name__}: {error})") from None

    def _turn_spans(self, conversation: Conversation, text: str, token_starts: np.ndarray) -> list[tuple[int, int, int]]:
        """``(start, stop, message index)``: each message's tokens, from rendering the conversation's prefixes as
        text. Turn k's characters are what rendering turns 0..k adds to 0..k-1 (to 0..k-1 and the generation prompt,
        for an assistant turn); its tokens those that start among them, so a token merged across the boundary
        belongs to the turn it starts in. ValueError naming the record where a prefix is not the head of the whole."""
        spans, stop = [], 0
        messages = conversation.messages
        for k, message in enumerate(messages):
            start = stop
            if message["role"] == "assistant" and k:
                prompt = self._render(conversation, messages[:k], tokenize=False, generation_prompt=True)
                self._check_prefix(conversation, text, prompt, k, "its generation prompt")
                start = max(start, len(prompt))
            head = text if k == len(messages) - 1 else self._render(conversation, messages[: k + 1], tokenize=False)
            self._check_prefix(conversation, text, head, k, "the turns before it")
            stop = len(head)
            spans.append((start, stop, k))
        return [(int(np.searchsorted(token_starts, a)), int(np.searchsorted(token_starts, b)), k) for a, b, k in spans]

    def _check_prefix(self, conversation: Conversation, text: str, head: str, k: int, what: str) -> None:
        if not text.startswith(head):
            role = conversation.messages[k]["role"]
            raise DataError(
                f"{conversation.where}: the chat template does not render message {k} ({role}) with {what} as the "
                "start of the whole conversation (it renders earlier turns differently once later ones follow), so "
                "which tokens are the assistant's cannot be told by rendering prefixes; use a template that marks "
                "them with {% generation %} ... {% endgeneration %}"
            )

    # ------------------------------------------------------------------ encoding

    def assistant_tokens(self, conversation: Conversation) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, assistant)``: the conversation's token ids (int32, whole) and, per id, whether it belongs to an
        assistant turn that may be learned (from `first_learned` on), its end-of-turn token included. What
        :func:`learned_tokens` cuts and selects from; what `prepare-data` stores."""
        messages = conversation.messages
        if self.marked and not conversation.first_learned:
            whole = self._render(conversation, messages, tokenize=True, assistant_mask=True)
            return np.asarray(whole["input_ids"], dtype=np.int32), np.asarray(whole["assistant_masks"], dtype=bool)
        # apply_chat_template(tokenize=True)'s tokens: the rendered text, no special tokens added.
        text = self._render(conversation, messages, tokenize=False)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        starts = np.asarray([a for a, _ in encoded["offset_mapping"]], dtype=np.int64).reshape(-1)
        assistant = np.zeros(ids.size, dtype=bool)
        if self.marked:  # TRL's prompt-completion form: the template's marks, after the prompt
            marked = self._render(conversation, messages, tokenize=True, assistant_mask=True)["assistant_masks"]
            prompt = self._render(conversation, messages[: conversation.first_learned], tokenize=False,
                                  generation_prompt=True)
            self._check_prefix(conversation, text, prompt, conversation.first_learned, "its generation prompt")
            assistant[:] = np.asarray(marked, dtype=bool)
            assistant[: int(np.searchsorted(starts, len(prompt)))] = False
            return ids, assistant
        for start, stop, k in self._turn_spans(conversation, text, starts):
            if messages[k]["role"] != "assistant" or k < conversation.first_learned:
                continue
            ends = np.flatnonzero(ids[start:stop] == self.end_of_turn_id)
            # What the template writes after the turn's end-of-turn token is no one's answer.
            assistant[start : start + int(ends[-1]) + 1 if ends.size else stop] = True
        return ids, assistant

    def encode(self, conversation: Conversation) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """``(ids, learned)`` int32 / bool arrays of one conversation, cut to `max_ids`; None where nothing is
        left to learn (counted in `counts`)."""
        ids, assistant = self.assistant_tokens(conversation)
        return self.learned(ids, assistant, conversation.where)

    def learned(self, ids: np.ndarray, assistant: np.ndarray, where: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
        """:func:`learned_tokens` with this encoder's options, counted."""
        out = learned_tokens(ids, assistant, max_ids=self.max_ids, learn=self.learn,
                             learn_end_of_turn=self.learn_end_of_turn, end_of_turn_id=self.end_of_turn_id,
                             truncation=self.truncation, where=where)
        self.counts.cut += len(ids) > self.max_ids
        self.counts.skipped += out is None
        return out


def learned_tokens(ids: np.ndarray, assistant: np.ndarray, *, max_ids: int, learn: str, learn_end_of_turn: bool,
                   end_of_turn_id: int, truncation: str, where: str) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """``(ids, learned)`` of a conversation with assistant mask `assistant` (:meth:`ChatEncoder.assistant_tokens`):
    cut after its last assistant turn that ends within `max_ids` ids where it is longer (ValueError naming `where`
    under ``truncation="error"``), then the `learn` selection; None where no target is left."""
    edges = np.diff(np.concatenate([[0], assistant.astype(np.int8), [0]]))
    run_starts, run_ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)  # assistant turns: [start, end)
    if ids.size > max_ids:
        if truncation == "error":
            raise DataError(f"{where}: the conversation is {ids.size} tokens, more than `seq_len + 1 = {max_ids}` "
                             "(`truncation=\"error\"`)")
        fits = run_ends[run_ends <= max_ids]
        if not fits.size:
            return None
        ids, assistant = ids[: fits[-1]], assistant[: fits[-1]]
        run_starts = run_starts[run_starts < fits[-1]]
    learned = np.ones(ids.size, dtype=bool) if learn == "all" else assistant.copy()
    if learn == "last" and run_starts.size:
        learned[: run_starts[-1]] = False
    if not learn_end_of_turn:
        learned &= ids != end_of_turn_id
    if not learned[1:].any():  # the first token is never a target
        return None
    return ids, learned
