"""The output policy of a generation request, decided once for every API.

Each API translates its own spelling of tools, `tool_choice` and the answer format into a
`PromptSpec` (with every tool it defines), a `ToolChoice` and a `GrammarSpec`; `output_policy`
then decides what the chat template sees (`apply_tool_choice`), what the output must follow
(`output_grammar`) and how it is read back (the tool-call and reasoning parsers); once the
prompt is rendered, `OutputPolicy.output_format` says whether its output begins inside a
reasoning block the template opened.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ft.core.reasoning import REASONING_TAGS, reasoning_left_open
from ft.errors import InvalidRequest
from ft.grammar.spec import GrammarSpec
from ft.prompt import PromptSpec
from ft.server.generation.assemble import OutputFormat
from ft.server.generation.context import ServerContext
from ft.server.generation.structured import reasoning_parser_name
from ft.server.generation.tools import ToolChoice, apply_tool_choice, output_grammar, tool_call_parser_name


@dataclass(frozen=True, slots=True)
class OutputPolicy:
    """What one request renders, what its output must follow, and how the output is parsed."""

    prompt: PromptSpec  # the tools `tool_choice` allows, and its instruction in the messages
    grammar: GrammarSpec | None
    tool_call_parser: str | None  # None: the request offers no tools
    reasoning_parser: str | None  # None: no reasoning block (none configured, or a grammar)

    @property
    def has_tools(self) -> bool:
        """Whether the template sees tools (so the output may hold tool calls)."""
        return self.prompt.tools is not None

    def output_format(self, ctx: ServerContext, prompt_ids: Sequence[int]) -> OutputFormat:
        """How the output of the rendered prompt `prompt_ids` is read back.

        A prompt that leaves a reasoning block open (Qwen3.5 with thinking on: `<think>`)
        begins the output in reasoning, read with the configured format when it spells the
        block so, else with the format of the block the prompt opened; under a grammar the
        output has no reasoning block (the grammar shapes it from its first token).
        """
        tail = ctx.engine.detokenize(list(prompt_ids[-PROMPT_TAIL_TOKENS:]))
        opened = None if self.grammar is not None else reasoning_left_open(tail)
        parser = self.reasoning_parser
        if opened is not None and (parser is None or REASONING_TAGS[parser] != REASONING_TAGS[opened]):
            parser = opened
        return OutputFormat(
            tool_call_parser=self.tool_call_parser,
            reasoning_parser=parser,
            tools=self.prompt.tools or (),
            opens_in_reasoning=opened is not None,
        )


# The prompt's last tokens decoded to tell an open reasoning block: the marker and the whitespace
# after it are a few tokens in any tokenizer (18 in a byte-level one).
PROMPT_TAIL_TOKENS = 32


def template_prompt(prompt: PromptSpec, choice: ToolChoice) -> PromptSpec:
    """What the chat template renders of `prompt` (carrying every tool the request defines)
    under `choice`: the tools it allows, and its instruction in the messages.

    Raises:
        InvalidRequest: `choice` names an unknown tool.
    """
    assert prompt.messages is not None, "tools and tool_choice apply to chat messages"
    tools = list(prompt.tools) if prompt.tools is not None else None
    messages, allowed = apply_tool_choice(list(prompt.messages), tools, choice)
    return replace(prompt, messages=messages, tools=allowed)


def output_policy(
    ctx: ServerContext,
    prompt: PromptSpec,
    choice: ToolChoice,
    answer: GrammarSpec | None,
    *,
    prefill_param: str = "continue_final_message",
) -> OutputPolicy:
    """The policy of a chat `prompt` (carrying every tool the request defines) under `choice`,
    its answer following `answer` (structured output) when given.

    `prefill_param` names the request field that made the prompt continue its final message.

    Raises:
        InvalidRequest: `choice` names an unknown tool, or a grammar would have to continue
            a given (prefilled) final message.
    """
    prompt = template_prompt(prompt, choice)
    tools = list(prompt.tools) if prompt.tools is not None else None
    config = ctx.settings
    parser = tool_call_parser_name(config.tool_call_parser or ctx.engine.tool_call_parser, tools is not None)
    grammar = output_grammar(tools, choice, parser, answer, ctx.engine.marker_tokens)
    if prompt.continue_final_message and grammar is not None:
        raise InvalidRequest(
            "a final message to continue (an assistant prefill) cannot be used with structured "
            "output or a forced tool choice: the grammar shapes a whole new answer, not the rest "
            "of the given one",
            param=prefill_param,
        )
    return OutputPolicy(
        prompt=prompt,
        grammar=grammar,
        tool_call_parser=parser,
        reasoning_parser=reasoning_parser_name(
            config.reasoning_parser or ctx.engine.reasoning_parser, grammar
        ),
    )
