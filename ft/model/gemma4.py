"""Gemma 4's text decoder over the paged KV cache, as transformers computes it
(`Gemma4ForCausalLM`, and the text model of `Gemma4ForConditionalGeneration`).

A layer: `x + post_attention_norm(attention(input_norm(x)))`, then
`h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))` (with `enable_moe_block`, the routed
experts over `h` added to the MLP's output, each through norms of its own), then with per-layer
embeddings `h + post_per_layer_input_norm(projection(act(gate(h)) * per_layer_input))`, all
times the layer's stored `layer_scalar`. The attention: q, k and v each RMS-normed per head (v
without a weight), the rotary on q and k, a softmax scale of 1, heads of the layer's own size
(`Gemma4Config`). A layer that stores KV writes it to its cache; a KV-sharing layer only reads
its source layer's (`kv_layout.layer_caches`: the caches differ in shape per layer).

The per-layer inputs (PLE) of token t for layer i are
`(norm(W x_t / sqrt(hidden))_i + E[t]_i * sqrt(ple)) / sqrt(2)`: a projection of the scaled
embedding `x_t` and a lookup in a table of `num_layers * ple` columns per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ft.model import kv_layout
from ft.model.attention import AttentionMetadata, paged_attention, write_kv
from ft.model.gemma4_config import Gemma4Config, Rotary
from ft.model.llama import apply_rope, rope_cos_sin
from ft.model.moe import Routing, group_by_expert, mix, route

if TYPE_CHECKING:
    from ft.core.batch import Heartbeat


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * (mean(x^2) + eps) ** -0.5 over the last dim, in float32 (`Gemma4RMSNorm`'s pow)."""
    x32 = x.float()
    return x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)


class Gemma4Norm(nn.Module):
    """Gemma 4's RMSNorm: the weight as stored (not 1 + w), multiplied in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms(x, self.eps) * self.weight.float()).type_as(x)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The config's `hidden_activation` (the MLP's, the experts' and the PLE gate's)."""
    if name == "silu":
        return F.silu
    return lambda x: F.gelu(x, approximate="tanh")


