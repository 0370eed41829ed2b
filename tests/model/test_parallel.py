"""Tensor parallelism on the CPU (gloo): the shards reassemble the model, and 2 ranks give what 1 does."""

from __future__ import annotations

import os
import pathlib
import signal

import pytest
import torch

from ft.core.batch import Sampled, SeqWork
from ft.model.llama import assemble_model, build_model, fuse_hf_state_dict
from ft.model.loader import load_model
from ft.model.parallel.group import collective_failed, decode_works, encode_works
from ft.model.parallel.shard import Shard, check_shardable, shard_fused, split
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from tests.model.test_runner import PROMPT_A, PROMPT_B, generate, make_runner
from tests.support.parallel import rank_pids, tensor_parallel_runner
from tests.support.tiny_model import random_hf_state_dict, save_hf_dir, tiny_config

GREEDY = SamplingParams(temperature=0.0)


def test_shards_reassemble_the_fused_weights() -> None:
    config = tiny_config(attention_bias=True, vocab_size=95)  # 95: the lm_head split is padded
    fused = fuse_hf_state_dict(config, random_hf_state_dict(config))
    a, b = (shard_fused(config, fused, Shard(r, 2)) for r in range(2))
    q, kv, inter = config.q_size // 2, config.kv_size // 2, config.intermediate_size // 2
    name = "layers.0.qkv_proj.weight"
    whole_q = torch.cat([a[name][:q], b[name][:q]])
    assert torch.equal(whole_q, fused[name][: config.q_size])
    assert torch.equal(torch.cat([a[name][q : q + kv], b[name][q : q + kv]]),
                       fused[name][config.q_size : config.q_size + config.kv_size])  # fmt: skip
    assert torch.equal(torch.cat([a["layers.0.qkv_proj.bias"], b["layers.0.qkv_proj.bias"]]).sum(),
                       fused["layers.0.qkv_proj.bias"].sum())  # fmt: skip
    o = "layers.1.o_proj.weight"
    assert torch.equal(torch.cat([a[o], b[o]], dim=1), fused[o])
    d = "layers.1.down_proj.weight"
    assert torch.equal(torch.cat([a[d], b[d]], dim=1), fused[d])
    gu = "layers.1.gate_up_proj.weight"
    assert torch.equal(torch.cat([a[gu][:inter], b[gu][:inter]]), fused[gu][: config.intermediate_size])
    head = torch.cat([a["lm_head.weight"], b["lm_head.weight"]])
    assert head.shape[0] == 96 and torch.equal(head[:95], fused["lm_head.weight"])
    assert not head[95:].any()
    assert torch.equal(a["embed_tokens.weight"], fused["embed_tokens.weight"])


def test_every_rank_needs_a_kv_head() -> None:
    with pytest.raises(ValueError, match="more than the model's 2 kv heads"):
        check_shardable(tiny_config(), 4)
    check_shardable(tiny_config(num_heads=6, num_kv_heads=3), 2)  # 2 + 1: uneven is fine


def test_uneven_heads_split_as_evenly_as_can_be() -> None:
    assert [split(3, Shard(r, 2)) for r in range(2)] == [(0, 2), (2, 1)]
    assert [split(10, Shard(r, 4)) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]


def test_one_shard_of_one_is_the_model() -> None:
    config = tiny_config()
    sd = random_hf_state_dict(config)
    whole = build_model(config, sd, torch.float32)
    one = assemble_model(
        config, shard_fused(config, fuse_hf_state_dict(config, sd), Shard(0, 1)), torch.float32
    )
    for (k, v), (_, w) in zip(whole.state_dict().items(), one.state_dict().items(), strict=True):
        assert torch.equal(v, w), k


def test_step_description_round_trips() -> None:
    works = [
        SeqWork(7, (1, 2, 3), 4, (9, 8), True, GREEDY, 2, num_draft=2),  # drafts: 3 logits rows
        SeqWork(8, (5,), 0, (1,), False, GREEDY, 0),
    ]
    import cbor2

    again = decode_works(cbor2.loads(encode_works(works))["works"])
    assert [(w.token_ids, w.start_pos, w.page_ids, w.sample, w.num_draft) for w in again] == [
        (w.token_ids, w.start_pos, w.page_ids, w.sample, w.num_draft) for w in works
    ]


