"""The architecture registry: one `Architecture` per model family ft runs.

Every choice that depends on the family is read from its entry, never from a name compared in
a loader or a runner: which Hugging Face `model_type`/`architectures` and GGUF
`general.architecture` names it answers to, how its `config.json` maps onto `LlamaConfig`, the
blocks it uses (qkv bias, per-head q/k norm), its GGUF tensor names and whether llama.cpp's
converter permuted its q/k rows, and the `<think>` format its chat template asks for.
`docs/structure.md` says how to add a family.
"""

from __future__ import annotations

import re
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
# Gemma's four norms a layer (llama.cpp's `ffn_norm` is its pre-MLP norm, as in Llama; the
# attention's and the MLP's outputs have norms of their own)
GEMMA_NORM_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3: llama.cpp keeps the fused projections as stored (`ffn_up` holds gate | up)
FUSED_NAMES = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}


@dataclass(frozen=True, slots=True)
class ConverterLoss:
    """A `config.json` setting llama.cpp's converter does not write into the family's GGUFs,
    which llama.cpp (and so ft) replaces by a rule of its own: `setting` names the checkpoint's
    setting, `key` the GGUF key (after `{arch}.`) that would say it (None: llama.cpp reads none),
    `assumed` what runs instead. A checkpoint whose setting differs converts to another model.
    `warns`: said as a warning at load (a setting published checkpoints use, the window);
    otherwise logged as info (what llama.cpp assumes is what the published checkpoints have)."""

    setting: str
    key: str | None
    assumed: str
    warns: bool = False


# Mistral's and Mixtral's converter (llama.cpp's `LlamaModel`) writes no window; llama.cpp's
# `llama` architecture attends everything.
NO_WINDOW = ConverterLoss(
    "sliding_window", "attention.sliding_window", "every layer attends the whole context", warns=True
)


