"""The Llama decoder over weights as GGUF stores them: one native call per layer (`kernels.cpp`).

Each layer (norms, q/k/v/o and gate/up/down products on packed blocks, Qwen3's q/k head norms,
rotary (partial for Phi-3, none on SmolLM3's NoPE layers), Granite's residual and softmax
scales, the KV write and paged attention) runs in one call with torch's OpenMP threads; Python
only prepares the step's index arrays. Activations are float32; the products quantize
activations to int8 blocks of 32, as llama.cpp does; the KV cache is float32, float16, bfloat16
or q8_0 blocks (`kernels.Q8_0_KV`: written quantized by the layer, read in place by its
attention).

A mixture-of-experts layer (Qwen3-MoE, Mixtral, OLMoE) runs its attention in that call, stopped
after the attention residual (`LayerArgs.attention_only`), then its routed experts, still GGUF
blocks, through `packed_moe.PackedExperts`.

Every row is computed the same way whatever else is in the step (the kernels never mix rows),
so a request's tokens do not depend on its batch, on prefix-cache hits, on how its prompt was
chunked or on a preemption's recompute.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from ft.core.batch import Heartbeat
from ft.model import kernels
from ft.model.llama import LlamaConfig, rope_attention_scale, rope_inv_freq, rope_local_inv_freq
from ft.model.packed_moe import PackedExperts
from ft.model.quant import QuantTensor

_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


@dataclass(frozen=True, slots=True)
class StepIndex:
    """Where each of a step's T new tokens goes and what it attends to."""

    slot_of: torch.Tensor  # [T] int64: KV slot written by the token
    seq: torch.Tensor  # [T] int64: the token's row in block_tables
    positions: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_pages] int32: each sequence's pages


class _Layer:
    """One layer's weights and its `kernels.LayerArgs`, which points into them (`keep` holds
    every tensor a pointer reads, for as long as the layer lives)."""

    __slots__ = ("args", "keep", "is_local_rope")

    def __init__(
        self,
        config: LlamaConfig,
        sd: dict[str, torch.Tensor | QuantTensor],
        prefix: str,
        index: int,
        *,
        attention_only: bool,
    ) -> None:
        def norm(name: str) -> torch.Tensor:  # (1 + w) folded in where the file does not hold it
            w = _float(sd[prefix + name])
            return w + config.norm_offset if config.norm_offset else w

        norm1 = norm("input_layernorm.weight")
        # Gemma's names: its pre-MLP norm is pre_feedforward_layernorm, and post_attention_layernorm
        # norms the attention's output
        norm2 = norm(
            "pre_feedforward_layernorm.weight" if config.post_norms else "post_attention_layernorm.weight"
        )
        out_norms = (
            (norm("post_attention_layernorm.weight"), norm("post_feedforward_layernorm.weight"))
            if config.post_norms
            else (None, None)
        )
        # a layer of routed experts runs only its attention natively (`packed_moe` runs the rest)
        projections = _PROJECTIONS[:4] if attention_only else _PROJECTIONS
        quant = [_quant(sd[prefix + name + ".weight"]) for name in projections]
        biases = [sd.get(prefix + f"self_attn.{p}_proj.bias") for p in "qkv"]
        bias = torch.cat([_float(b) for b in biases]) if all(b is not None for b in biases) else None
        norms = [sd.get(prefix + f"self_attn.{p}_norm.weight") for p in "qk"]  # Qwen3's head norms
        q_norm, k_norm = (_float(n) + config.norm_offset if n is not None else None for n in norms)
        self.keep = [norm1, norm2, bias, q_norm, k_norm, *out_norms, *quant]
        self.args = kernels.LayerArgs(
            hidden=config.hidden_size,
            heads=config.num_heads,
            kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            inter=0 if attention_only else config.intermediate_size,
            eps=config.rms_norm_eps,
            norm1=norm1.data_ptr(),
            norm1_len=norm1.numel(),
            norm2=norm2.data_ptr(),
            norm2_len=norm2.numel(),
            w=(kernels.Weight * len(_PROJECTIONS))(*(_weight(q) for q in quant)),  # (zeros past them)
            bias=_ptr(bias),
            bias_len=bias.numel() if bias is not None else 0,
            q_norm=_ptr(q_norm),
            k_norm=_ptr(k_norm),
            qk_norm_len=q_norm.numel() if q_norm is not None else 0,
            attn_out_norm=_ptr(out_norms[0]),
            mlp_out_norm=_ptr(out_norms[1]),
            post_norm_len=out_norms[0].numel() if out_norms[0] is not None else 0,
            gelu=int(config.hidden_act == "gelu_pytorch_tanh"),
            query_scale=config.query_scale,
            attn_softcap=config.attn_softcap,
            window=config.layer_window(index),
            attention_only=int(attention_only),
            qk_norm_whole=int(config.qk_norm_whole),
            k_norm_len=k_norm.numel() if k_norm is not None else 0,
            rotary_dim=config.rotary_dim,
            no_rope=int(index in config.no_rope_layers),
            residual_scale=config.residual_multiplier,
            attn_scale=config.attention_multiplier,
        )
        self.is_local_rope = bool(config.layer_window(index) and config.rope_local_theta)


def _weight(q: QuantTensor) -> kernels.Weight:
    return kernels.Weight(q.qtype, q.data.data_ptr(), q.rows, q.data.shape[1], q.columns)


