"""When speculation pays: a cost model from measured step times (no trio, no torch).

A step that decodes D sequences and verifies R drafted rows costs t(D + R) (the target's
forward over its rows) plus what drafting took (a draft model's forwards; n-gram drafts are
free). Without drafts it costs t(D) and gives D tokens; with them it gives D + E, E the drafts
expected to be accepted. Speculation pays when the tokens it adds are worth more than the time
it adds:

    E * t(D) / D  >  max(0, t(D + R) - t(D)) + draft time

`StepCosts` keeps the median of the last few measurements of t by rows fed, measured on steps
that only decode (a prefill chunk's rows are not decode rows' cost), of a draft model's time
per forward by the rows it drafts for, and of its catch-up's time per token. What was never
measured is measured first, and a batch size whose decision stays the same is tried the other
way now and then, so one noisy measurement cannot turn speculation off for good (nor on for
good: t(D) is re-measured the same way); a retry that must first feed a draft model what it
lags by waits until that is cheap beside the steps since the last. Tests inject measurements
with `observe` to make the decisions deterministic.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Measurements kept per row count; the estimate is their median. A busy neighbour made single
# steps 10x slower (docs/performance.md): a mean would follow those, the median does not.
WINDOW = 9
# Steps in a row decided alike before the other choice is taken once (and measured); doubled,
# up to MAX_RETRY_EVERY, each time the choice after the retry is the one before it. A retry of
# a draft model that never agrees costs its catch-up over the tokens since it last drafted and
# a forward: every 16 steps that was 12% of a 1B target's decode (0 of 153 drafts accepted).
RETRY_EVERY = 16
MAX_RETRY_EVERY = 1024
# A retry that must first feed a draft model the tokens it lags by (it is not fed while drafting
# does not pay) waits until the steps since the last one took this many times that feed: so
# such retries cost at most ~1% (a running request's lag grows a token a step, so in practice
# they happen as new requests arrive). Feeding them every 16 .. 1024 steps was 2.8% of a 1B
# target's decode with the default model drafting and never agreeing.
CATCH_UP_BUDGET = 100
# A catch-up fed with drafting is measured only when its tokens outnumber the drafting
# forwards this many times (their share is taken out at their measured time).
CATCH_UP_PER_FORWARD = 8


def expected_accepted(num_drafts: int, rate: float) -> float:
    """Drafts expected to be accepted out of `num_drafts` when each is accepted with
    probability `rate` given the ones before it were (the first refusal ends the run)."""
    return sum(rate**j for j in range(1, num_drafts + 1))


def _add(table: dict[int, deque[float]], key: int, value: float) -> None:
    table.setdefault(key, deque(maxlen=WINDOW)).append(value)


def _median(values: deque[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def _interpolate(table: dict[int, deque[float]], key: int) -> float | None:
    """The median at `key`, linear between the nearest measured keys around it; None outside."""
    if key in table:
        return _median(table[key])
    below = max((k for k in table if k < key), default=None)
    above = min((k for k in table if k > key), default=None)
    if below is None or above is None:
        return None
    w = (key - below) / (above - below)
    low, high = _median(table[below]), _median(table[above])
    return low + w * (high - low)


@dataclass(eq=False, slots=True)
class StepCosts:
    """Measured step times: the target's by rows fed, the draft model's per forward by rows."""

    # rows -> the last `WINDOW` seconds of the target's forward
    step_s: dict[int, deque[float]] = field(default_factory=dict)
    # drafting sequences -> the last `WINDOW` seconds per draft-model forward
    draft_forward_s: dict[int, deque[float]] = field(default_factory=dict)
    # the last `WINDOW` seconds per token of a draft model's catch-up (its lag, fed in chunks)
    catch_up_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    # decodes -> (the last decision, how many steps in a row it was taken, steps between
    # retries, whether the last step was a retry)
    streak: dict[int, tuple[bool, int, int, bool]] = field(default_factory=dict)

    def observe(self, num_rows: int, seconds: float, draft_s: float = 0.0, num_forwards: int = 0,
                num_drafting: int = 0) -> None:  # fmt: skip
        """Fold in a decode-only step: `num_rows` fed to the target, `seconds` in all, of which
        `draft_s` drafting in `num_forwards` forwards for `num_drafting` sequences."""
        if num_rows < 1 or seconds <= 0.0:
            return
        _add(self.step_s, num_rows, max(seconds - draft_s, 1e-9))
        if num_forwards and num_drafting:
            _add(self.draft_forward_s, num_drafting, draft_s / num_forwards)

    def observe_catch_up(
        self, num_tokens: int, seconds: float, num_forwards: int = 0, num_drafting: int = 0
    ) -> None:
        """Fold in a step that fed draft models `num_tokens` tokens of catch-up, drafting in
        `num_forwards` forwards for `num_drafting` sequences, in `seconds` in all. The drafting's
        share is taken out at its measured time per forward (a step whose forwards outnumber an
        eighth of its feed is not folded in: what is left would be mostly noise); unmeasured,
        at a token's time each, which overstates the catch-up's cost (so retries wait longer,
        never shorter: each request's first drafts come before any forward was measured)."""
        if num_tokens < 1 or seconds <= 0.0:
            return
        if num_forwards:
            per_forward = _interpolate(self.draft_forward_s, num_drafting)
            if per_forward is None:
                seconds *= num_tokens / (num_tokens + num_forwards)
            elif num_tokens < CATCH_UP_PER_FORWARD * num_forwards:
                return
            else:
                seconds -= num_forwards * per_forward
        if seconds > 0.0:
            self.catch_up_s.append(seconds / num_tokens)

    def estimate(self, num_rows: int) -> float | None:
        """The target's time for a decode-only step of `num_rows` rows (None: unmeasured)."""
        return _interpolate(self.step_s, num_rows)

    def pays(
        self, num_decodes: int, num_drafted: int, num_expected: float, num_forwards: int = 0,
        num_drafting: int = 0, num_catch_up: int = 0,
    ) -> bool:  # fmt: skip
        """Whether drafting `num_drafted` rows for `num_decodes` decoding sequences (`num_drafting`
        of them drafting), `num_expected` drafts expected accepted, saves more than it costs
        (`num_forwards` draft-model forwards; 0 for free drafts; `num_catch_up` tokens the draft
        models lag by, fed before they draft).

        Unmeasured costs are measured first: a step without drafts when t(D) is unknown, with
        them when the rest is. After `RETRY_EVERY` steps in a row decided alike, the other
        choice is taken once, so both sides' measurements stay current; after each retry that
        changed nothing, twice as many steps (up to `MAX_RETRY_EVERY`). A retry to drafting
        whose catch-up would cost more than 1 / `CATCH_UP_BUDGET` of the steps since the last
        waits (the streak goes on).
        """
        plain = _interpolate(self.step_s, num_decodes)
        if plain is None:
            return False
        verify = _interpolate(self.step_s, num_decodes + num_drafted)
        drafting: float | None = 0.0
        if num_forwards:
            per_forward = _interpolate(self.draft_forward_s, num_drafting or num_decodes)
            drafting = None if per_forward is None else per_forward * num_forwards
        if verify is None or drafting is None:
            return True
        # NOTE: more rows never make a step faster: a verify step measured faster than a plain
        # one is noise (the two medians were measured at different times: under a neighbour's
        # load a stale t(D + R) below a fresh t(D) kept a draft model that never agrees drafting
        # 499 steps of 1,024), so the rows cost at least nothing.
        decided = num_expected * plain / num_decodes > max(0.0, verify - plain) + drafting
        last, count, spacing, retried = self.streak.get(num_decodes, (decided, 0, RETRY_EVERY, False))
        if decided != last:  # the measurements changed the decision: retries start over
            count, spacing = 1, RETRY_EVERY
        elif retried:  # the retry changed nothing: wait twice as long for the next
            count, spacing = 1, min(MAX_RETRY_EVERY, 2 * spacing)
        else:
            count += 1
        if count > spacing and (decided or not self.catch_up_waits(count * plain, num_catch_up)):
            self.streak[num_decodes] = (decided, 0, spacing, True)
            return not decided
        self.streak[num_decodes] = (decided, count, spacing, False)
        return decided

    def catch_up_waits(self, since_s: float, num_tokens: int) -> bool:
        """Whether feeding draft models `num_tokens` tokens of catch-up costs more than
        1 / `CATCH_UP_BUDGET` of `since_s` (unmeasured: it does not, so it gets measured)."""
        if not num_tokens or not self.catch_up_s:
            return False
        return CATCH_UP_BUDGET * num_tokens * _median(self.catch_up_s) > since_s
