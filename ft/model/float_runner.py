"""`FloatRunner`: the model as a torch module over float (or fbgemm int8) weights."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
import torch.utils.mkldnn

from ft.config import Q8_0_KV_PATH, QUANTIZATIONS
from ft.core.batch import SeqWork
from ft.model import gemma4, kernels
from ft.model.architectures import by_name
from ft.model.attention import SeqSpan, build_metadata
from ft.model.gemma4_config import Gemma4Config
from ft.model.hybrid import HybridForCausalLM
from ft.model.llama import LlamaForCausalLM, build_model
from ft.model.loader import LoadedModel
from ft.model.parallel.group import RankGroup
from ft.model.parallel.shard import build_rank_model
from ft.model.parallel.steps import gathered_lm_head
from ft.model.quant import QuantTensor
from ft.model.recurrent import StateTensors
from ft.model.torch_runner import TorchRunner


def prepacked_linear(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear` as a oneDNN prepacked float32 linear where available, else unchanged.

    For the vocabulary projection ([49152, 576] on the default model) oneDNN ran 1.4-2x faster
    than the default float32 matmul on this machine's AVX2 cores (9.6 -> 5.5 ms at 1 row,
    27 -> 20 ms at 16 rows), with logits within 1.4e-4. The per-layer projections gained
    nothing, so only the lm_head uses it.
    """
    if linear.weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return linear
    packed = torch.utils.mkldnn.to_mkldnn(linear)

    def run(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = packed(x.to_mkldnn()).to_dense()
        return out

    return run


def quantize_linears(model: torch.nn.Module) -> None:
    """Every `nn.Linear` as fbgemm's dynamic int8 linear: per-output-channel int8 weights,
    float32 activations quantized per call.

    On this machine's AVX2 cores it ran the model's projections about 2x faster and the
    vocabulary projection 5-8x faster than float32 (9.3 -> 1.1 ms at 1 row), at about 1-2%
    relative error per projection. (torch marks `torch.ao.quantization` deprecated; it is
    present and working in the pinned torch 2.13.)
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_dynamic(
            model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True
        )


class FloatRunner(TorchRunner):
    """Steps through a torch `LlamaForCausalLM` (Gemma 4: `gemma4.Gemma4ForCausalLM`, in one
    process) on `device` (the CPU or CUDA, eager), in `dtype`, or with fbgemm's int8 linears
    (`quantize`, CPU only). Under tensor parallelism it holds one rank's shard and its
    lm_head's logits are gathered over the ranks. A hybrid model
    (`ft.model.hybrid`) holds `num_state_slots` recurrent state slots beside its KV pages."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        threads: int | None = None,
        quantize: str | None = None,
        kv_dtype: kernels.KVDtype | None = None,
        device: torch.device | None = None,
        ranks: RankGroup | None = None,
        num_state_slots: int = 0,
    ) -> None:
        if any(isinstance(v, QuantTensor) for v in loaded.state_dict.values()):
            raise ValueError("weights kept as stored run on the packed runner")
        if (kv_dtype or dtype) == kernels.Q8_0_KV:
            raise ValueError(Q8_0_KV_PATH)
        if ranks is not None and loaded.config.is_hybrid:
            raise ValueError("tensor parallelism is not supported for models with recurrent layers")
        super().__init__(
            loaded,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            threads=threads,
            kv_dtype=kv_dtype,
            device=device,
            ranks=ranks,
            num_state_slots=num_state_slots,
        )
        on_cpu = self.device.type == "cpu"
        self.model: LlamaForCausalLM | gemma4.Gemma4ForCausalLM
        if by_name(self.config.architecture).decoder == "gemma4":
            if ranks is not None:
                raise ValueError("Gemma 4 runs in one process (no tensor parallelism yet)")
            assert isinstance(self.config, Gemma4Config)
            self.model = gemma4.build_model(self.config, loaded.state_dict, dtype, device=self.device)  # type: ignore[arg-type]
        elif ranks is None:
            self.model = build_model(self.config, loaded.state_dict, dtype, device=self.device)  # type: ignore[arg-type]
        else:
            self.model = build_rank_model(self.config, loaded.state_dict, dtype, ranks)  # type: ignore[arg-type]
        if isinstance(self.model, HybridForCausalLM):
            self.states = StateTensors(self.model.state_shapes(), num_state_slots, self.device)
        if quantize is not None:
            if quantize not in QUANTIZATIONS or dtype != torch.float32 or not on_cpu:
                raise ValueError(
                    f"quantize must be one of {QUANTIZATIONS} with float32 activations on the CPU"
                )
            quantize_linears(self.model)  # in place
        head = (
            self.model.lm_head if quantize is not None or not on_cpu else prepacked_linear(self.model.lm_head)
        )
        if ranks is not None and ranks.world > 1:
            head = gathered_lm_head(ranks, head, self.config.vocab_size)
        self._set_lm_head(head)

    def _hidden(self, works: list[SeqWork], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        spans = [SeqSpan(w.start_pos, len(w.token_ids), w.page_ids) for w in works]
        if self.states is None:
            return self._forward_torch(token_ids, positions, spans)
        state_spans = StateTensors.spans(works)
        meta = build_metadata(spans, self._page_size, self.config.sliding_window)
        if self.device.type != "cpu":
            meta = meta.to(self.device)
        hidden, new = self.model(
            *self._token_tensors(token_ids, positions),
            self.k_cache,
            self.v_cache,
            meta,
            state_spans,
            self.states.layers,
            self.heartbeat,
        )  # [T, hidden], and per recurrent layer each span's states
        self._new_states = (state_spans, new)  # written once the whole step has succeeded
        out: torch.Tensor = hidden
        return out

    def _token_tensors(self, token_ids: list[int], positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(self.device, non_blocking=True),
        )

    def _forward_torch(
        self, token_ids: list[int], positions: list[int], spans: list[SeqSpan]
    ) -> torch.Tensor:
        meta = build_metadata(spans, self._page_size, self.config.sliding_window)
        if self.device.type != "cpu":
            meta = meta.to(self.device)
        hidden: torch.Tensor = self.model(
            *self._token_tensors(token_ids, positions),
            self.k_cache,
            self.v_cache,
            meta,
            self.heartbeat,
        )  # [T, hidden]
        return hidden
