"""OpenAI response shapes: sampling params from a request, logprobs, usage, chunks, messages.

The tool-call and reasoning parsers plug in through a `ChatAssembler` that the chat route
builds from its output policy (`ft.server.generation.policy`), streamed or not.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ft.errors import InvalidRequest
from ft.grammar.spec import GrammarSpec
from ft.messages import TokenLogprob, TokenScore, TopLogprob
from ft.params import SamplingParams
from ft.server.edge.body import parse_arguments
from ft.server.generation import lifecycle
from ft.server.generation.context import ServerContext
from ft.server.generation.lifecycle import Usage
from ft.server.openai.schemas import ChatMessage, CompletionRequest, SamplingFields

# The most prompt tokens a completion may echo, counting each of the `n` choices: a 576 KB
# request (64 prompts, n 16, echo, logprobs 5) asked for ~1.5M echoed tokens, a 50 MB response.
# At the limit a response with logprobs is ~8 MB, built and serialized off the loop.
MAX_ECHO_TOKENS = 1 << 18
MIN_LOGPROB = -9999.0  # stands in for -inf, which JSON cannot carry


def sampling_params(
    ctx: ServerContext,
    req: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    grammar: GrammarSpec | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """Engine sampling params for a chat or completions request.

    Raises:
        InvalidRequest: a token id outside the vocabulary, or a combination the engine refuses.
    """
    bias = req.logit_bias_ids()
    ctx.check_token_ids(list(bias), "logit_bias")
    ctx.check_token_ids(list(req.stop_token_ids or ()), "stop_token_ids")
    return lifecycle.sampling_params(
        ctx,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        repetition_penalty=req.repetition_penalty,
        max_tokens=max_tokens,
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        logit_bias=bias,
        seed=req.seed,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        prompt_logprobs=prompt_logprobs,
        n=req.n,
        skip_special_tokens=req.skip_special_tokens,
        grammar=grammar,
        speculative=req.speculative,
    )


def check_echo_size(req: CompletionRequest, max_model_len: int) -> None:
    """Raise `InvalidRequest` when `echo` would return more than `MAX_ECHO_TOKENS` entries.

    A string prompt counts its UTF-8 bytes (at least its token count), capped at the context.
    With `logprobs: N` each echoed token is scored: it counts N + 2 (its logprob, its N
    alternatives and itself in `top_logprobs`).
    """
    if not req.echo:
        return
    tokens = sum(
        len(p) if isinstance(p, list) else min(len(p.encode("utf-8", "surrogatepass")), max_model_len)
        for p in req.prompt
    )
    weight = 1 if req.logprobs is None else req.logprobs + 2
    echoed = tokens * req.n * weight
    if echoed > MAX_ECHO_TOKENS:
        raise InvalidRequest(
            f"echo would return {echoed} prompt token entries (prompt tokens x n, x (logprobs + 2) "
            f"with logprobs: each is scored); the limit is {MAX_ECHO_TOKENS}: send fewer or "
            "shorter prompts, a smaller n or fewer logprobs",
            param="echo",
        )


class TokenTexts:
    """Each token id's text, decoded once: an echoed prompt's tokens and their alternatives
    repeat (an 8k-token prompt with 20 alternatives each is 172k lookups, ~0.8 s decoded one by
    one), so a body decodes each distinct id once."""

    def __init__(self, detokenize: Callable[[list[int]], str]) -> None:
        self._detokenize = detokenize
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        """The text of `token_id` alone."""
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._detokenize([token_id])
        return text


def prompt_logprobs(text: TokenTexts, scores: Sequence[TokenScore]) -> list[TokenLogprob]:
    """Scored prompt tokens with their text (linear in the prompt: a body builds it off the loop)."""
    return [
        TokenLogprob(
            s.token_id,
            text(s.token_id),
            s.logprob,
            tuple(TopLogprob(t, text(t), lp) for t, lp in s.top_logprobs),
        )
        for s in scores
    ]


def usage(u: Usage) -> dict[str, Any]:
    """The `usage` object, with the prefix-cache hits in `prompt_tokens_details`."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.total_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def _lp(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def chat_logprobs(items: Sequence[TokenLogprob]) -> dict[str, Any]:
    """`choices[].logprobs` of a chat completion: `{"content": [{token, logprob, bytes, ...}]}`."""
    return {
        "content": [
            {
                "token": t.token,
                "logprob": _lp(t.logprob),
                "bytes": list(t.token.encode("utf-8", errors="replace")),
                "top_logprobs": [
                    {
                        "token": alt.token,
                        "logprob": _lp(alt.logprob),
                        "bytes": list(alt.token.encode("utf-8", errors="replace")),
                    }
                    for alt in t.top
                ],
            }
            for t in items
        ],
        "refusal": None,
    }


class CompletionLogprobs:
    """Accumulates `choices[].logprobs` of a text completion (tokens, offsets, alternatives)."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset

    def add_prompt(self, tokens: Sequence[str], scores: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
        """Entries for echoed prompt tokens; `scores` are tokens 1.. scored (vLLM's shape: the
        first token has no context, so its logprob is null; each scored one's `top_logprobs`
        holds its alternatives and the token itself)."""
        out = self._empty()
        for i, tok in enumerate(tokens):
            score = scores[i - 1] if 0 < i <= len(scores) else None
            out["tokens"].append(tok)
            out["token_logprobs"].append(None if score is None else _lp(score.logprob))
            out["top_logprobs"].append(
                None
                if score is None
                else {alt.token: _lp(alt.logprob) for alt in score.top} | {score.token: _lp(score.logprob)}
            )
            out["text_offset"].append(self.offset)
            self.offset += len(tok)
        return out

    def add(self, items: Sequence[TokenLogprob]) -> dict[str, Any]:
        """Entries for generated tokens."""
        out = self._empty()
        for t in items:
            out["tokens"].append(t.token)
            out["token_logprobs"].append(_lp(t.logprob))
            out["top_logprobs"].append({alt.token: _lp(alt.logprob) for alt in t.top})
            out["text_offset"].append(self.offset)
            self.offset += len(t.token)
        return out

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

    @staticmethod
    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        """`a` followed by `b`."""
        return {key: a[key] + b[key] for key in a}


def chat_message_for_template(message: ChatMessage) -> dict[str, Any]:
    """A validated `ChatMessage` as the dict a chat template expects.

    `developer` becomes `system` (templates predate it); a tool call's JSON `arguments`
    string becomes an object, as Hugging Face templates expect.
    """
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": message.content}
    if message.content is None and not message.tool_calls:
        out["content"] = ""
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_text is not None:  # templates read `reasoning_content`
        out["reasoning_content"] = message.reasoning_text
    if message.tool_calls:
        out["tool_calls"] = [_template_tool_call(tc) for tc in message.tool_calls]
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        args = parse_arguments(function["arguments"])
        if isinstance(args, dict):
            return call | {"function": function | {"arguments": args}}
    return call
