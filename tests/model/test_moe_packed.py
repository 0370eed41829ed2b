"""Mixtures of experts on the packed GGUF path: experts kept as the file's blocks, one view per
expert, run grouped by expert with the packed gemm, agreeing with the float path on the same file.

Each family (Qwen3-MoE, Mixtral, OLMoE) is built by transformers and written as llama.cpp does
(`tests.support.tiny_moe`); the float path dequantizes the same blocks, so the two differ only
by the packed path's int8 activations. Files whose metadata lies about the experts are loaded in
a probe process (`tests.support.gguf_probe`): a named error, never a crash.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import trio
from gguf import GGMLQuantizationType
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ft.config import EngineConfig
from ft.core.batch import SeqWork
from ft.engine.engine import Engine, open_engine
from ft.engine.loading import load_torch_model
from ft.model import kernels, packed_moe
from ft.model.loader import LoadedModel, is_quantized_gguf, load_model
from ft.model.moe import Routing, SparseMoE, group_by_expert, mix, route
from ft.model.packed_moe import PackedExperts
from ft.model.quantized_llama import QuantizedLlama
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.params import SamplingParams
from ft.prompt import PromptSpec
from tests.support.gguf_files import U32, RawGGUF, dims, scalar
from tests.support.gguf_probe import Prober, assert_refused
from tests.support.tiny_moe import mixtral_model, olmoe_model, write_moe_gguf
from tests.support.tiny_qwen3 import GREEDY, PAGES, generate, qwen3_moe_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="no C++ compiler for the kernels")
transformers = pytest.importorskip("transformers")

PROMPT = (5, 17, 33, 2, 9, 60, 41, 7, 7, 12, 80, 3, 22, 19, 50, 4, 8, 71, 30, 200, 150, 99) * 2
NEW_TOKENS = 8
PACKED_RELATIVE_TOLERANCE = 0.04  # of the logits' range, as for dense Qwen3 (test_qwen3)
FAMILIES: dict[str, Callable[..., Any]] = {
    "qwen3_moe": qwen3_moe_model,
    "mixtral": mixtral_model,
    "olmoe": olmoe_model,
}
Q8_0, Q4_K, Q4_0 = GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q4_0


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    name = str(request.param)
    path = tmp_path_factory.mktemp("moe") / f"tiny-{name}.Q8_0.gguf"
    return write_moe_gguf(path, FAMILIES[name]())


@pytest.fixture(scope="module")
def mixtral_gguf(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_moe_gguf(tmp_path_factory.mktemp("mixtral") / "tiny-mixtral.Q8_0.gguf", mixtral_model())


def runner_of(loaded: LoadedModel) -> TorchRunner:
    return build_runner(loaded, num_pages=32, page_size=4, dtype=torch.float32)


def packed_model(path: pathlib.Path) -> QuantizedLlama:
    runner = runner_of(load_model(path, torch.float32, quantized=True))
    assert runner.packed is not None
    return runner.packed


def forced_logits(runner: TorchRunner, forced: list[int]) -> list[torch.Tensor]:
    """Each step's logits `[vocab]` when the tokens after `PROMPT` are `forced`."""
    out = []
    logits = runner.forward([SeqWork(0, PROMPT, 0, PAGES, True, GREEDY, 0)])
    for i, token in enumerate([*forced, None]):
        assert logits is not None
        out.append(logits[0])
        if token is not None:
            logits = runner.forward([SeqWork(0, (token,), len(PROMPT) + i, PAGES, True, GREEDY, i + 1)])
    return out