def _float(t: torch.Tensor | QuantTensor | None) -> torch.Tensor:
    assert isinstance(t, torch.Tensor), type(t)
    return t.float().contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _quant(t: torch.Tensor | QuantTensor) -> QuantTensor:
    assert isinstance(t, QuantTensor), type(t)
    return t


class QuantizedLlama:
    """Embedding, decoder stack, final norm and lm_head over GGUF blocks."""

    def __init__(self, config: LlamaConfig, sd: dict[str, torch.Tensor | QuantTensor]) -> None:
        self.config = config
        self.lib = kernels.library()
        self.embed = _quant(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        self.lm_head = self.embed if head is None or config.tie_word_embeddings else _quant(head)
        if min(self.embed.rows, self.lm_head.rows) < config.vocab_size:  # logits cover the vocabulary
            raise ValueError(
                f"the model's vocabulary ({config.vocab_size}) is larger than its embedding "
                f"({self.embed.rows} rows) or lm_head ({self.lm_head.rows} rows)"
            )
        self.norm = _float(sd["model.norm.weight"])
        if config.num_experts and (config.post_norms or config.residual_multiplier != 1.0):
            # NOTE: `packed_moe` adds the experts' mixture to x as it is (no output norm, no scale)
            raise ValueError(
                "a mixture of experts with output norms or a residual multiplier does not run packed"
            )
        prefixes = [f"model.layers.{i}." for i in range(config.num_layers)]
        self.layers = [
            _Layer(config, sd, p, i, attention_only=config.is_moe_layer(i)) for i, p in enumerate(prefixes)
        ]
        self.experts = [
            PackedExperts(config, sd, p, self.lib) if config.is_moe_layer(i) else None
            for i, p in enumerate(prefixes)
        ]
        self.inv_freq = rope_inv_freq(config)
        self.local_inv_freq = rope_local_inv_freq(config)  # Gemma 3's windowed layers'
        # NOTE: transformers rounds the factor to the embedding's dtype; here float32
        self.embed_scale = (
            float(torch.tensor(config.hidden_size**0.5, dtype=torch.float32)) if config.embed_scale else 0.0
        )
        self.rope_scale = rope_attention_scale(config)  # longrope's, on cos and sin

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        index: StepIndex,
        k_caches: torch.Tensor,  # [layers, num_slots, kv_heads, head_dim] float32/float16/bfloat16,
        v_caches: torch.Tensor,  # or q8_0 blocks: uint8 [layers, num_slots, kv_heads, head_dim // 32 * 34]
        page_size: int,
        heartbeat: Heartbeat | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, `[T, hidden]`; writes the tokens' KV. `heartbeat`
        beats once a layer."""
        kv_type = kernels.kv_code_of(k_caches)
        c = self.config
        x = kernels.dequantize_rows(self.embed, input_ids)  # [T, hidden]
        if self.embed_scale:
            x.mul_(self.embed_scale)
        if c.embedding_multiplier != 1.0:  # Granite
            x *= c.embedding_multiplier
        num_tokens, hidden = x.shape
        freqs = index.positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim // 2]
        cos, sin = freqs.cos().contiguous(), freqs.sin().contiguous()
        if self.rope_scale != 1.0:
            cos *= self.rope_scale
            sin *= self.rope_scale
        local_cos, local_sin = cos, sin
        if self.local_inv_freq is not None:
            local = index.positions.float()[:, None] * self.local_inv_freq[None, :]  # [T, head_dim // 2]
            local_cos, local_sin = local.cos().contiguous(), local.sin().contiguous()
        threads = torch.get_num_threads()
        tables = index.block_tables
        # NOTE: every size passed is the buffer's own; the kernel checks them against each other
        # and against each weight's rows and row bytes.
        step = kernels.StepArgs(
            rows=num_tokens,
            slot_of=index.slot_of.data_ptr(),
            seq=index.seq.data_ptr(),
            num_seqs=tables.shape[0],
            pos=index.positions.data_ptr(),
            block_tables=tables.data_ptr(),
            max_pages=tables.shape[1],
            page_size=page_size,
            num_slots=k_caches.shape[1],
            kv_slot_bytes=k_caches[0][0].numel() * k_caches.element_size(),
            kv_type=kv_type,
            threads=threads,
        )
        for i, layer in enumerate(self.layers):
            layer_cos, layer_sin = (local_cos, local_sin) if layer.is_local_rope else (cos, sin)
            kernels.check(self.lib, self.lib.ft_decoder_layer(
                ctypes.byref(layer.args), ctypes.byref(step), x.data_ptr(), hidden, layer_cos.data_ptr(),
                layer_sin.data_ptr(), layer_cos.shape[1], k_caches[i].data_ptr(), v_caches[i].data_ptr(),
            ))  # fmt: skip
            experts = self.experts[i]
            if experts is not None:  # the layer stopped after attention: its routed MLP
                experts.forward(x)
            if heartbeat is not None:
                heartbeat.beat()
        out = torch.empty_like(x)
        kernels.check(self.lib, self.lib.ft_rms_norm(
            x.data_ptr(), num_tokens, hidden, hidden, self.norm.data_ptr(), self.norm.numel(), c.rms_norm_eps,
            out.data_ptr(),
        ))  # fmt: skip
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over `hidden` `[R, hidden]` → `[R, vocab]`."""
        rows = hidden.contiguous()
        out = torch.empty(rows.shape[0], self.lm_head.rows)
        kernels.gemm_into(out, self.lm_head, kernels.QuantizedActivations(rows))
        if self.config.logits_scaling != 1.0:  # Granite's logits divided
            out /= self.config.logits_scaling
        return out
