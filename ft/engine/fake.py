"""A fake model for deterministic tests: a byte-level tokenizer and a scripted runner.

The runner is async (it "computes" with `trio.sleep`), so whole-engine tests run under
`trio.testing.MockClock(autojump_threshold=0)` without threads.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import trio
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ft.core.batch import Heartbeat, PoolSum, Sampled, Scored, SeqWork, StateCopy, StepOutput, TokenScore
from ft.tokenizer.spec import TokenizerSpec, bytes_to_unicode

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_ID = 0
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer_spec(context_length: int = 2048) -> TokenizerSpec:
    """A tokenizer with one token per byte (ids 3..258) and three special tokens (0..2)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for byte, char in sorted(bytes_to_unicode().items()):
        vocab[char] = len(SPECIALS) + byte
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    return TokenizerSpec(
        tokenizer_json=tok.to_str(),
        chat_template=CHATML,
        bos_token=None,
        eos_token=SPECIALS[EOS_ID],
        add_bos_token=False,
        eos_token_ids=(EOS_ID,),
        context_length=context_length,
    )


def byte_token(b: int) -> int:
    """The fake tokenizer's id for byte `b`."""
    return len(SPECIALS) + b


async def run_inline(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
    """A tokenizer executor that runs the job in this process (no worker, no thread)."""
    await trio.lowlevel.checkpoint()
    return job(payload)


def delayed_inline(delay_s: float) -> Callable[[Callable[[bytes], bytes], bytes], Awaitable[bytes]]:
    """`run_inline` after `delay_s` of (trio) time: a slow tokenizer for MockClock tests."""

    async def run(job: Callable[[bytes], bytes], payload: bytes) -> bytes:
        await trio.sleep(delay_s)
        return job(payload)

    return run


Script = Callable[[SeqWork], int]
FAKE_HIDDEN = 8  # the fake model's hidden size


def fake_hidden(token_id: int, position: int) -> tuple[float, ...]:
    """The fake model's hidden state for `token_id` at `position`: small integers, so sums
    are exact and any pooling can be computed by hand in a test."""
    return tuple(float((token_id * (j + 3) + position * (j + 1)) % 7 - 3) for j in range(FAKE_HIDDEN))


def text_script(text: str) -> Script:
    """Emit `text` byte by byte, then end of sequence."""
    data = text.encode("utf-8")

    def next_token(work: SeqWork) -> int:
        k = work.num_generated
        return byte_token(data[k]) if k < len(data) else EOS_ID

    return next_token


@dataclass
class FakeRunner:
    """Scripted tokens, `step_s` of (trio) time per step; `hangs`: steps that never return.

    With `beat_s`, a step's `step_s` pass in pieces of `beat_s`, its `heartbeat` beating after
    each, as a real forward beats once a layer (a long step that makes progress).

    `recurrent`: the model has recurrent layers (`ft.core.batch.StateRunner`, its slots counted
    by the engine's config); each slot's state is the tokens fed into it, and a work whose slot
    does not hold exactly `start_pos` of them (or an unwritten slot) is noted in `state_faults`
    (raising would only fail the request, which a test may expect for other reasons)."""

    script: Script = field(default_factory=lambda: text_script("Hello from the fake model."))
    step_s: float = 0.01
    page_size: int = 16
    num_pages: int = 256
    vocab_size: int = len(SPECIALS) + 256
    steps: list[list[SeqWork]] = field(default_factory=list)
    record: bool = False
    hangs: bool = False  # set: steps never return (a hung kernel or rank), for the watchdog
    beat_s: float = 0.0
    heartbeat: Heartbeat = field(default_factory=Heartbeat)
    recurrent: bool = False
    num_state_slots: int = 0
    states: dict[int, tuple[int, ...]] = field(default_factory=dict)  # unwritten: absent
    state_faults: list[str] = field(default_factory=list)

    def copy_states(self, copies: list[StateCopy] | tuple[StateCopy, ...]) -> None:
        """Run a batch's state copies, in order."""
        for copy in copies:
            if copy.src in self.states:
                self.states[copy.dst] = self.states[copy.src]
            else:
                self.states.pop(copy.dst, None)

    async def astep(self, works: list[SeqWork]) -> list[StepOutput]:
        """One fake step: check page coverage, wait `step_s`, emit scripted tokens."""
        if self.beat_s > 0:
            end = trio.current_time() + self.step_s
            while (left := end - trio.current_time()) > 0:
                await trio.sleep(min(self.beat_s, left))
                self.heartbeat.beat()
        else:
            await trio.sleep(self.step_s)
        if self.hangs:
            await trio.sleep_forever()
        return self.step(works)

    def step(self, works: list[SeqWork]) -> list[StepOutput]:
        """Synchronous step (no delay); prompt tokens score -1.0 each; a token's hidden state
        is `fake_hidden(token, position)`."""
        if self.record:
            self.steps.append(works)
        if self.recurrent:
            self._advance_states(works)
        out: list[StepOutput] = []
        for w in works:
            end = w.start_pos + len(w.token_ids)
            assert len(w.page_ids) * self.page_size >= end, "pages do not cover the work"
            assert all(0 <= p < self.num_pages for p in w.page_ids)
            if w.sample:
                # Drafts are verified as a greedy model would: each one accepted while it is
                # the scripted token, then the scripted token after the last accepted one.
                drafts = w.token_ids[len(w.token_ids) - w.num_draft :]
                for j in range(w.num_draft + 1):
                    token = self.script(replace(w, num_generated=w.num_generated + j) if j else w)
                    lp = -0.5 if w.params.logprobs else None
                    top = tuple((token, -0.5) for _ in range(min(1, w.params.top_logprobs)))
                    out.append(Sampled(w.seq_id, token, lp, top))
                    if j == w.num_draft or token != drafts[j]:
                        break
            if w.score_ids:
                n = w.params.prompt_logprobs or 0
                scores = tuple(TokenScore(t, -1.0, ((t, -1.0),) * min(1, n)) for t in w.score_ids)
                out.append(Scored(w.seq_id, scores))
            if w.num_pool_rows:
                first = w.start_pos + w.pool_offset
                rows = [
                    fake_hidden(w.token_ids[p - w.start_pos], p)
                    for p in range(first, first + w.num_pool_rows)
                ]
                out.append(PoolSum(w.seq_id, tuple(float(sum(col)) for col in zip(*rows, strict=True))))
        return out

    def _advance_states(self, works: list[SeqWork]) -> None:
        written = {}
        for w in works:
            if not 0 <= w.state_slot < self.num_state_slots:
                self.state_faults.append(f"seq {w.seq_id}: state slot {w.state_slot}")
                continue
            before = self.states.get(w.state_slot) if w.start_pos else ()
            if before is None or len(before) != w.start_pos:
                got = "nothing" if before is None else f"{len(before)} tokens"
                self.state_faults.append(f"seq {w.seq_id} at {w.start_pos}: its slot holds {got}")
                before = ()
            written[w.state_slot] = before + w.token_ids
        self.states.update(written)