def assert_packed_agrees_with_float(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Fed the float path's greedy tokens, the packed path's logits stay within int8 tolerance at
    every step, and its greedy choice is the float path's wherever that one leads by more than
    the tolerance (random weights leave near-ties).

    A router is discontinuous: where two experts nearly tie, int8 activations may pick the other
    one, a legitimate difference that would hide every other. So the float path replays the
    packed path's choice of experts (weighting them by its own router), and each replayed
    choice must be within a near-tie of the float router's own top-k.
    """
    float_tokens, _ = generate(runner_of(load_model(path, torch.float32)), PROMPT, NEW_TOKENS)
    packed = runner_of(load_model(path, torch.float32, quantized=True))
    assert packed.packed is not None and any(e is not None for e in packed.packed.experts)
    chosen: list[torch.Tensor] = []

    def recording(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
        routing = route(logits, top_k, renormalize)
        chosen.append(routing.experts)
        return routing

    monkeypatch.setattr(packed_moe, "route", recording)
    packed_steps = forced_logits(packed, float_tokens)
    replay = iter(chosen)

    def replaying(self: SparseMoE, x: torch.Tensor) -> Routing:
        experts = next(replay)
        probs = torch.softmax(torch.nn.functional.linear(x, self.router), dim=-1, dtype=torch.float32)
        own = probs.topk(self.top_k, dim=-1).values.sum(-1)
        weights = probs.gather(1, experts)
        assert (own - weights.sum(-1)).max().item() < 0.1, "the packed router chose far from the float one"
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(experts, weights.to(x.dtype))

    monkeypatch.setattr(SparseMoE, "route", replaying)
    float_steps = forced_logits(runner_of(load_model(path, torch.float32)), float_tokens)
    assert next(replay, None) is None  # the same layers routed the same rows on both paths
    agreeing = 0
    for step, (want, got) in enumerate(zip(float_steps, packed_steps, strict=True)):
        tolerance = PACKED_RELATIVE_TOLERANCE * (want.max() - want.min()).item()
        assert (got - want).abs().max().item() < tolerance, f"step {step}"
        lead = (want.max() - want[int(got.argmax())]).item()
        assert lead <= 2 * tolerance, f"step {step}: the packed path chose a token {lead:.3g} behind"
        agreeing += int(got.argmax()) == int(want.argmax())
    assert agreeing >= NEW_TOKENS // 2


def test_auto_runs_a_moe_gguf_packed(family_gguf: pathlib.Path) -> None:
    assert is_quantized_gguf(family_gguf)
    parts = load_torch_model(EngineConfig(model=str(family_gguf), compute_threads=1))
    runner = parts.make_runner(8, 16)
    assert isinstance(runner, TorchRunner) and runner.packed is not None


def test_packed_path_agrees_with_the_float_path(
    family_gguf: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert_packed_agrees_with_float(family_gguf, monkeypatch)


@pytest.mark.parametrize("expert_type", [Q4_K, Q4_0], ids=["Q4_K", "Q4_0"])
def test_packed_path_agrees_with_the_float_path_on_4_bit_experts(
    tmp_path: pathlib.Path, expert_type: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q4_K experts (`tiny_moe.q4_k_blocks`: gguf-py cannot write K-quants; rows of 256) and Q4_0."""
    model = mixtral_model(hidden_size=256, intermediate_size=256)
    path = write_moe_gguf(tmp_path / "tiny-mixtral.gguf", model, expert_type=expert_type)
    packed = packed_model(path)
    gate = packed.experts[0].gate[0] if packed.experts[0] is not None else None
    assert gate is not None and gate.qtype == int(expert_type)
    assert_packed_agrees_with_float(path, monkeypatch)


def test_each_expert_on_its_blocks_is_the_dequantized_expert(family_gguf: pathlib.Path) -> None:
    """Expert by expert, the packed SwiGLU over some rows is the float one over the same
    blocks dequantized, within the int8 activations' tolerance."""
    packed = packed_model(family_gguf)
    loaded = load_model(family_gguf, torch.float32)
    x = torch.randn(9, loaded.config.hidden_size, generator=torch.Generator().manual_seed(6))
    for i, experts in enumerate(packed.experts):
        assert experts is not None
        p = f"model.layers.{i}.mlp.experts."
        gate, up, down = (loaded.state_dict[p + n] for n in ("gate_proj", "up_proj", "down_proj"))
        for e in range(loaded.config.num_experts):
            assert (
                isinstance(gate, torch.Tensor)
                and isinstance(up, torch.Tensor)
                and isinstance(down, torch.Tensor)
            )
            want = torch.nn.functional.linear(
                torch.nn.functional.silu(x @ gate[e].T) * (x @ up[e].T), down[e]
            )
            got = experts.run_expert(e, x)
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() < 0.03 * scale, f"layer {i} expert {e}"


def test_the_experts_are_views_into_one_buffer_per_projection(mixtral_gguf: pathlib.Path) -> None:
    """No copy per expert: expert e's blocks start e strides into its projection's one buffer."""
    for experts in packed_model(mixtral_gguf).experts:
        assert experts is not None
        for weights in (experts.gate, experts.up, experts.down):
            base = weights[0].data
            for e, w in enumerate(weights):
                assert w.data.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
                assert w.data.data_ptr() == base.data_ptr() + e * w.data.numel()


@st.composite
def routings(draw: st.DrawFn, num_experts: int) -> Routing:
    """Any routing: T rows (none included), each of k distinct experts with any weights."""
    num_tokens = draw(st.integers(0, 12))
    top_k = draw(st.integers(1, num_experts))
    experts = [draw(st.permutations(range(num_experts)))[:top_k] for _ in range(num_tokens)]
    weights = draw(
        st.lists(
            st.lists(st.floats(0.0, 1.0, width=32), min_size=top_k, max_size=top_k),
            min_size=num_tokens,
            max_size=num_tokens,
        )
    )
    return Routing(
        torch.tensor(experts, dtype=torch.int64).view(num_tokens, top_k),
        torch.tensor(weights, dtype=torch.float32).view(num_tokens, top_k),
    )


@pytest.fixture(scope="module")
def layer_experts(mixtral_gguf: pathlib.Path) -> PackedExperts:
    experts = packed_model(mixtral_gguf).experts[1]
    assert experts is not None
    return experts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_routing_grouped_by_expert_equals_a_loop_over_tokens(
    layer_experts: PackedExperts, data: st.DataObject
) -> None:
    """The oracle: each token alone through each of its experts, weighted, in its own order."""
    routing = data.draw(routings(layer_experts.router.shape[0]))
    num_tokens = routing.experts.shape[0]
    x = torch.randn(num_tokens, layer_experts.hidden, generator=torch.Generator().manual_seed(num_tokens))
    grouped = mix(x, group_by_expert(routing, layer_experts.router.shape[0]), layer_experts.run_expert)
    assert grouped.shape == x.shape
    for t in range(num_tokens):
        row = torch.zeros(layer_experts.hidden)
        for expert, weight in zip(routing.experts[t].tolist(), routing.weights[t], strict=True):
            row += weight * layer_experts.run_expert(expert, x[t : t + 1])[0]
        assert torch.allclose(grouped[t], row, atol=1e-5, rtol=1e-5), t


def test_a_missing_or_misshapen_expert_is_refused_naming_it(mixtral_gguf: pathlib.Path) -> None:
    loaded = load_model(mixtral_gguf, torch.float32, quantized=True)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    missing = dict(loaded.state_dict)
    del missing[name]
    with pytest.raises(ValueError, match=rf"{name}: expected packed weights of shape \[128, 64\]"):
        QuantizedLlama(loaded.config, missing)
    swapped = dict(loaded.state_dict)
    swapped[name] = swapped["model.layers.1.mlp.experts.5.gate_proj.weight"]
    with pytest.raises(ValueError, match=rf"{name}: .* found \[64, 128\]"):
        QuantizedLlama(loaded.config, swapped)


def test_the_kernel_refuses_an_attention_only_layer_with_an_mlp_width(mixtral_gguf: pathlib.Path) -> None:
    runner = runner_of(load_model(mixtral_gguf, torch.float32, quantized=True))
    assert runner.packed is not None
    runner.packed.layers[0].args.inter = 64  # its w[4..6] are zeros
    with pytest.raises(kernels.KernelError, match="attention only: 1"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


def test_the_kernel_refuses_whole_qk_norms_of_the_wrong_width(tmp_path: pathlib.Path) -> None:
    runner = runner_of(
        load_model(write_moe_gguf(tmp_path / "olmoe.gguf", olmoe_model()), torch.float32, quantized=True)
    )
    assert runner.packed is not None
    runner.packed.layers[1].args.k_norm_len = 32 + 1
    with pytest.raises(kernels.KernelError, match="whole q/k norms of 128 and 33"):
        runner.forward([SeqWork(0, PROMPT[:4], 0, PAGES, True, GREEDY, 0)])


def _u32(key: str, value: int) -> Callable[[RawGGUF], RawGGUF]:
    return lambda raw: raw.set(key, U32, scalar(U32, value))


LIES: dict[str, tuple[Callable[[RawGGUF], RawGGUF], tuple[str, ...]]] = {
    "fewer experts than stored": (_u32("llama.expert_count", 4), ("blk.0.ffn_gate_inp.weight", "[4, 128]")),
    "more experts than stored": (_u32("llama.expert_count", 64), ("blk.0.ffn_gate_inp.weight", "[64, 128]")),
    "no experts": (_u32("llama.expert_count", 0), ("llama.expert_count",)),
    "a huge expert count": (_u32("llama.expert_count", 1 << 31), ("llama.expert_count",)),
    "more used than there are": (_u32("llama.expert_used_count", 9), ("llama.expert_used_count",)),
    "no used experts": (_u32("llama.expert_used_count", 0), ("llama.expert_used_count",)),
    "a wider expert ffn": (_u32("llama.feed_forward_length", 96), ("blk.0.ffn_gate_exps.weight",)),
    "one expert stack short": (dims("blk.1.ffn_up_exps.weight", 128, 64, 7), ("blk.1.ffn_up_exps.weight",)),
    "a 2-D expert stack": (dims("blk.1.ffn_down_exps.weight", 64, 1024), ("blk.1.ffn_down_exps.weight",)),
}


@pytest.mark.parametrize("dtype", ["auto", "float32"])
@pytest.mark.parametrize("case", sorted(LIES))
def test_metadata_that_lies_about_the_experts_is_a_named_error(
    prober: Prober, mixtral_gguf: pathlib.Path, tmp_path: pathlib.Path, case: str, dtype: str
) -> None:
    edit, names = LIES[case]
    edit(RawGGUF.read(mixtral_gguf)).write(tmp_path / "evil.gguf")
    assert_refused(prober.run(tmp_path / "evil.gguf", dtype), *names)


async def _greedy(engine: Engine, text: str) -> list[int]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    async with engine.open_request(PromptSpec(text=text), params=params) as stream:
        (choice,) = await stream.collect()
    return choice.token_ids


async def test_an_engine_serves_a_packed_moe_the_same_alone_and_batched(mixtral_gguf: pathlib.Path) -> None:
    """Served from the packed path, each request's greedy tokens are the same alone and in a
    batch whose tokens go to different experts (grouping never mixes rows)."""
    texts = ["Hello there", "the hell", "ello ello Hell", "Hello"]
    config = EngineConfig(model=str(mixtral_gguf), compute_threads=1, max_running_requests=4)
    with trio.fail_after(300):
        async with open_engine(config) as engine:
            alone = [await _greedy(engine, text) for text in texts]
            together: dict[str, list[int]] = {}

            async def one(text: str) -> None:
                together[text] = await _greedy(engine, text)

            async with trio.open_nursery() as nursery:
                for text in texts:
                    nursery.start_soon(one, text)
    assert all(len(tokens) == 12 for tokens in alone)
    assert [together[text] for text in texts] == alone


@pytest.mark.skipif(
    kernels.sanitizer_runtime() is None, reason="the C++ compiler has no AddressSanitizer runtime"
)
@pytest.mark.parametrize("family", ["mixtral", "olmoe"])
def test_a_packed_moe_loads_and_decodes_clean_under_the_sanitizers(
    tmp_path: pathlib.Path, family: str
) -> None:
    """The attention-only layers and OLMoE's whole-projection norms under ASan and UBSan: a
    correct file decodes without a report, and lying expert metadata is still a named error."""
    runtime = kernels.sanitizer_runtime()
    assert runtime is not None
    env = {
        "FT_KERNELS_SANITIZE": "1",
        "LD_PRELOAD": runtime,
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1",
        "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
    }
    path = write_moe_gguf(tmp_path / f"{family}.gguf", FAMILIES[family]())
    sanitized = Prober(sanitized=True, env=env)
    try:
        outcome = sanitized.run(path, timeout_s=600)  # (the first call builds the sanitized library)
        assert outcome.kind == "loaded", outcome.detail
        key = f"{'llama' if family == 'mixtral' else family}.expert_count"
        _u32(key, 4)(RawGGUF.read(path)).write(tmp_path / "evil.gguf")
        assert_refused(sanitized.run(tmp_path / "evil.gguf", timeout_s=600), "ffn_gate_inp.weight")
    finally:
        sanitized.close()


MEASURE_LOAD = """
import resource, sys, torch
from ft.model.loader import load_model
from ft.model.runners import build_runner
from ft.model.torch_runner import TorchRunner
from ft.model import kernels
kernels.library()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
runner = build_runner(load_model(sys.argv[1], torch.float32, quantized=True), num_pages=4, page_size=16,
                     dtype=torch.float32)
assert runner.packed is not None
print(before * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


@pytest.mark.slow
def test_loading_a_packed_moe_takes_about_its_file_size_in_memory(tmp_path: pathlib.Path) -> None:
    """A 150 MB synthetic Q8_0 MoE (8 experts of 2816 over hidden 1024, 2 layers) raises the
    loading process's peak RSS by little more than the file (no float copy of any expert; the
    float path would take four times the file)."""
    import subprocess
    import sys

    from tests.support.tiny_moe import write_synthetic_moe_gguf

    path = write_synthetic_moe_gguf(tmp_path / "medium.gguf", layers=2)
    size = path.stat().st_size
    done = subprocess.run(
        [sys.executable, "-c", MEASURE_LOAD, str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    before, after = (int(v) for v in done.stdout.split())
    assert after - before < 1.25 * size, (after - before, size)


@pytest.mark.parametrize(("field", "value"), [("residual_multiplier", 0.5), ("post_norms", True)])
def test_a_mixture_with_output_norms_or_a_residual_scale_is_refused_packed(
    mixtral_gguf: pathlib.Path, field: str, value: Any
) -> None:
    """`packed_moe` adds the experts' mixture unscaled and unnormed: a config asking for either
    (no supported family does yet) is refused rather than run wrong."""
    loaded = load_model(mixtral_gguf, torch.float32, quantized=True)
    config = dataclasses.replace(loaded.config, **{field: value})
    with pytest.raises(ValueError, match="does not run packed"):
        QuantizedLlama(config, loaded.state_dict)


@pytest.mark.parametrize("chunks", [[len(PROMPT)], [5, 7, 32]])
def test_prompt_logprobs_of_a_packed_mixture_are_its_own_logits(
    mixtral_gguf: pathlib.Path, chunks: list[int]
) -> None:
    """Prompt logprobs through the routed experts, one chunk or several: prompt token p + 1's
    score is the log-softmax at p of the packed model fed the prompt up to p alone."""
    from ft.core.batch import Scored

    runner = runner_of(load_model(mixtral_gguf, torch.float32, quantized=True))
    params = SamplingParams(temperature=0.0, prompt_logprobs=2)
    scores = []
    start = 0
    for n in chunks:
        end = start + n
        ids = PROMPT[start + 1 : min(end, len(PROMPT) - 1) + 1]
        work = SeqWork(0, PROMPT[start:end], start, PAGES, end == len(PROMPT), params, 0,
                       score_offset=0, score_ids=ids)  # fmt: skip
        scores += [s for out in runner.step([work]) if isinstance(out, Scored) for s in out.scores]
        start = end
    assert [s.token_id for s in scores] == list(PROMPT[1:])
    for p in (0, 6, 20, len(PROMPT) - 2):
        logits = runner.forward([SeqWork(1, PROMPT[: p + 1], 0, PAGES, True, GREEDY, 0)])
        assert logits is not None
        logprobs = logits[0].log_softmax(-1)
        assert abs(scores[p].logprob - logprobs[PROMPT[p + 1]].item()) < 1e-4
        for (token, lp), want in zip(scores[p].top_logprobs, logprobs.topk(2).values.tolist(), strict=True):
            assert abs(lp - want) < 1e-4 and abs(logprobs[token].item() - lp) < 1e-4
