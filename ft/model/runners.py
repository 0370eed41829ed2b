"""Which runner runs a model: `build_runner` chooses the class once, from the execution plan.

`PackedRunner` (`packed_runner.py`) runs the GGUF's blocks as stored through the native
kernels, `FloatRunner` (`float_runner.py`) a torch model eagerly, `GraphedRunner`
(`cuda_graphs.py`) a torch model whose decode steps replay CUDA graphs. All three are
`TorchRunner`s (`torch_runner.py`: the KV pages, sampling, scoring, pooling they share).
"""

from __future__ import annotations

from typing import Literal

import torch

from ft.model import kernels
from ft.model.architectures import by_name
from ft.model.loader import LoadedModel
from ft.model.parallel.group import RankGroup
from ft.model.quant import QuantTensor
from ft.model.torch_runner import TorchRunner

RunnerKind = Literal["packed", "float", "graphed"]


def runner_kind(
    loaded: LoadedModel,
    *,
    device: torch.device,
    cuda_graphs: bool,
    ranks: RankGroup | None,
    quantize: str | None,
) -> RunnerKind:
    """The kind a caller without a plan gets (tests, tools): what `ExecutionPlan.runner` decides
    for the engine, read from what was loaded and asked for."""
    if any(isinstance(v, QuantTensor) for v in loaded.state_dict.values()):
        return "packed"
    world = ranks.world if ranks is not None else 1
    if loaded.config.is_hybrid:
        return "float"  # (its recurrent states are neither packed nor captured in graphs)
    if (
        cuda_graphs
        and device.type != "cpu"
        and world == 1
        and quantize is None
        and not loaded.config.num_experts
        and by_name(loaded.config.architecture).decoder == "llama"
    ):
        return "graphed"
    return "float"


def build_runner(
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
    cuda_graphs: bool = True,
    kind: RunnerKind | None = None,
    num_state_slots: int = 0,
) -> TorchRunner:
    """The runner of `kind` (the plan's `ExecutionPlan.runner`; None: `runner_kind`) for
    `loaded`, over `num_pages` KV pages of `page_size` slots (and, for a model with recurrent
    layers, `num_state_slots` state slots: it runs on the float runner only).

    Raises:
        ValueError: a combination the chosen runner cannot run (each keeps its own guards).
    """
    from ft.model.cuda_graphs import GraphedRunner
    from ft.model.float_runner import FloatRunner
    from ft.model.packed_runner import PackedRunner

    device = device or torch.device("cpu")
    kind = kind or runner_kind(loaded, device=device, cuda_graphs=cuda_graphs, ranks=ranks, quantize=quantize)
    if loaded.config.is_hybrid:
        if kind != "float":
            raise ValueError(f"models with recurrent layers run on the float runner, not the {kind} one")
        return FloatRunner(
            loaded,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            threads=threads,
            quantize=quantize,
            kv_dtype=kv_dtype,
            device=device,
            ranks=ranks,
            num_state_slots=num_state_slots,
        )
    if kind == "graphed":
        if ranks is not None or quantize is not None:
            raise ValueError("CUDA graphs run one rank's float model (no --quantize)")
        return GraphedRunner(
            loaded,
            num_pages=num_pages,
            page_size=page_size,
            dtype=dtype,
            threads=threads,
            kv_dtype=kv_dtype,
            device=device,
        )
    runner = PackedRunner if kind == "packed" else FloatRunner
    return runner(
        loaded,
        num_pages=num_pages,
        page_size=page_size,
        dtype=dtype,
        threads=threads,
        quantize=quantize,
        kv_dtype=kv_dtype,
        device=device,
        ranks=ranks,
    )