def rope_inv_freq(rope: Rotary, head_dim: int) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` in float32 (transformers' "proportional", of which
    "default" is the whole head): the turning pairs first, zeros for the pairs that stay."""
    pairs = int(rope.fraction * head_dim // 2)
    turning = 1.0 / (rope.theta ** (torch.arange(0, 2 * pairs, 2, dtype=torch.int64).float() / head_dim))
    inv_freq = torch.cat([turning, torch.zeros(head_dim // 2 - pairs)]) / rope.factor
    if rope.pair_factors:  # (checked against the head's pairs where they were read)
        inv_freq = inv_freq / torch.tensor(rope.pair_factors, dtype=torch.float32)
    return inv_freq


class Gemma4Experts(nn.Module):
    """The routed experts beside a layer's MLP (`enable_moe_block`): the router reads the
    residual stream RMS-normed (no weight) times `router_scale / sqrt(hidden)`, takes the top-k
    of its softmax, renormalizes them and scales each by its expert's `expert_scale`; each
    expert is a gated MLP of `moe_intermediate_size` over the stream normed by `pre_norm`, run
    grouped by expert (`ft.model.moe`); their sum goes through `post_norm`."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.top_k = config.num_experts_per_tok
        self.eps = config.rms_norm_eps
        self.act = activation(config.hidden_act)
        self.router = nn.Parameter(torch.empty(e, h))
        self.router_scale = nn.Parameter(torch.ones(h))
        self.expert_scale = nn.Parameter(torch.ones(e))
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down = nn.Parameter(torch.empty(e, h, i))
        self.pre_norm = Gemma4Norm(h, config.rms_norm_eps)
        self.post_norm = Gemma4Norm(h, config.rms_norm_eps)

    def route(self, x: torch.Tensor) -> Routing:
        """Each row's experts and weights, from the residual stream `x` `[T, hidden]`."""
        scaled = rms(x, self.eps).type_as(x) * self.router_scale * x.shape[-1] ** -0.5
        routing = route(F.linear(scaled, self.router), self.top_k, renormalize=True)
        return Routing(routing.experts, routing.weights * self.expert_scale[routing.experts])

    def run_expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `expert` over rows `x` `[n, hidden]` → `[n, hidden]`."""
        gate, up = F.linear(x, self.gate_up[expert]).chunk(2, dim=-1)  # [n, inter] each
        out: torch.Tensor = F.linear(self.act(gate) * up, self.down[expert])
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        groups = group_by_expert(self.route(x), self.gate_up.shape[0])
        out: torch.Tensor = self.post_norm(mix(self.pre_norm(x), groups, self.run_expert))
        return out


class Gemma4Layer(nn.Module):
    """One decoder layer (index `index`): its attention's own head size and kv heads, its KV
    stored or read from its source layer, its MLP (and experts, and per-layer input)."""

    def __init__(self, config: Gemma4Config, index: int) -> None:
        super().__init__()
        c = config
        h, eps = c.hidden_size, c.rms_norm_eps
        self.index = index
        self.head_dim = c.layer_head_dims[index]
        self.kv_heads = c.layer_kv_heads[index]
        self.window = c.layer_window(index)
        self.stores_kv = c.stores_kv(index)
        self.has_values = c.has_values(index)
        self.eps = eps
        self.act = activation(c.hidden_act)
        self.q_size = c.num_heads * self.head_dim
        self.kv_size = self.kv_heads * self.head_dim
        kv_out = self.kv_size * (1 + self.has_values) if self.stores_kv else 0
        self.qkv_proj = nn.Linear(h, self.q_size + kv_out, bias=False)  # q | k | v (the ones it has)
        self.q_norm = Gemma4Norm(self.head_dim, eps)
        self.k_norm = Gemma4Norm(self.head_dim, eps) if self.stores_kv else None
        self.o_proj = nn.Linear(self.q_size, h, bias=False)
        self.input_layernorm = Gemma4Norm(h, eps)
        self.post_attention_layernorm = Gemma4Norm(h, eps)  # the attention's output
        self.pre_feedforward_layernorm = Gemma4Norm(h, eps)
        self.post_feedforward_layernorm = Gemma4Norm(h, eps)  # the MLP's (and experts') output
        inter = c.mlp_size(index)
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.experts = Gemma4Experts(c) if c.num_experts else None
        self.mlp_out_norm = Gemma4Norm(h, eps) if c.num_experts else None  # the MLP's, beside the experts
        ple = c.per_layer_input_size
        self.per_layer_input_gate = nn.Linear(h, ple, bias=False) if ple else None
        self.per_layer_projection = nn.Linear(ple, h, bias=False) if ple else None
        self.post_per_layer_input_norm = Gemma4Norm(h, eps) if ple else None
        self.layer_scalar: torch.Tensor
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, head_dim]
        sin: torch.Tensor,
        k_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim]: this layer's, or its source's
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        per_layer_input: torch.Tensor | None,  # [T, ple]
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))  # [T, q_size + kv_out]
        q = qkv[:, : self.q_size].reshape(num_tokens, -1, self.head_dim)  # [T, heads, hd]
        q = apply_rope(self.q_norm(q), cos, sin)
        if self.k_norm is not None:
            k = qkv[:, self.q_size : self.q_size + self.kv_size].reshape(
                num_tokens, self.kv_heads, self.head_dim
            )
            v = (
                qkv[:, self.q_size + self.kv_size :].reshape(k.shape) if self.has_values else k
            )  # [T, kvh, hd]
            k = apply_rope(self.k_norm(k), cos, sin)
            v = rms(v, self.eps).type_as(v)  # the v norm has no weight
            write_kv(k_cache, v_cache, k, v, meta)
        attn = paged_attention(
            q, k_cache, v_cache, meta, windowed=self.window > 0, scale=1.0
        )  # [T, heads*hd]
        h = x + self.post_attention_layernorm(self.o_proj(attn))
        d = self.down_proj(self._gated(self.gate_up_proj(self.pre_feedforward_layernorm(h))))  # [T, hidden]
        if self.experts is not None and self.mlp_out_norm is not None:
            d = self.mlp_out_norm(d) + self.experts(h)
        h = h + self.post_feedforward_layernorm(d)
        if per_layer_input is not None:
            assert self.per_layer_input_gate is not None and self.per_layer_projection is not None
            assert self.post_per_layer_input_norm is not None
            gate = self.act(self.per_layer_input_gate(h)) * per_layer_input  # [T, ple]
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        out: torch.Tensor = h * self.layer_scalar
        return out

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act(gate) * up


class Gemma4ForCausalLM(nn.Module):
    """Scaled embedding, per-layer inputs, the layers, final norm and (tied) lm_head; the final
    soft-cap is the runner's (`TorchRunner._set_lm_head`)."""

    def __init__(self, config: Gemma4Config) -> None:
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Gemma4Layer(c, i) for i in range(c.num_layers))
        self.norm = Gemma4Norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        ple = c.per_layer_input_size
        width = c.num_layers * ple
        self.embed_tokens_per_layer = nn.Embedding(c.per_layer_vocab_size, width) if ple else None
        self.per_layer_model_projection = nn.Linear(c.hidden_size, width, bias=False) if ple else None
        self.per_layer_projection_norm = Gemma4Norm(ple, c.rms_norm_eps) if ple else None
        self.cache_of_layer = [c.kv_cache_index(i) for i in range(c.num_layers)]
        self.sliding_inv_freq, self.full_inv_freq = inv_freqs(c)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        k_caches: torch.Tensor,  # `kv_layout.cache_shape` of the config's `kv_shapes`
        v_caches: torch.Tensor,
        meta: AttentionMetadata,
        heartbeat: Heartbeat | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, `[T, hidden]`; `heartbeat` beats once a layer."""
        c = self.config
        # NOTE: the factor rounded to float32, then to the embedding's dtype, as transformers does
        x = self.embed_tokens(input_ids) * torch.tensor(c.hidden_size**0.5).to(self.embed_tokens.weight.dtype)
        per_layer = self._per_layer_inputs(input_ids, x)  # [T, layers, ple] or None
        sliding = rope_cos_sin(self.sliding_inv_freq, positions, x.dtype)
        full = rope_cos_sin(self.full_inv_freq, positions, x.dtype)
        k_layers = kv_layout.layer_caches(k_caches, c.kv_shapes)
        v_layers = kv_layout.layer_caches(v_caches, c.kv_shapes)
        for i, layer in enumerate(self.layers):
            cos, sin = sliding if c.is_sliding(i) else full
            cache = self.cache_of_layer[i]
            layer_input = per_layer[:, i] if per_layer is not None else None
            x = layer(x, cos, sin, k_layers[cache], v_layers[cache], meta, layer_input)
            if heartbeat is not None:
                heartbeat.beat()
        out: torch.Tensor = self.norm(x)
        return out

    def _per_layer_inputs(self, input_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """The per-layer inputs `[T, layers, ple]` of the tokens (None: the model has none)."""
        if self.embed_tokens_per_layer is None:
            return None
        assert self.per_layer_model_projection is not None and self.per_layer_projection_norm is not None
        c = self.config
        shape = (input_ids.shape[0], c.num_layers, c.per_layer_input_size)
        weight = self.embed_tokens_per_layer.weight
        scale = torch.tensor(c.per_layer_input_size**0.5).to(weight.dtype)
        tokens = (self.embed_tokens_per_layer(input_ids) * scale).reshape(shape)
        projected = self.per_layer_model_projection(x) * c.hidden_size**-0.5
        projected = self.per_layer_projection_norm(projected.reshape(shape))
        out: torch.Tensor = (projected + tokens) * 2.0**-0.5
        return out


def inv_freqs(config: Gemma4Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The sliding and the global layers' inverse frequencies (each type's own head size)."""
    c = config
    sliding = next((i for i in range(c.num_layers) if c.is_sliding(i)), 0)
    full = next((i for i in range(c.num_layers) if not c.is_sliding(i)), 0)
    return (
        rope_inv_freq(c.sliding_rope, c.layer_head_dims[sliding]),
        rope_inv_freq(c.full_rope, c.layer_head_dims[full]),
    )


def fuse_hf_state_dict(config: Gemma4Config, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map transformers' Gemma 4 parameter names onto `Gemma4ForCausalLM`'s (q|k|v and gate|up
    fused; the KV-sharing layers' k/v weights, which some checkpoints hold, left out).

    Raises:
        ValueError: the checkpoint lacks a weight the config asks for (named).
    """

    def take(name: str) -> torch.Tensor:
        if name not in sd:
            raise ValueError(f"the Gemma 4 checkpoint lacks {name}")
        return sd[name]

    c = config
    out = {"embed_tokens.weight": take("model.embed_tokens.weight"), "norm.weight": take("model.norm.weight")}
    lm_head = sd.get("lm_head.weight")
    out["lm_head.weight"] = (
        out["embed_tokens.weight"] if lm_head is None or c.tie_word_embeddings else lm_head
    )
    if c.per_layer_input_size:
        for name in ("embed_tokens_per_layer", "per_layer_model_projection", "per_layer_projection_norm"):
            out[name + ".weight"] = take(f"model.{name}.weight")
    for i in range(c.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        attn = p + "self_attn."
        names = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm"]
        names += ["post_feedforward_layernorm", "self_attn.q_norm", "self_attn.o_proj", "mlp.down_proj"]
        if c.stores_kv(i):
            names.append("self_attn.k_norm")
        if c.per_layer_input_size:
            names += ["per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm"]
        for name in names:
            out[o + name.removeprefix("self_attn.").removeprefix("mlp.") + ".weight"] = take(
                p + name + ".weight"
            )
        qkv = [take(attn + "q_proj.weight")]
        if c.stores_kv(i):
            qkv.append(take(attn + "k_proj.weight"))
            if c.has_values(i):
                qkv.append(take(attn + "v_proj.weight"))
        out[o + "qkv_proj.weight"] = torch.cat(qkv)
        out[o + "gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
        )
        out[o + "layer_scalar"] = sd.get(p + "layer_scalar", torch.ones(1))
        if c.num_experts:
            e = o + "experts."
            out[e + "router"] = take(p + "router.proj.weight")
            out[e + "router_scale"] = take(p + "router.scale")
            out[e + "expert_scale"] = take(p + "router.per_expert_scale")
            out[e + "gate_up"] = take(p + "experts.gate_up_proj")
            out[e + "down"] = take(p + "experts.down_proj")
            out[e + "pre_norm.weight"] = take(p + "pre_feedforward_layernorm_2.weight")
            out[e + "post_norm.weight"] = take(p + "post_feedforward_layernorm_2.weight")
            out[o + "mlp_out_norm.weight"] = take(p + "post_feedforward_layernorm_1.weight")
    return out


def build_model(
    config: Gemma4Config,
    hf_state_dict: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    device: torch.device | None = None,
) -> Gemma4ForCausalLM:
    """Build on the meta device, then assign the (fused, cast) weights on `device`."""
    device = device or torch.device("cpu")
    fused = fuse_hf_state_dict(config, hf_state_dict)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    model.load_state_dict(
        {k: v.to(device=device, dtype=dtype).contiguous() for k, v in fused.items()}, assign=True, strict=True
    )
    sliding, full = inv_freqs(config)  # made on meta, and not in the state dict
    model.sliding_inv_freq, model.full_inv_freq = sliding.to(device), full.to(device)
    return model.eval()