@dataclass(frozen=True, slots=True)
class Architecture:
    """One model family: the names it answers to and the blocks it is made of.

    `qkv_bias` is the default when `config.json` has no `attention_bias` (a GGUF says it by its
    tensors); `qk_norm` is Qwen3's RMSNorm over each head of q and k before the rotary
    embedding (`qk_norm_whole`: OLMoE's, over the whole q and the whole k projection);
    `moe` replaces every layer's MLP by routed experts (`ft.model.moe`; `router_renormalizes`
    True: the family always renormalizes its top-k weights, as Mixtral does, None: its config
    says, `norm_topk_prob`, or a GGUF's `expert_weights_norm`, else `gguf_expert_weights_norm`,
    llama.cpp's default for the family); `packed`
    says the packed GGUF kernels run its layers (otherwise its GGUFs load as floats);
    `reasoning_parser` is the server's reasoning format for it when none is configured, and
    `tool_call_parser` its tool-call format (one of `ft.core.toolcalls.TOOL_CALL_PARSERS`;
    None: the one its chat template spells, else hermes: a family of Qwen3-Coder's XML calls,
    Qwen3.5's or Qwen3-Next's, names `qwen3_coder`, a Qwen3.5 also `reasoning_parser="think"`,
    whose template opens the block itself; Gemma 4 names `gemma4` for both);
    `gguf_permuted_qk` names the GGUF architectures whose q/k rows llama.cpp's
    converter interleaved by rotary pairs (undone at load); `gguf_fused` says its GGUFs hold
    q|k|v as one `attn_qkv` and gate|up as one `ffn_up` (Phi-3), split by rows at load;
    `gguf_no_rope_interval` n: every n-th layer has no rotary (SmolLM3: llama.cpp hard-codes
    4, no GGUF key says it); `gguf_converter_losses` the checkpoint settings its GGUFs do not
    carry (`ConverterLoss`: the loader warns when a file does not say them).

    `gemma` is Gemma's blocks: the embedding scaled by sqrt(hidden), GeGLU, `(1 + weight)`
    norms (llama.cpp's converter adds the 1 to the GGUF's norms), norms on the attention's and
    the MLP's outputs, the softmax scaled by `query_pre_attn_scalar`. `windowed` says the
    config's `sliding_window` applies; `sliding_period` is the layer pattern of a windowed
    model whose config lists none (every `n`th layer attends everything, as llama.cpp's
    `set_swa_pattern(n)`; 0: every layer is windowed); `local_rope_theta` the windowed layers'
    rotary base when the config gives none (a GGUF never does: llama.cpp's value);
    `end_of_turn` the token the family's chat template closes a turn with, a stop token
    beside the file's eos (llama.cpp's EOT), `gguf_stop_texts` further tokens a GGUF of it
    stops at, found by their text as llama.cpp finds them; `gguf_window` the window of a GGUF without
    `{arch}.attention.sliding_window` (llama.cpp's default; -1: the key is required);
    `gguf_softcaps` llama.cpp's attention and final soft-caps when the file has none;
    `gguf_wide_query_scale_layers` the layer counts (the 27B models) whose query scale
    llama.cpp takes as hidden / heads instead of the head size (a GGUF does not store
    `query_pre_attn_scalar`). `hf_text_defaults` reads a multimodal checkpoint's text model: its
    `text_config` over these defaults (transformers', which hub configs leave out), its weights
    renamed by `hf_weight_prefixes` and every other weight (the vision tower) left out.

    `decoder` names the module whose torch model runs the family: "llama" (`ft.model.llama`,
    every family but one) or "gemma4" (`ft.model.gemma4`: layers of their own head sizes, KV
    shared across layers, per-layer embeddings; float weights, one process, eager);
    `gguf_refusal`, when set, is why its GGUFs do not load (said at load).
    `mixer` names the recurrent mixer of a hybrid family's non-attention layers
    (`ft.model.hybrid.MIXERS`; its `config.json` is read by `hybrid.HF_CONFIGS`), None for a
    family that only attends; `hf_weight_renames` are the (old, new) parts of its Hugging Face
    weight names renamed at load to the Llama family's (`mlp.gate_proj`, `self_attn.o_proj`, ...);
    `hf_float32_weights` parts of the names of weights read in float32 whatever the dtype (a
    mixer's small parameters, which its module keeps in float32: `float32_parameters`).
    `hybrid_attention` names what a hybrid's attention layers and norms are
    (`ft.model.hybrid.ATTENTIONS`: "llama", the Llama family's; "gated", Qwen3.5's).
    """

    name: str
    hf_model_types: tuple[str, ...]
    hf_architectures: tuple[str, ...]
    gguf_names: tuple[str, ...]
    qkv_bias: bool = False
    qk_norm: bool = False
    moe: bool = False
    qk_norm_whole: bool = False
    router_renormalizes: bool | None = None
    gguf_expert_weights_norm: bool = True
    packed: bool = True  # a quantized GGUF of it runs as stored (`quantized_llama`)
    reasoning_parser: str | None = None  # the reasoning format its template asks the model for
    # A GGUF reranker's head outputs are softmaxed (llama.cpp does for Qwen3: its converter writes
    # Qwen3-Reranker's lm_head rows of "yes" and "no" as the two labels; the score is p(yes)).
    rank_softmax: bool = False
    gguf_permuted_qk: tuple[str, ...] = ()
    gguf_layer_extra: dict[str, str] = field(default_factory=dict)
    gemma: bool = False
    windowed: bool = False
    sliding_period: int = 0
    local_rope_theta: float = 0.0
    end_of_turn: str | None = None
    gguf_stop_texts: tuple[str, ...] = ()
    gguf_window: int = 0
    gguf_softcaps: tuple[float, float] = (0.0, 0.0)
    gguf_wide_query_scale_layers: tuple[int, ...] = ()
    hf_text_defaults: dict[str, Any] = field(default_factory=dict)
    hf_weight_prefixes: tuple[tuple[str, str], ...] = ()
    gguf_fused: bool = False
    gguf_no_rope_interval: int = 0
    tool_call_parser: str | None = None  # the tool-call format its template asks for (None: hermes)
    gguf_converter_losses: tuple[ConverterLoss, ...] = ()
    decoder: str = "llama"
    gguf_refusal: str = ""
    mixer: str | None = None
    hf_weight_renames: tuple[tuple[str, str], ...] = ()
    hf_float32_weights: tuple[str, ...] = ()
    hybrid_attention: str = "llama"

    def hf_weight_name(self, name: str) -> str:
        """A Hugging Face weight's name as the loader files it (`hf_weight_renames` applied)."""
        for old, new in self.hf_weight_renames:
            name = name.replace(old, new)
        return name

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
    windowed=True,  # Mistral 7B v0.1's 4096 on every layer
    gguf_converter_losses=(NO_WINDOW,),
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
    rank_softmax=True,
)

