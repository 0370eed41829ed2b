"""Tensor parallelism over torch.distributed, in one room.

`shard.py` cuts a rank's slice of the weights and builds its model; `group.py` is the rank
group (`RankGroup`: the collectives a step uses, the step description rank 0 broadcasts);
`steps.py` is the leader/follower step protocol a runner calls into; `ft/engine/ranks.py`
starts the rank processes (or joins torchrun's) and is the loop the other ranks run. Nothing
else cuts, sends or joins.

Megatron's layout on the fused projections: `qkv_proj` and `gate_up_proj` are split by output
rows (a rank holds a share of the kv heads with their query heads, and a share of the MLP
columns), `o_proj` and `down_proj` by input columns, and their partial outputs are summed with
`all_reduce`. Shares are as even as can be, not necessarily equal: the default model's 3 kv
heads run on 2 ranks as 2 + 1 (every rank needs at least one kv head). The embedding is
replicated; the lm_head is split by vocabulary rows and its logits gathered. Experts are split
the same way, every expert by its MLP columns: the router is replicated, so every rank routes
the (all-reduced, identical) activations to the same experts and sums its columns' share. OLMoE's
norms over the whole q and k projections are split with their rows, and the ranks sum their
squares before normalizing (`llama.whole_qk_norm`). Each rank's KV
cache holds its own kv heads with the same page layout, so page ids mean the same on every rank
and the scheduler does not change.

Rank 0 hosts the runner actor; it broadcasts each step's description (CBOR) and the other ranks
run the same forward from it (`steps.follow`). Control messages go through a gloo group
(CPU tensors); activations go through the main group (NCCL on CUDA, gloo on the CPU).
"""
