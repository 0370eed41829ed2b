"""Mamba-2's selective scan (state space duality, SSD) over many sequences at once, in float32.

Per head h, with a scalar decay `a_t = dt_t * A_h` (A < 0) and a state `S` `[head_dim, d_state]`:

    S_t = exp(a_t) * S_{t-1} + (dt_t * x_t) B_t^T        y_t = S_t C_t + D_h * x_t

B and C are shared by the heads of a group. A prompt is never scanned token by token: it is cut
into chunks of `chunk_size` positions, and within a chunk the recurrence unrolls into a masked
product (`y = (C B^T ∘ decay) (dt * x)`, the "diagonal blocks") plus the chunk's start state
carried through `C` (the "off-diagonal" part). Only the chunks' start states are sequential: one
loop step per chunk, run for every sequence at once. A decode row is the recurrence itself, and
all decode rows of a step are one batched update (`ssd_step`).

The chunk size changes only the rounding, never the result: the same sequence scanned in other
chunks or split across steps agrees to float32 precision, not bitwise.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch


class ScanInput(NamedTuple):
    """A step's scan inputs, one row per token (after the convolution and the dt transform)."""

    x: torch.Tensor  # [R, heads, head_dim] float32
    dt: torch.Tensor  # [R, heads] float32: softplus(dt + dt_bias), clamped
    B: torch.Tensor  # [R, groups, d_state] float32
    C: torch.Tensor  # [R, groups, d_state] float32


