"""The gated delta rule, the recurrence of Gated DeltaNet (Qwen3.5, Qwen3-Next), in float32.

Per value head the state is a matrix `S [key_dim, value_dim]` (transformers' order); each token
with l2-normalized key k, query q (scaled by key_dim ** -0.5), value v, decay a = exp(g) (g <= 0)
and learning rate beta does

    S <- a S;   S <- S + k (beta (v - S^T k))^T;   o = S^T q

Two ways to run it: `recurrent_step` takes one token of many sequences at once (a decode step is
one batched product over their states), `chunk_rule` takes many tokens of a sequence (the WY form
of the DeltaNet paper: within a chunk of 64 tokens everything is matrix products and one
triangular solve; only the chunks are scanned in order). Both compute what transformers'
`torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule` compute, up to float32
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def recurrent_step(
    q: torch.Tensor,  # [B, H, dk] float32, l2-normalized and scaled
    k: torch.Tensor,  # [B, H, dk] l2-normalized
    v: torch.Tensor,  # [B, H, dv]
    g: torch.Tensor,  # [B, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, H]
    state: torch.Tensor,  # [B, H, dk, dv] contiguous, updated in place
) -> torch.Tensor:
    """One token of each of B sequences → outputs `[B, H, dv]`; `state` becomes the states
    after it (pass a copy: the mixer's gathered one).

    Decode is bound by the states' bytes (2 MiB a sequence and layer at Qwen3.5-9B's shape), so
    the step costs its passes over them: one read (k and q against the old state in one product)
    and two in-place updates (the decay, then the rank-one write), no new state tensor.
    """
    batch, heads, dk, dv = state.shape
    a = g.exp()[..., None]  # [B, H, 1]
    read = torch.matmul(torch.stack((k, q), dim=-2), state)  # [B, H, 2, dv]: k^T S, q^T S
    delta = (v - a * read[..., 0, :]) * beta[..., None]  # [B, H, dv]
    state.mul_(a[..., None])
    state.view(batch * heads, dk, dv).baddbmm_(k.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
    # o = S_new^T q = a (S^T q) + (q . k) delta, without reading the new state again
    out: torch.Tensor = a * read[..., 1, :] + (q * k).sum(-1, keepdim=True) * delta  # [B, H, dv]
    return out


def chunk_rule(
    q: torch.Tensor,  # [B, T, H, dk] float32, l2-normalized and scaled
    k: torch.Tensor,  # [B, T, H, dk] l2-normalized
    v: torch.Tensor,  # [B, T, H, dv]
    g: torch.Tensor,  # [B, T, H] log decay (<= 0)
    beta: torch.Tensor,  # [B, T, H]
    state: torch.Tensor,  # [B, H, dk, dv] before the first token
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T tokens of each of B sequences → (outputs `[B, T, H, dv]`, states after the last token).

    Sequences shorter than T may be zero-padded at their end (k, v, g and beta all zero): a
    padded token neither decays nor writes the state, so each sequence's state after T tokens
    is its state after its own last one. A T below the chunk size is one chunk of T (no padding).
    """
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    size = min(chunk_size, length)
    pad = -length % size
    num_chunks = (length + pad) // size

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, ...] -> [B, H, N, C, ...]
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(batch, heads, num_chunks, size, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))  # [B, H, N, C(, d)]
    cum = g.cumsum(-1)  # [B, H, N, C]: log of the decay from the chunk's start to each token
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, 0 above the diagonal (masked before exp: never
    # an overflow)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]  # [B, H, N, C, dk]
    # (I + strictly_lower(beta K K^T * decay)) [U | W] = [beta V | beta K exp(cum)]: the values
    # the chunk writes before the old state is subtracted (U), and the keys that read it (W)
    system = torch.matmul(k_beta, k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    rhs = torch.cat((v * beta[..., None], k_beta * cum.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved.split((dv, dk), dim=-1)  # [B, H, N, C, dv], [B, H, N, C, dk]
    intra = torch.matmul(q, k.transpose(-1, -2)) * decay  # [B, H, N, C, C], diagonal included
    q_decayed = q * cum.exp()[..., None]  # each query reads the state as decayed to its token
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]  # each key's write, decayed to the end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]
    out = q.new_empty(batch, heads, num_chunks, size, dv)
    for n in range(num_chunks):
        v_new = u[:, :, n] - torch.matmul(w[:, :, n], state)  # [B, H, C, dv]: the corrections
        out[:, :, n] = torch.matmul(q_decayed[:, :, n], state) + torch.matmul(intra[:, :, n], v_new)
        state = state * chunk_decay[:, :, n] + torch.matmul(k_decayed[:, :, n].transpose(-1, -2), v_new)
    out = out.reshape(batch, heads, num_chunks * size, dv)[:, :, :length]
    return out.transpose(1, 2), state  # [B, T, H, dv]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the FLA kernels' and transformers' form)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
