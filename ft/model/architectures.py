"""The architecture registry: one `Architecture` per model family ft runs.

Every choice that depends on the family is read from its entry, never from a name compared in
a loader or a runner: which Hugging Face `model_type`/`architectures` and GGUF
`general.architecture` names it answers to, how its `config.json` maps onto `LlamaConfig`, the
blocks it uses (qkv bias, per-head q/k norm), its GGUF tensor names and whether llama.cpp's
converter permuted its q/k rows, and the `<think>` format its chat template asks for.
`docs/structure.md` says how to add a family.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# GGUF tensor names of a decoder layer (after `blk.N.`) → Hugging Face names (after
# `model.layers.N.`), shared by every family; an entry adds its own in `gguf_layer_extra`.
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's expert tensors: the router [experts, hidden] and each projection of every expert
# stacked, [experts, rows, columns]
MOE_NAMES = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
}
QK_NORM_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# Phi-3: llama.cpp keeps the fused projections as stored (`ffn_up` holds gate | up)
FUSED_NAMES = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}


@dataclass(frozen=True, slots=True)
class Architecture:
    """One model family: the names it answers to and the blocks it is made of.

    `qkv_bias` is the default when `config.json` has no `attention_bias` (a GGUF says it by its
    tensors); `qk_norm` is Qwen3's RMSNorm over each head of q and k before the rotary
    embedding; `moe` replaces every layer's MLP by routed experts (`ft.model.moe`); `packed`
    says the packed GGUF kernels run its layers (otherwise its GGUFs load as floats);
    `reasoning_parser` is the server's reasoning format for it when none is configured, and
    `tool_call_parser` its tool-call format (None: hermes);
    `gguf_permuted_qk` names the GGUF architectures whose q/k rows llama.cpp's
    converter interleaved by rotary pairs (undone at load); `gguf_fused` says its GGUFs hold
    q|k|v as one `attn_qkv` and gate|up as one `ffn_up` (Phi-3), split by rows at load;
    `gguf_no_rope_interval` n: every n-th layer has no rotary (SmolLM3: llama.cpp hard-codes
    4, no GGUF key says it).
    """

    name: str
    hf_model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    gguf_names: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    packed: bool = True  # a quantized GGUF of it runs as stored (`quantized_llama`)
    reasoning_parser: str | None = None  # the `<think>` format its template asks the model for
    gguf_permuted_qk: tuple[str, ...] = ()
    gguf_layer_extra: dict[str, str] = field(default_factory=dict)
    gguf_fused: bool = False
    gguf_no_rope_interval: int = 0
    tool_call_parser: str | None = None  # the tool-call format its template asks for (None: hermes)
    # its config's `sliding_window` shapes attention: refused while shorter than the context
    # (ft has no sliding-window attention yet); other families' windows are ignored as before
    refuses_short_window: bool = False

    @property
    def gguf_layer_names(self) -> dict[str, str]:
        """This family's GGUF layer tensor names → Hugging Face names."""
        return GGUF_LAYER_NAMES | self.gguf_layer_extra


LLAMA = Architecture(
    name="llama",
    hf_model_types=("llama",),
    hf_architectures=("LlamaForCausalLM",),
    gguf_names=("llama",),
    gguf_permuted_qk=("llama",),
)
MISTRAL = Architecture(
    name="mistral",
    hf_model_types=("mistral",),
    hf_architectures=("MistralForCausalLM",),
    gguf_names=("mistral",),  # llama.cpp writes most Mistral files as "llama": see `by_gguf`
    gguf_permuted_qk=("llama",),
)
QWEN2 = Architecture(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_architectures=("Qwen2ForCausalLM",),
    gguf_names=("qwen2",),
    qkv_bias=True,
)
QWEN3 = Architecture(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_architectures=("Qwen3ForCausalLM",),
    gguf_names=("qwen3",),
    qk_norm=True,
    gguf_layer_extra=QK_NORM_NAMES,
    reasoning_parser="think",
)

QWEN3_MOE = Architecture(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_architectures=("Qwen3MoeForCausalLM",),
    gguf_names=("qwen3moe",),
    qk_norm=True,
    moe=True,
    packed=False,
    gguf_layer_extra=QK_NORM_NAMES | MOE_NAMES,
    reasoning_parser="think",
)

# Phi-3 / Phi-4-mini: fused projections, partial rotary, longrope (`LlamaConfig.from_hf`)
PHI3 = Architecture(
    name="phi3",
    hf_model_types=("phi3",),
    hf_architectures=("Phi3ForCausalLM",),
    gguf_names=("phi3",),
    gguf_layer_extra=FUSED_NAMES,
    gguf_fused=True,
    tool_call_parser="phi4_mini_json",
    refuses_short_window=True,
)
# SmolLM3: every fourth layer without rotary; `<think>` reasoning (its template's /think, /no_think)
SMOLLM3 = Architecture(
    name="smollm3",
    hf_model_types=("smollm3",),
    hf_architectures=("SmolLM3ForCausalLM",),
    gguf_names=("smollm3",),
    gguf_permuted_qk=("smollm3",),
    gguf_no_rope_interval=4,
    reasoning_parser="think",
)
# Granite (3.x dense): embedding, residual, attention and logit multipliers
GRANITE = Architecture(
    name="granite",
    hf_model_types=("granite",),
    hf_architectures=("GraniteForCausalLM",),
    gguf_names=("granite",),
    gguf_permuted_qk=("granite",),
    tool_call_parser="granite",
)

ARCHITECTURES: tuple[Architecture, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, PHI3, SMOLLM3, GRANITE)


def by_name(name: str) -> Architecture:
    """The entry `LlamaConfig.architecture` names (ft's own name for the family)."""
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise ValueError(f"architecture {name!r} is not supported (supported: {supported_names()})")


def by_hf(cfg: dict[str, Any]) -> Architecture:
    """The entry a Hugging Face `config.json` describes: its `architectures`, else `model_type`.

    Raises:
        ValueError: neither names a supported family (the message lists the supported ones).
    """
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ValueError(f"config.json 'architectures' must be a list of names, found {archs!r:.80}")
    for arch in ARCHITECTURES:
        named_here = any(a in arch.hf_architectures for a in archs)
        if named_here or (not archs and model_type in arch.hf_model_types):
            return arch
    if not archs and model_type is None:
        return LLAMA  # an old config.json with neither key
    named = archs or [model_type]
    supported = ", ".join(a for arch in ARCHITECTURES for a in arch.hf_architectures)
    raise ValueError(f"architecture {named} is not supported (supported: {supported})")


def by_gguf(gguf_arch: str, model_name: str = "") -> Architecture:
    """The entry a GGUF's `general.architecture` names (a "llama" file whose `general.name`
    says Mistral is Mistral, as llama.cpp's converter writes them).

    Raises:
        ValueError: the name is not a supported family's.
    """
    for arch in ARCHITECTURES:
        if gguf_arch in arch.gguf_names:
            if arch is LLAMA and "mistral" in model_name.lower():
                return MISTRAL
            return arch
    supported = ", ".join(n for arch in ARCHITECTURES for n in arch.gguf_names)
    raise ValueError(f"GGUF architecture {gguf_arch!r} is not supported (supported: {supported})")


def supported_names() -> str:
    """The families, for error messages."""
    return ", ".join(arch.name for arch in ARCHITECTURES)
