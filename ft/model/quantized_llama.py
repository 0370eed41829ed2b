"""The Llama decoder over weights as GGUF stores them: one C++ call per layer (`kernels.cpp`).

Each layer (norms, q/k/v/o and gate/up/down products on packed blocks, rotary, the KV write and
paged attention) runs in one native call with torch's OpenMP threads; Python only prepares the
step's index arrays. Activations and the KV cache are float32; the products quantize activations
to int8 blocks of 32, as llama.cpp does.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ft.model import kernels
from ft.model.llama import LlamaConfig, apply_rope, rope_inv_freq
from ft.model.quant import QuantTensor

# NOTE: oneDNN's matmuls give a row different last bits depending on how many rows share the
# call (seen for 3, 5, 8, 16, 17, 31 and 32 of 64 rows here), but the same bits for a row wherever
# it sits in a call of a fixed size. Tiles of 64 cost 2x a single call in bfloat16 here; 32, 3x.
DENSE_TILE = 64

_PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


class _Weight(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
    ]


@dataclass(frozen=True, slots=True)
class StepIndex:
    """Where each of a step's T new tokens goes and what it attends to."""

    slot_of: torch.Tensor  # [T] int64: KV slot written by the token
    seq: torch.Tensor  # [T] int64: the token's row in block_tables
    positions: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_pages] int32: each sequence's pages


class _Layer:
    __slots__ = ("norm1", "norm2", "bias", "weights", "keep", "q", "k", "v", "o", "gate", "up", "down")

    def __init__(self, sd: dict[str, torch.Tensor | QuantTensor], prefix: str) -> None:
        self.norm1 = _float(sd[prefix + "input_layernorm.weight"])
        self.norm2 = _float(sd[prefix + "post_attention_layernorm.weight"])
        quant = [_quant(sd[prefix + name + ".weight"]) for name in _PROJECTIONS]
        self.keep = quant  # the arrays behind the raw pointers
        self.q, self.k, self.v, self.o, self.gate, self.up, self.down = quant
        self.weights = (_Weight * len(quant))(
            *(_Weight(q.qtype, q.data.data_ptr(), q.rows, q.data.shape[1]) for q in quant)
        )
        biases = [sd.get(prefix + f"self_attn.{p}_proj.bias") for p in "qkv"]
        self.bias = torch.cat([_float(b) for b in biases]) if all(b is not None for b in biases) else None


def _float(t: torch.Tensor | QuantTensor | None) -> torch.Tensor:
    assert isinstance(t, torch.Tensor), type(t)
    return t.float().contiguous()


def _quant(t: torch.Tensor | QuantTensor) -> QuantTensor:
    assert isinstance(t, QuantTensor), type(t)
    return t


