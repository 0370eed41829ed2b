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

__all__ = ["Message", "PromptSpec"]

Message = dict[str, object]  # one chat message or tool definition, as chat templates read it


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """A prompt: chat `messages` (rendered by the chat template), raw `text`, or `token_ids`.

    Exactly one of the three is given. `tools` and the template options apply to `messages`:
    `chat_template_kwargs` are the template's extra variables, `add_generation_prompt` opens
    the assistant's turn, `continue_final_message` renders the last (assistant) message open so
    the model continues it (Anthropic's prefill, vLLM's `continue_final_message`). Sequences
    given are stored as tuples.

    Raises:
        InvalidRequest: not exactly one of messages, text or token_ids.
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

    def __post_init__(self) -> None:
        if sum(x is not None for x in (self.messages, self.text, self.token_ids)) != 1:
            raise InvalidRequest("give exactly one of messages, prompt or prompt_token_ids")
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