def ssd_step(
    inp: ScanInput, A: torch.Tensor, D: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step for each of `R` sequences: row r advances `state[r]`.

    Args:
        inp: one row per sequence.
        A: `[heads]` (negative), D: `[heads]`, float32.
        state: `[R, heads, head_dim, d_state]` float32, not modified.
    Returns:
        y `[R, heads, head_dim]` and the new states `[R, heads, head_dim, d_state]`.
    """
    num_rows, num_heads, head_dim = inp.x.shape
    num_groups, d_state = inp.B.shape[1:]
    per_group = num_heads // num_groups
    decay = torch.exp(inp.dt * A)  # [R, H]
    xdt = inp.x * inp.dt[..., None]  # [R, H, P]
    xdt = xdt.view(num_rows, num_groups, per_group, head_dim)
    # The state update, by group so B is never repeated over the heads: [R, G, hg, P, N].
    dbx = xdt[..., None] * inp.B[:, :, None, None, :]
    new_state = dbx.view(num_rows, num_heads, head_dim, d_state).addcmul_(state, decay[..., None, None])
    y = torch.einsum(
        "rgjpn,rgn->rgjp", new_state.view(num_rows, num_groups, per_group, head_dim, d_state), inp.C
    )
    y = y.reshape(num_rows, num_heads, head_dim) + inp.x * D[:, None]
    return y, new_state


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """`out[..., l, s] = a[..., s+1] + ... + a[..., l]` for `l >= s`, `-inf` above the diagonal.

    Summed directly rather than as a difference of cumulative sums, which loses the small
    within-chunk decays against a large running total (transformers' `segment_sum` does the same).
    """
    length = a.shape[-1]
    below = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(a[..., :, None].expand(*a.shape, length).masked_fill(~below, 0.0), dim=-2)
    keep = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), diagonal=0)
    return sums.masked_fill(~keep, float("-inf"))


class ChunkPlan(NamedTuple):
    """Where each sequence's rows go in the chunked layout.

    `rows[c, l]` is the input row at position l of chunk c (`R`, one past the last row, for the
    padding after a sequence's last row: a row of zeros); `chunks[s, j]` is sequence s's j-th
    chunk (`num_chunks` once the sequence has no more)."""

    rows: torch.Tensor  # [num_chunks, chunk_size] int64
    chunks: torch.Tensor  # [S, max_chunks] int64


def plan_chunks(
    starts: Sequence[int], lengths: Sequence[int], num_rows: int, chunk_size: int, device: torch.device
) -> ChunkPlan:
    """The chunk layout of S sequences whose rows are `[starts[s], starts[s] + lengths[s])` of `R`
    (`num_rows`) input rows; each sequence starts a new chunk and pads its last one."""
    counts = [(n + chunk_size - 1) // chunk_size for n in lengths]
    owner = torch.tensor([s for s, n in enumerate(counts) for _ in range(n)], dtype=torch.long, device=device)
    index_in_seq = torch.tensor([j for n in counts for j in range(n)], dtype=torch.long, device=device)
    start_of = torch.tensor(starts, dtype=torch.long, device=device)
    length_of = torch.tensor(lengths, dtype=torch.long, device=device)
    pos = index_in_seq[:, None] * chunk_size + torch.arange(chunk_size, device=device)  # [num_chunks, L]
    rows = torch.where(pos < length_of[owner, None], start_of[owner, None] + pos, num_rows)
    firsts = [0, *itertools.accumulate(counts)]
    num_chunks, width = firsts[-1], max(counts, default=0)
    chunks = [[firsts[s] + j if j < n else num_chunks for j in range(width)] for s, n in enumerate(counts)]
    return ChunkPlan(
        rows,
        torch.tensor(chunks, dtype=torch.long, device=device).view(len(counts), width),
    )


def _padded(t: torch.Tensor) -> torch.Tensor:
    """`t` `[R, ...]` with a row of zeros after its last (row `R`, where padding reads)."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


def ssd_chunked(
    inp: ScanInput, A: torch.Tensor, D: torch.Tensor, initial: torch.Tensor, plan: ChunkPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of S sequences laid out by `plan`, each from its `initial` state.

    Args:
        inp: `R` rows (all sequences' rows; `plan.rows` says whose).
        A: `[heads]` (negative), D: `[heads]`, float32.
        initial: `[S, heads, head_dim, d_state]` float32, not modified.
    Returns:
        y `[R, heads, head_dim]` (rows no chunk names are zero) and each sequence's state after
        its last row, `[S, heads, head_dim, d_state]`.
    """
    num_rows, num_heads, head_dim = inp.x.shape
    num_groups, d_state = inp.B.shape[1:]
    per_group = num_heads // num_groups
    num_chunks, length = plan.rows.shape

    # Padding positions read a row of zeros (dt = 0: they neither decay nor add to the state;
    # their outputs are dropped). NOTE: never another sequence's row: its x or B may be NaN or
    # inf (a bad state of its own), and 0 * NaN would carry it into this sequence's state.
    x, dt, B, C = (_padded(t)[plan.rows] for t in inp)  # [c, L, ...]
    xdt = x * dt[..., None]  # [c, L, H, P]
    a = (dt * A).transpose(1, 2)  # [c, H, L]
    a_cum = torch.cumsum(a, dim=-1)  # [c, H, L]

    # 1. Within each chunk: y_l += sum_{s<=l} (C_l . B_s) exp(a_{s+1} + ... + a_l) dt_s x_s.
    scores = torch.einsum("clgn,csgn->cgls", C, B)  # [c, G, L, L], by group
    decay = torch.exp(_segment_sums(a)).view(num_chunks, num_groups, per_group, length, length)
    mixed = (scores[:, :, None] * decay).view(num_chunks, num_heads, length, length)
    y = torch.einsum("chls,cshp->clhp", mixed, xdt)  # [c, L, H, P]

    # 2. Each chunk's own contribution to the state at its end.
    to_end = torch.exp(a_cum[:, :, -1:] - a_cum).transpose(1, 2)  # [c, L, H]
    weighted = (xdt * to_end[..., None]).view(num_chunks, length, num_groups, per_group, head_dim)
    chunk_states = torch.einsum("clgn,clgjp->cgjpn", B, weighted).reshape(
        num_chunks, num_heads, head_dim, d_state
    )
    chunk_decay = torch.exp(a_cum[:, :, -1])  # [c, H]

    # 3. Start states, one chunk of every sequence at a time; the past-the-end chunk index
    #    reads an identity step (decay 1, nothing added) and writes a scratch row.
    chunk_states = torch.cat([chunk_states, chunk_states.new_zeros(1, *chunk_states.shape[1:])])
    chunk_decay = torch.cat([chunk_decay, chunk_decay.new_ones(1, num_heads)])
    starts = chunk_states.new_empty(num_chunks + 1, num_heads, head_dim, d_state)
    state = initial
    for j in range(plan.chunks.shape[1]):
        ids = plan.chunks[:, j]
        starts[ids] = state
        state = state * chunk_decay[ids][..., None, None] + chunk_states[ids]

    # 4. The start state seen through C, decayed to each position.
    from_start = torch.exp(a_cum).transpose(1, 2)  # [c, L, H]
    carried = torch.einsum(
        "clgn,cgjpn->clgjp",
        C,
        starts[:num_chunks].view(num_chunks, num_groups, per_group, head_dim, d_state),
    ).reshape(num_chunks, length, num_heads, head_dim)
    y = y + carried * from_start[..., None] + x * D[:, None]

    out = inp.x.new_zeros(num_rows + 1, num_heads, head_dim)
    out[plan.rows.flatten()] = y.reshape(-1, num_heads, head_dim)  # padding lands on row R
    return out[:num_rows], state
