"""Optimizers for the worker loop: torch.optim's state and checkpoints, our kernels for the step."""

from optim.adamw import ChunkedAdamW, adamw_reference_step, clip_and_step

__all__ = ["ChunkedAdamW", "adamw_reference_step", "clip_and_step"]