QWEN3_MOE = Architecture(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_architectures=("Qwen3MoeForCausalLM",),
    gguf_names=("qwen3moe",),
    qk_norm=True,
    moe=True,
    gguf_layer_extra=QK_NORM_NAMES | MOE_NAMES,
    reasoning_parser="think",
    # llama.cpp's qwen3moe graph always renormalizes (every published Qwen3-MoE says
    # norm_topk_prob true; transformers' default is false); its converter writes no key.
    gguf_converter_losses=(
        ConverterLoss("norm_topk_prob", "expert_weights_norm", "the top-k routing weights renormalized"),
    ),
)
# Mixtral: Mistral's attention (its `sliding_window` on every layer, as Mistral's), experts of
# `intermediate_size`, always renormalized top-k (the softmax over the k chosen logits);
# llama.cpp writes it as a "llama" file with expert tensors (see `by_gguf`).
MIXTRAL = Architecture(
    name="mixtral",
    hf_model_types=("mixtral",),
    hf_architectures=("MixtralForCausalLM",),
    gguf_names=(),
    moe=True,
    router_renormalizes=True,
    gguf_permuted_qk=("llama",),
    gguf_layer_extra=MOE_NAMES,
    windowed=True,
    gguf_converter_losses=(NO_WINDOW,),
)
# OLMoE: RMSNorm over the whole q and k projections, softmax over every expert then top-k,
# not renormalized unless `norm_topk_prob` (llama.cpp never renormalizes it).
OLMOE = Architecture(
    name="olmoe",
    hf_model_types=("olmoe",),
    hf_architectures=("OlmoeForCausalLM",),
    gguf_names=("olmoe",),
    qk_norm=True,
    qk_norm_whole=True,
    moe=True,
    gguf_expert_weights_norm=False,
    gguf_layer_extra=QK_NORM_NAMES | MOE_NAMES,
    gguf_converter_losses=(
        ConverterLoss(
            "norm_topk_prob", "expert_weights_norm", "the top-k routing weights as the softmax gave them"
        ),
    ),
)

GEMMA2 = Architecture(
    name="gemma2",
    hf_model_types=("gemma2",),
    hf_architectures=("Gemma2ForCausalLM",),
    gguf_names=("gemma2",),
    gemma=True,
    windowed=True,
    sliding_period=2,  # even layers windowed
    gguf_layer_extra=GEMMA_NORM_NAMES,
    end_of_turn="<end_of_turn>",
    gguf_window=4096,
    gguf_softcaps=(50.0, 30.0),
    gguf_wide_query_scale_layers=(46,),
)
# transformers' `Gemma3TextConfig` defaults, which the hub's multimodal configs (Gemma 3 4B and
# up) leave out of their `text_config`
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "sliding_window_pattern": 6, "tie_word_embeddings": True,
}  # fmt: skip
GEMMA3 = Architecture(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    hf_architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    gguf_names=("gemma3",),
    qk_norm=True,
    gemma=True,
    windowed=True,
    sliding_period=6,  # 5 windowed layers, then one global
    gguf_layer_extra=GEMMA_NORM_NAMES | QK_NORM_NAMES,
    local_rope_theta=10000.0,
    end_of_turn="<end_of_turn>",
    gguf_window=-1,
    gguf_wide_query_scale_layers=(62,),
    hf_text_defaults=GEMMA3_TEXT_DEFAULTS,
    hf_weight_prefixes=(
        ("language_model.model.", "model."),  # as the hub's and transformers' checkpoints name them
        ("model.language_model.", "model."),
        ("language_model.lm_head.", "lm_head."),
        ("lm_head.", "lm_head."),
    ),
)