def test_two_ranks_give_the_tokens_and_logits_of_one(tiny_dir: pathlib.Path) -> None:
    """Batched prefill, decode and chunking on 2 gloo ranks equal one process (float32)."""
    solo_a, logits_a = generate(make_runner(tiny_dir), PROMPT_A, tuple(range(8)), 10, [7, 12])
    solo_b, logits_b = generate(make_runner(tiny_dir), PROMPT_B, (9, 10, 11, 12), 10)
    with tensor_parallel_runner(str(tiny_dir), 2, num_pages=32, page_size=4) as runner:
        assert runner.k_cache.shape[2] == 1  # each rank holds one of the 2 kv heads
        tp_a, tp_logits_a = generate(runner, PROMPT_A, tuple(range(8)), 10, [7, 12])
        pages_b = (20, 21, 22, 23)
        first = runner.forward([SeqWork(2, PROMPT_B, 0, pages_b, True, GREEDY, 0)])
        assert first is not None
        out_b = [int(first[0].argmax())]
        for i in range(1, 10):
            (s,) = runner.step([SeqWork(2, (out_b[-1],), len(PROMPT_B) + i - 1, pages_b, True, GREEDY, i)])
            out_b.append(s.token_id)
    assert tp_a == solo_a and out_b == solo_b
    assert torch.allclose(tp_logits_a, logits_a, atol=1e-5)
    assert torch.allclose(first[0], logits_b, atol=1e-5)


def test_uneven_heads_on_two_ranks_give_the_tokens_of_one(tmp_path: pathlib.Path) -> None:
    """3 kv heads (9 query heads, as the default model has) on 2 ranks: 2 + 1."""
    save_hf_dir(
        tmp_path / "m", tiny_config(hidden_size=36, num_heads=9, num_kv_heads=3, intermediate_size=66)
    )
    solo, logits = generate(make_runner(tmp_path / "m"), PROMPT_A, tuple(range(8)), 10, [7, 12])
    with tensor_parallel_runner(str(tmp_path / "m"), 2, num_pages=32, page_size=4) as runner:
        assert runner.k_cache.shape[2] == 2  # rank 0 holds 2 of the 3 kv heads
        tp, tp_logits = generate(runner, PROMPT_A, tuple(range(8)), 10, [7, 12])
    assert tp == solo
    assert torch.allclose(tp_logits, logits, atol=1e-5)


def test_a_rank_that_dies_fails_the_next_step(tiny_dir: pathlib.Path) -> None:
    from ft.core.batch import RunnerFailure

    loaded = load_model(tiny_dir, torch.float32)
    assert loaded.config.num_kv_heads == 2
    with tensor_parallel_runner(str(tiny_dir), 2, num_pages=8, page_size=4) as runner:
        runner.step([SeqWork(0, PROMPT_B, 0, (0, 1), True, GREEDY, 0)])
        (pid,) = rank_pids(os.getpid())
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RunnerFailure):
            for _ in range(50):  # the first step after the death may still be buffered
                runner.step([SeqWork(0, (3,), len(PROMPT_B), (0, 1, 2), True, GREEDY, 1)])


