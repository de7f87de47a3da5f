"""Held-out evaluation: the mean token loss over a fixed set of validation sequences, whatever the world size.

Sequence j of the set is the same tokens in every run of a corpus (orchestration.data: consecutive windows of the
validation split, or of the files past data.max_files for the byte stream). Each rank evaluates a contiguous chunk
of the set; every rank runs the same number of forwards (a rank whose chunk is used up runs one on sequence 0 with
weight 0, so FSDP's collectives line up), and one all-reduce of (loss sum, sequence count) gives the mean. Every
sequence has seq_len tokens, so the mean of the sequences' mean token losses is the mean token loss of the set.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch


class ValidationSet(Protocol):
    def validation_capacity(self) -> int: ...

    def validation_batch(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def validation_sequences(data: Any, validation: ValidationSet | None, eval_every: int) -> tuple[int, str | None,
                                                                                              str | None]:
    """(validation sequences per evaluation, why evaluation is off though train.eval_every asks for it, why it runs on
    fewer sequences than data.eval_sequences). data: the job's DataConfig. 0 sequences when train.eval_every=0 or
    the byte stream has no held-out file (a one-file data.source). Too few sequences in the held-out data is an error
    naming what to change."""
    if eval_every == 0:
        return 0, None, None
    if validation is None:
        return 0, (f"no held-out data: data.source={data.source!r} has no files after the first data.max_files="
                   f"{data.max_files}; point data.source at a directory with more files, or set train.eval_every=0"), None
    capacity = validation.validation_capacity()
    if capacity == 0:
        raise ValueError(f"the held-out data holds no sequence of data.seq_len={data.seq_len} tokens: point "
                         "data.source at a directory with more files, lower data.seq_len, or set train.eval_every=0")
    if capacity < data.eval_sequences:
        # A small held-out set is still worth evaluating on: all of it, said once (an event, rank 0's log).
        return capacity, None, (f"the held-out data holds {capacity} sequences of data.seq_len={data.seq_len} tokens, "
                                f"fewer than data.eval_sequences={data.eval_sequences}: evaluating on all {capacity}")
    return data.eval_sequences, None, None


def eval_chunk(n_sequences: int, world_size: int, rank: int) -> tuple[int, int]:
    """This rank's contiguous chunk [start, end) of the validation set; sizes differ by at most one."""
    base, extra = divmod(n_sequences, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def eval_forwards(n_sequences: int, world_size: int, micro_batch_size: int) -> int:
    """Forwards every rank runs: enough for the largest chunk."""
    largest_chunk = -(-n_sequences // world_size)
    return -(-largest_chunk // micro_batch_size)


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: ValidationSet, n_sequences: int, micro_batch_size: int, rank: int,
             world_size: int, device: torch.device,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    """Mean token loss of validation sequences [0, n_sequences) with the model as it is (eval mode for the call: no
    MoE load counts, no aux loss). Collective when world_size > 1: every rank calls it at the same step."""
    lo, hi = eval_chunk(n_sequences, world_size, rank)
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss * sequences, sequences
    was_training = model.training
    model.eval()
    try:
        for k in range(eval_forwards(n_sequences, world_size, micro_batch_size)):
            start = min(lo + k * micro_batch_size, hi)
            end = min(start + micro_batch_size, hi)
            inputs, targets = data.validation_batch(start, end) if end > start else data.validation_batch(0, 1)
            loss = loss_fn(inputs.to(device), targets.to(device)).double()
            sums += torch.stack([loss * (end - start), torch.tensor(float(end - start), dtype=torch.float64,
                                                                     device=device)])
    finally:
        model.train(was_training)
    if world_size > 1:
        torch.distributed.all_reduce(sums)
    return float(sums[0] / sums[1])