# Gemma 4's text models (`ft.model.gemma4_config`): sliding and global layers of different head
# sizes, per-layer embeddings on the E models, KV shared by the last layers, optional experts.
# Its GGUFs (`ft.model.gguf_gemma4`) run dequantized on the same decoder; what the converter
# does not write runs as llama.cpp's Gemma 4 graph runs it.
GEMMA4 = Architecture(
    name="gemma4",
    hf_model_types=("gemma4_text", "gemma4"),
    hf_architectures=("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"),
    gguf_names=("gemma4",),
    packed=False,
    windowed=True,
    end_of_turn="<turn|>",
    gguf_stop_texts=("<|tool_response>",),  # llama.cpp ends Gemma 4's generation there too
    reasoning_parser="gemma4",  # <|channel>thought\n…<channel|>
    tool_call_parser="gemma4",  # <|tool_call>call:NAME{…}<tool_call|>
    hf_weight_prefixes=(("model.language_model.", "model."), ("lm_head.", "lm_head.")),
    decoder="gemma4",
    gguf_converter_losses=(
        ConverterLoss(
            "hidden_activation", None, "GELU (tanh) in the MLP, the experts and the per-layer gate"
        ),
        # (written when the checkpoint sets one; transformers' default is none)
        ConverterLoss("final_logit_softcapping", "final_logit_softcapping", "the logits soft-capped at 30"),
        ConverterLoss(
            "rope_parameters.full_attention.factor",
            "rope.scaling.factor",
            "the global layers' rotary unscaled",
        ),
        ConverterLoss(
            "rope_parameters.sliding_attention", None, "the sliding layers' rotary over every pair, unscaled"
        ),
    ),
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
    # Phi-3-mini-4k's 2047 on every layer, as transformers masks (llama.cpp drops Phi-3's window:
    # ft follows the model as trained, on GGUFs too)
    windowed=True,
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
    gguf_converter_losses=(
        ConverterLoss("no_rope_layers", None, "every 4th layer without rotary (SmolLM3-3B's interval)"),
    ),
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

# LFM2: short convolutions (a recurrent state per sequence, `ft.model.short_conv`) and, between
# them, attention layers with per-head q/k RMSNorm; its GGUFs read back into the checkpoint's
# form by `ft.model.gguf_hybrid` (`gguf_loader.gguf_config` sends them there).
LFM2 = Architecture(
    name="lfm2",
    hf_model_types=("lfm2",),
    hf_architectures=("Lfm2ForCausalLM",),
    gguf_names=("lfm2",),
    qk_norm=True,
    packed=False,
    mixer="short_conv",
    hf_weight_renames=(
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".feed_forward.w1.", ".mlp.gate_proj."),
        (".feed_forward.w3.", ".mlp.up_proj."),
        (".feed_forward.w2.", ".mlp.down_proj."),
        (".operator_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        ("model.embedding_norm.", "model.norm."),  # (the final norm, after the last layer)
    ),
)

# Granite 4.0-H (transformers' `granitemoehybrid`): Mamba-2 layers (`ft.model.mamba2`) and
# attention layers without rotary, each followed by routed experts plus a shared MLP (or the
# shared MLP alone), Granite's multipliers; its GGUFs read back into the checkpoint's form by
# `ft.model.gguf_hybrid`. Its template asks for hermes tool
# calls (`<tool_call>`), not Granite 3's `<|tool_call|>`.
GRANITE_HYBRID = Architecture(
    name="granite_hybrid",
    hf_model_types=("granitemoehybrid",),
    hf_architectures=("GraniteMoeHybridForCausalLM",),
    gguf_names=("granitehybrid",),
    packed=False,
    mixer="mamba2",
    hf_weight_renames=(
        (".block_sparse_moe.router.layer.", ".mlp.gate."),
        (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),  # [E, 2I, H], gate first
        (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),  # [E, H, I]
        (".shared_mlp.input_linear.", ".mlp.gate_up_proj."),  # gate | up, as Phi-3's
        (".shared_mlp.output_linear.", ".mlp.down_proj."),
    ),
    hf_float32_weights=(".mamba.A_log", ".mamba.D", ".mamba.dt_bias", ".mamba.conv1d.", ".mamba.norm."),
)

# Qwen3.5 (dense), Qwen3.5-MoE and Qwen3-Next: three Gated DeltaNet layers (`ft.model.deltanet`)
# to each gated attention layer, (1 + w) norms (`ft.model.qwen35`); the MoE families' experts
# have a shared expert beside them; tool calls in Qwen3-Coder's XML (`ft.core.toolcall_xml`).
# Qwen3.5's checkpoints are multimodal (the text model under `model.language_model.`, the
# vision tower left out); the multi-token prediction head (`mtp.*`) is not run. Their GGUFs are
# read back into the checkpoint's form by `ft.model.gguf_hybrid`.
QWEN35_TEXT = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
QWEN35_FLOAT32 = (".linear_attn.A_log", ".linear_attn.dt_bias", ".linear_attn.conv1d.", ".linear_attn.norm.")
QWEN3_5 = Architecture(
    name="qwen3_5",
    hf_model_types=("qwen3_5", "qwen3_5_text"),
    hf_architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
    gguf_names=(),
    packed=False,
    reasoning_parser="think",
    tool_call_parser="qwen3_coder",
    hf_weight_prefixes=QWEN35_TEXT,
    mixer="gated_deltanet",
    hf_float32_weights=QWEN35_FLOAT32,
    hybrid_attention="gated",
)
QWEN3_5_MOE = Architecture(
    name="qwen3_5_moe",
    hf_model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    hf_architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    gguf_names=(),
    moe=True,
    router_renormalizes=True,  # transformers' `Qwen3_5MoeTopKRouter` always does
    packed=False,
    reasoning_parser="think",
    tool_call_parser="qwen3_coder",
    hf_weight_prefixes=QWEN35_TEXT,
    mixer="gated_deltanet",
    hf_float32_weights=QWEN35_FLOAT32,
    hybrid_attention="gated",
)
QWEN3_NEXT = Architecture(
    name="qwen3_next",
    hf_model_types=("qwen3_next",),
    hf_architectures=("Qwen3NextForCausalLM",),
    gguf_names=(),
    moe=True,
    packed=False,
    reasoning_parser="think",
    tool_call_parser="qwen3_coder",
    hf_weight_prefixes=QWEN35_TEXT,
    mixer="gated_deltanet",
    hf_float32_weights=QWEN35_FLOAT32,
    hybrid_attention="gated",
)

ARCHITECTURES: tuple[Architecture, ...] = (
    LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, MIXTRAL, OLMOE, GEMMA2, GEMMA3, GEMMA4, PHI3, SMOLLM3,
    GRANITE, LFM2, GRANITE_HYBRID, QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT,
)  # fmt: skip


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
    # A sequence classifier (a reranker) is its family's decoder with a score head instead of
    # the lm_head (`ft.model.classifier`).
    causal = [re.sub(r"ForSequenceClassification$", "ForCausalLM", a) for a in archs]
    for arch in ARCHITECTURES:
        named_here = any(a in arch.hf_architectures for a in causal)
        if named_here or (not archs and model_type in arch.hf_model_types):
            return arch
    if not archs and model_type is None:
        return LLAMA  # an old config.json with neither key
    named = archs or [model_type]
    supported = ", ".join(a for arch in ARCHITECTURES for a in arch.hf_architectures)
    raise ValueError(f"architecture {named} is not supported (supported: {supported})")


def by_gguf(gguf_arch: str, model_name: str = "", has_experts: bool = False) -> Architecture:
    """The entry a GGUF's `general.architecture` names (a "llama" file whose `general.name`
    says Mistral is Mistral, and one with `llama.expert_count` (`has_experts`) Mixtral, as
    llama.cpp's converter writes them).

    Raises:
        ValueError: the name is not a supported family's.
    """
    for arch in ARCHITECTURES:
        if gguf_arch in arch.gguf_names:
            if arch.gguf_refusal:
                raise ValueError(arch.gguf_refusal)
            if arch is LLAMA and has_experts:
                return MIXTRAL
            if arch is LLAMA and "mistral" in model_name.lower():
                return MISTRAL
            return arch
    supported = ", ".join(n for arch in ARCHITECTURES for n in arch.gguf_names)
    raise ValueError(f"GGUF architecture {gguf_arch!r} is not supported (supported: {supported})")


def supported_names() -> str:
    """The families, for error messages."""
    return ", ".join(arch.name for arch in ARCHITECTURES)
