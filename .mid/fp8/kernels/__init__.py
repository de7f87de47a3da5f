"""FP8 Triton kernels: the casts around the FP8 GEMMs and the fused output head's loss, with their launchers.

fp8.quant is the one way in: it imports this package lazily, on the first cast of a GPU tensor, and decides per call
whether a launcher below (eager), its torch.library op in ops.py (compiled code) or the reference in fp8/reference.py
runs. Each launcher `<cast>_triton` takes and returns torch tensors with the reference's arguments and results:
- quantize.py: tensorwise, rowwise, rowwise with per-group multipliers, rowwise + colwise (both GEMM layouts);
- transposed.py: the fp8 transpose, plain or batched (torch._scaled_mm's operand layouts, the MoE grad-input GEMM's
  weight), and the batched cast by given row scales written transposed (that weight recast from a bf16 one);
- cross_entropy.py: the fused FP8 head's loss forward and its gradient cast (eager only: no op);
- triton_fp8.py: what they share (in-kernel scale, saturating cast, the interpreter's exact rounding, launching).

Scale convention (all kernels): x_fp8 = saturate(x_hp * scale), x_hp ~= x_fp8 / scale, so torch._scaled_mm's scale
arguments are `scale.reciprocal()` (exact for pow2 scales).

On CPU the kernels run only in the Triton interpreter (TRITON_INTERPRET=1 set before this package is imported), which
tests and the smoke benchmarks force through fp8.quant's `use_triton=True`.
"""

from __future__ import annotations

from . import ops
from .cross_entropy import cross_entropy_fwd_triton, cross_entropy_grad_cast_triton
from .quantize import (
    quantize_rowwise_and_colwise_triton,
    quantize_rowwise_group_scaled_triton,
    quantize_rowwise_triton,
    quantize_tensorwise_triton,
)
from .transposed import cast_rows_transposed_batched_triton, transpose_triton
from .triton_fp8 import HAS_TRITON, triton_usable

__all__ = [
    "HAS_TRITON",
    "cast_rows_transposed_batched_triton",
    "cross_entropy_fwd_triton",
    "cross_entropy_grad_cast_triton",
    "ops",
    "quantize_rowwise_and_colwise_triton",
    "quantize_rowwise_group_scaled_triton",
    "quantize_rowwise_triton",
    "quantize_tensorwise_triton",
    "transpose_triton",
    "triton_usable",
]