class QuantizedLlama:
    """Embedding, decoder stack, final norm and lm_head over GGUF blocks."""

    def __init__(
        self, config: LlamaConfig, sd: dict[str, torch.Tensor | QuantTensor], dense_dtype: torch.dtype
    ) -> None:
        self.config = config
        self.dense_dtype = dense_dtype  # compute dtype of the dequantized (prefill) path
        self.lib = kernels.library()
        self.embed = _quant(sd["model.embed_tokens.weight"])
        head = sd.get("lm_head.weight")
        self.lm_head = self.embed if head is None or config.tie_word_embeddings else _quant(head)
        self.norm = _float(sd["model.norm.weight"])
        self.layers = [_Layer(sd, f"model.layers.{i}.") for i in range(config.num_layers)]
        self.inv_freq = rope_inv_freq(config)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` `[T]` of the embedding, dequantized → `[T, hidden]`."""
        e = self.embed
        out = torch.empty(ids.shape[0], e.cols)
        ids = ids.contiguous()
        self.lib.ft_dequantize_rows(
            e.qtype, e.data.data_ptr(), e.data.shape[1], e.cols, ids.data_ptr(), ids.shape[0], out.data_ptr()
        )
        return out

    def forward_packed(
        self,
        input_ids: torch.Tensor,  # [T]
        index: StepIndex,
        k_caches: torch.Tensor,  # [layers, num_slots, kv_heads, head_dim] float32
        v_caches: torch.Tensor,
        page_size: int,
    ) -> torch.Tensor:
        """Hidden states after the final norm, `[T, hidden]`, through the packed kernels (one
        native call per layer); writes the tokens' KV. Each row's arithmetic is the same
        whatever else is in the step."""
        c = self.config
        x = self.embed_tokens(input_ids)  # [T, hidden]
        num_tokens = x.shape[0]
        cos, sin = self._rotary(index.positions)
        threads = torch.get_num_threads()
        tables = index.block_tables
        for i, layer in enumerate(self.layers):
            self.lib.ft_decoder_layer(
                x.data_ptr(), num_tokens, c.hidden_size, layer.norm1.data_ptr(), layer.norm2.data_ptr(),
                c.rms_norm_eps, layer.weights, layer.bias.data_ptr() if layer.bias is not None else None,
                cos.data_ptr(), sin.data_ptr(), k_caches[i].data_ptr(), v_caches[i].data_ptr(),
                index.slot_of.data_ptr(), index.seq.data_ptr(), index.positions.data_ptr(), tables.data_ptr(),
                tables.shape[1], page_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                threads,
            )  # fmt: skip
        return self._final_norm(x)

    def forward_dense(
        self,
        input_ids: torch.Tensor,  # [T]
        index: StepIndex,
        k_caches: torch.Tensor,
        v_caches: torch.Tensor,
        page_size: int,
    ) -> torch.Tensor:
        """Hidden states after the final norm, `[T, hidden]`, with torch matmuls over weights
        dequantized layer by layer into scratch matrices (prompt chunks: many rows share each
        dequantization, and oneDNN multiplies them in AMX bfloat16 where the CPU has it).

        Row for row the same numbers whatever the step holds: the matmuls run on fixed tiles
        of `DENSE_TILE` rows (oneDNN picks its kernel by row count) and the norms and the
        attention are the native row-wise ones.
        """
        c = self.config
        x = self.embed_tokens(input_ids)  # [T, hidden]
        num_tokens = x.shape[0]
        cos, sin = self._rotary(index.positions)
        cos2 = torch.cat((cos, cos), -1)[:, None, :]  # [T, 1, head_dim]
        sin2 = torch.cat((sin, sin), -1)[:, None, :]
        threads = torch.get_num_threads()
        tables = index.block_tables
        attn = torch.empty(num_tokens, c.q_size)
        for i, layer in enumerate(self.layers):
            h = self._rms_norm(x, layer.norm1)
            q, k, v = (self._linear(h, w) for w in (layer.q, layer.k, layer.v))
            if layer.bias is not None:
                qb, kb, vb = layer.bias.split([c.q_size, c.kv_size, c.kv_size])
                q, k, v = q + qb, k + kb, v + vb
            q = apply_rope(q.view(num_tokens, c.num_heads, c.head_dim), cos2, sin2).contiguous()
            k = apply_rope(k.view(num_tokens, c.num_kv_heads, c.head_dim), cos2, sin2)
            k_caches[i].index_copy_(0, index.slot_of, k)
            v_caches[i].index_copy_(0, index.slot_of, v.view(num_tokens, c.num_kv_heads, c.head_dim))
            k_cache, v_cache = k_caches[i], v_caches[i]
            self.lib.ft_attention(
                q.data_ptr(), num_tokens, k_cache.data_ptr(), v_cache.data_ptr(), index.seq.data_ptr(),
                index.positions.data_ptr(), tables.data_ptr(), tables.shape[1], page_size, c.num_heads,
                c.num_kv_heads, c.head_dim, attn.data_ptr(), threads,
            )  # fmt: skip
            x = x + self._linear(attn, layer.o)
            h = self._rms_norm(x, layer.norm2)
            x = x + self._linear(F.silu(self._linear(h, layer.gate)) * self._linear(h, layer.up), layer.down)
        return self._final_norm(x)

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, head_dim // 2]
        return freqs.cos().contiguous(), freqs.sin().contiguous()

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        num_tokens = x.shape[0]
        out = torch.empty_like(x)
        self.lib.ft_rms_norm(
            x.data_ptr(), num_tokens, c.hidden_size, c.hidden_size, self.norm.data_ptr(), c.rms_norm_eps,
            out.data_ptr(),
        )  # fmt: skip
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over `hidden` `[R, hidden]` → `[R, vocab]`."""
        rows = hidden.contiguous()
        out = torch.empty(rows.shape[0], self.lm_head.rows)
        kernels.gemm_into(
            out, self.lm_head.qtype, self.lm_head.data, self.lm_head.cols, kernels.QuantizedActivations(rows)
        )
        return out

    def dense(self, w: QuantTensor) -> torch.Tensor:
        """`w` dequantized `[rows, cols]` in the dense path's dtype."""
        out = torch.empty(w.rows, w.cols)
        ids = torch.arange(w.rows)
        self.lib.ft_dequantize_rows(
            w.qtype, w.data.data_ptr(), w.data.shape[1], w.cols, ids.data_ptr(), w.rows, out.data_ptr()
        )
        return out.to(self.dense_dtype)

    def _linear(self, x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
        """`x @ w.T` on tiles of `DENSE_TILE` rows (the last one zero-padded)."""
        weight = self.dense(w)
        rows = x.shape[0]
        padded = -(-rows // DENSE_TILE) * DENSE_TILE
        xs = torch.zeros(padded, x.shape[1], dtype=self.dense_dtype)
        xs[:rows] = x
        out = torch.empty(padded, w.rows, dtype=self.dense_dtype)
        for start in range(0, padded, DENSE_TILE):
            torch.mm(xs[start : start + DENSE_TILE], weight.T, out=out[start : start + DENSE_TILE])
        return out[:rows].float()

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.ft_rms_norm(
            x.data_ptr(), x.shape[0], c.hidden_size, c.hidden_size, weight.data_ptr(), c.rms_norm_eps,
            out.data_ptr(),
        )  # fmt: skip
        return out