def test_an_error_on_rank_0_mid_step_is_fatal(tiny_dir: pathlib.Path) -> None:
    """The other ranks may wait in a collective rank 0 never reaches: no retry, a RankFailure."""
    from ft.config import EngineConfig
    from ft.core.batch import RunnerFailure
    from ft.engine.loading import load_torch_model

    config = EngineConfig(model=str(tiny_dir), dtype="float32", device="cpu", tensor_parallel_size=2)
    parts = load_torch_model(config)
    assert parts.close is not None
    try:
        runner = parts.make_runner(8, 4)
        assert isinstance(runner, TorchRunner)

        def fail(rows: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("out of memory")

        runner._lm_head = fail  # after the layers' all-reduces, before the logits' gather
        with pytest.raises(RunnerFailure, match=r"failed on rank 0 \(RuntimeError\)"):
            runner.step([SeqWork(0, PROMPT_B, 0, (0, 1), True, GREEDY, 0)])
    finally:
        parts.close(True)  # the group is out of step: the ranks are terminated, not told
    assert not rank_pids(os.getpid())


def test_ranks_agree_on_the_auto_dtype_whatever_each_measures(
    tiny_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--dtype auto` is measured per process: ranks that measured differently (here rank 0
    "finds" bfloat16 faster, rank 1 measures for real) would all-reduce mismatched tensors. On
    the CPU every rank runs float32: the same tokens and logits as one float32 process."""
    from ft.model import dtypes

    monkeypatch.setattr(dtypes, "_pick", lambda hidden, intermediate: torch.bfloat16)
    solo, logits = generate(make_runner(tiny_dir), PROMPT_A, tuple(range(8)), 6)
    with tensor_parallel_runner(str(tiny_dir), 2, num_pages=32, page_size=4, dtype="auto") as runner:
        assert runner.dtype == torch.float32
        tp, tp_logits = generate(runner, PROMPT_A, tuple(range(8)), 6)
    assert tp == solo and torch.allclose(tp_logits, logits, atol=1e-5)


def test_a_failed_collective_tells_clients_what_failed_not_where() -> None:
    """gloo's text (source paths, a peer's address) goes to the log, not to the message that
    reaches clients and /health."""
    gloo = RuntimeError("[/__w/gloo/pair.cc:553] Connection closed by peer [10.0.0.7]:8598")
    failure = collective_failed("broadcast", gloo)
    assert "10.0.0.7" not in str(failure) and "pair.cc" not in str(failure)
    assert "broadcast failed (RuntimeError)" in str(failure)


def test_drafts_verified_on_two_ranks_give_the_tokens_of_one(tiny_dir: pathlib.Path) -> None:
    """A work with drafts (right ones and a wrong one) on 2 ranks: every rank projects the same
    rows, and the accepted tokens are one process's greedy tokens."""
    pages = tuple(range(8))
    solo, _ = generate(make_runner(tiny_dir), PROMPT_A, pages, 8)
    with tensor_parallel_runner(str(tiny_dir), 2, num_pages=32, page_size=4) as runner:
        (first,) = runner.step([SeqWork(0, PROMPT_A, 0, pages, True, GREEDY, 0)])
        drafts = (*solo[1:3], (solo[3] + 1) % 96)  # two right, then a wrong one
        got = runner.step([SeqWork(0, (first.token_id, *drafts), len(PROMPT_A), pages, True, GREEDY, 1,
                                   num_draft=3)])  # fmt: skip
        (after,) = runner.step([SeqWork(0, (got[-1].token_id,), len(PROMPT_A) + 3, pages, True, GREEDY, 4)])
    assert [first.token_id, *(s.token_id for s in got), after.token_id] == solo[:5]


def test_a_draft_model_in_rank_0_drafts_for_two_ranks(tiny_dir: pathlib.Path) -> None:
    """`--speculative-method draft` with tensor parallelism: the draft model (the model itself,
    whole, in rank 0 only) drafts; the 2-rank step verifies its drafts: one process's tokens,
    every draft accepted."""
    from ft.model.draft import SpeculativeRunner
    from tests.support.parallel import tensor_parallel_parts

    pages = tuple(range(8))
    solo, _ = generate(make_runner(tiny_dir), PROMPT_A, pages, 10)
    with tensor_parallel_parts(str(tiny_dir), 2, num_pages=32, page_size=4, speculative_method="draft",
                               speculative_model=str(tiny_dir)) as runner:  # fmt: skip
        assert isinstance(runner, SpeculativeRunner) and runner.target.ranks is not None
        assert runner.drafter.runner.ranks is None  # not sharded, not sent to the other ranks
        (first,) = runner.step([SeqWork(0, PROMPT_A, 0, pages, True, GREEDY, 0)])
        assert isinstance(first, Sampled)
        out = [first.token_id]
        valid = 0  # positions whose KV the draft model holds
        while len(out) < 9:
            tokens = [*PROMPT_A, *out]
            pos = len(tokens) - 1
            feed = tuple(tokens[valid:])
            work = SeqWork(0, (out[-1],), pos, pages, True, GREEDY, len(out), draft_feed=feed,
                           draft_pos=valid, num_model_draft=3)  # fmt: skip
            got = [s.token_id for s in runner.step([work]) if isinstance(s, Sampled)]
            assert len(got) == 4  # a model drafting for itself: all three kept, and one more
            valid = pos + 1 + 2  # it was fed its feed, then each draft but the last
            out += got
    assert out == solo[: len(out)]
