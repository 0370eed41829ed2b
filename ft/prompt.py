"""PromptSpec: what one request's prompt is, from the HTTP edge to the tokenizer worker.

A route builds it once from its dialect's body; the engine's entry points (`open_request`,
`tokenize`) take it; the tokenizer actor hands it, unchanged, to a worker process, where
`ft.tokenizer.job.render_prompt` renders it. The codec (`ft.tokenizer.codec`) sends its fields
by name and rebuilds the record on the other side, so a new template option is a field here,
its parse in the schema that accepts it, and its use in the render: nothing in between.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ft.errors import InvalidRequest

__all__ = ["MAX_CACHE_SALT_LEN", "Message", "PromptSpec", "check_cache_salt"]

Message = dict[str, object]  # one chat message or tool definition, as chat templates read it
MAX_CACHE_SALT_LEN = 256


def check_cache_salt(salt: str) -> str:
    """Return `salt` if it is a valid `cache_salt` (1 to 256 printable characters).

    Raises:
        InvalidRequest: it is not (param `cache_salt`).
    """
    if not 1 <= len(salt) <= MAX_CACHE_SALT_LEN or not salt.isprintable():
        raise InvalidRequest(
            f"cache_salt must be 1 to {MAX_CACHE_SALT_LEN} printable characters", param="cache_salt"
        )
    return salt


def _length_prefixed(value: str | None) -> bytes:
    if value is None:
        return b"-"
    data = value.encode("utf-8", "surrogatepass")
    return b"%d:" % len(data) + data


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """A prompt: chat `messages` (rendered by the chat template), raw `text`, or `token_ids`.

    Exactly one of the three is given. `tools` and the template options apply to `messages`:
    `chat_template_kwargs` are the template's extra variables, `add_generation_prompt` opens
    the assistant's turn, `continue_final_message` renders the last (assistant) message open so
    the model continues it (Anthropic's prefill, vLLM's `continue_final_message`). Sequences
    given are stored as tuples.

    `tenant` (who sent it: the server's `ft.server.edge.tenants` id, None with one API key or
    none) and `cache_salt` (the request's own, vLLM's field) choose its prefix-cache partition,
    `cache_partition`: its pages are reused only by prompts of the same tenant and salt.

    Raises:
        InvalidRequest: not exactly one of messages, text or token_ids; a `cache_salt` that is
            not 1 to 256 printable characters.
    """

    messages: Sequence[Message] | None = None
    text: str | None = None
    token_ids: Sequence[int] | None = None
    tools: Sequence[Message] | None = None
    chat_template_kwargs: Mapping[str, object] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # `text` only: prepend the tokenizer's BOS where it adds one (False: the text's tokens alone,
    # as a reranker's pair is put together from its parts).
    add_bos: bool = True
    cache_salt: str | None = None
    tenant: str | None = None

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.messages, self.text, self.token_ids)) != 1:
            raise InvalidRequest("give exactly one of messages, prompt or prompt_token_ids")
        if self.cache_salt is not None:
            check_cache_salt(self.cache_salt)
        for name in ("messages", "token_ids", "tools"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, tuple):
                object.__setattr__(self, name, tuple(value))

    @property
    def is_chat(self) -> bool:
        """Whether the chat template renders it (it has messages)."""
        return self.messages is not None

    @property
    def param(self) -> str:
        """The request field a refusal of this prompt names: `messages` or `prompt`."""
        return "messages" if self.is_chat else "prompt"

    @property
    def cache_partition(self) -> bytes | None:
        """The prefix-cache partition its pages belong to (`ft.core.kv.partition_root`'s salt):
        None, the shared partition, when neither a tenant nor a salt is set; else the two,
        length-prefixed so that no other pair gives the same bytes."""
        if self.tenant is None and self.cache_salt is None:
            return None
        return b"ft-partition:" + _length_prefixed(self.tenant) + _length_prefixed(self.cache_salt)
