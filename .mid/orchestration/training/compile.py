"""torch.compile of the model's blocks for the worker loop (model.compile, model.compile_mode)."""

from __future__ import annotations

import torch

from fp8 import grouped as fp8_grouped
from fp8.linear import Float8Linear
from models.loss import head_fuses_loss
from orchestration.config import JobConfig


def compile_enabled(job: JobConfig, device: torch.device) -> bool:
    """model.compile, where null means: compile on GPUs (ROCm included), eager on CPU."""
    return job.model.compile if job.model.compile is not None else device.type == "cuda"


def compile_if_enabled(model: torch.nn.Module, job: JobConfig, device: torch.device) -> bool:
    """compile_blocks with model.compile_mode when compile_enabled; returns whether it did (the loss follows the
    blocks)."""
    enabled = compile_enabled(job, device)
    if enabled:
        compile_blocks(model, job.model.compile_mode)
    return enabled


_BODIES_SET_EAGER_FOR_GRAPHS = False


def _uses_cuda_graphs(mode: str) -> bool:
    """Whether blocks compiled with `mode` run as CUDA graphs (reduce-overhead, max-autotune, or Inductor's global
    cudagraphs switch)."""
    import torch._inductor
    from torch._inductor import config as inductor_config

    options = {} if mode == "default" else torch._inductor.list_mode_options(mode)
    return bool(options.get("triton.cudagraphs") or inductor_config.triton.cudagraphs)


def compile_blocks(model: torch.nn.Module, mode: str = "default") -> None:
    """torch.compile each transformer block (torchtitan's granularity: one graph per block, reused by all).

    Static shapes: the sequence length is fixed, and a graph that went dynamic after a shape change ran the fp8
    step slower. Inductor's defaults otherwise: turning its mix-order reductions off (they fuse the RMSNorm
    backward with the next fp8 cast into one long kernel) measured no faster for the whole step, so they stay on.
    """
    # CUDA graphs replay the MoE grouped-GEMM ops' bodies without their Python, and a compiled body bumps dynamo's
    # generation counter, which graph trees read as a new iteration where no step is marked (the Trainer marks
    # each one; other callers may not): eager bodies under graphs. Otherwise undo only what this function set.
    global _BODIES_SET_EAGER_FOR_GRAPHS
    if _uses_cuda_graphs(mode):
        fp8_grouped.set_body_mode("eager")
        _BODIES_SET_EAGER_FOR_GRAPHS = True
    elif _BODIES_SET_EAGER_FOR_GRAPHS:
        fp8_grouped.set_body_mode(None)
        _BODIES_SET_EAGER_FOR_GRAPHS = False
    for block in model.layers.values():
        # fixed sequence length: no symbolic-shape kernels
        block.compile(dynamic=False, mode=None if mode == "default" else mode)
    head = getattr(model, "output", None)
    if isinstance(head, Float8Linear) and not head_fuses_loss(head):
        # An FP8 output head (precision.fp8_output_head) is compiled too, so Inductor fuses its casts; a bf16 head
        # is one matmul, which compiling would not change; a head that fuses the loss runs its own kernels
        # (fp8/head.py) and would only break the graph.
        head.compile(dynamic=False, mode=None if mode == "default" else mode)
