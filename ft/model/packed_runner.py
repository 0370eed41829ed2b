"""`PackedRunner`: the GGUF's blocks as stored, one native call per layer (`QuantizedLlama`)."""

from __future__ import annotations

import torch

from ft.core.batch import SeqWork
from ft.model import kernels
from ft.model.loader import LoadedModel
from ft.model.parallel.group import RankGroup
from ft.model.quantized_llama import QuantizedLlama, StepIndex
from ft.model.torch_runner import TorchRunner


class PackedRunner(TorchRunner):
    """Steps through `QuantizedLlama`: float32 activations, on the CPU, in one process; the KV
    cache in any dtype the kernels store (float16 by default, q8_0 blocks)."""

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
    ) -> None:
        kv = kv_dtype or dtype
        kernels.kv_cache_layout(kv, loaded.config.head_dim)  # raises for q8_0 on odd heads
        if quantize is not None or dtype != torch.float32:
            raise ValueError("weights kept as stored need float32 activations and no --quantize")
        kernels.kv_code(kv)  # raises for a type the kernels cannot store
        if ranks is not None or (device is not None and device.type != "cpu"):
            raise ValueError("weights kept as stored run on the CPU in one process; load them as floats")
        super().__init__(
            loaded, num_pages=num_pages, page_size=page_size, dtype=dtype, threads=threads, kv_dtype=kv_dtype
        )
        self.packed = QuantizedLlama(self.config, loaded.state_dict)
        self._set_lm_head(self.packed.logits)

    def _hidden(self, works: list[SeqWork], token_ids: list[int], positions: list[int]) -> torch.Tensor:
        ids = torch.tensor(token_ids, dtype=torch.long)  # the packed path is CPU-only
        index = self._step_index(works, positions)
        return self.packed.forward(ids, index, self.k_cache, self.v_cache, self._page_size, self.heartbeat)

    def _step_index(self, works: list[SeqWork], positions: list[int]) -> StepIndex:
        page = self._page_size
        max_pages = max((w.start_pos + len(w.token_ids) + page - 1) // page for w in works)
        tables = torch.zeros(len(works), max_pages, dtype=torch.int32)
        seq: list[int] = []
        slots: list[int] = []
        for i, w in enumerate(works):
            pages = w.page_ids[:max_pages]
            tables[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            seq.extend([i] * len(w.token_ids))
            span = range(w.start_pos, w.start_pos + len(w.token_ids))
            slots.extend(pages[q // page] * page + q % page for q in span)
        return StepIndex(
            slot_of=torch.tensor(slots, dtype=torch.long),
            seq=torch.tensor(seq, dtype=torch.long),
            positions=torch.tensor(positions, dtype=torch.long),
            block_tables=tables,
        )
