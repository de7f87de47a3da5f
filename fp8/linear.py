"""Float8Linear: one autograd.Function owns the three GEMMs of a linear layer.

    output      y_MN  = x_MK  @ w_NK^T      (forward)
    grad_input  gx_MK = gy_MN @ w_NK        (backward)
    grad_weight gw_NK = gy_MN^T @ x_MK      (backward)

Each GEMM quantizes its two operands along the contraction dim (rowwise) or per tensor (tensorwise) and
runs through `torch._scaled_mm` (cuBLASLt on CUDA, hipBLASLt on ROCm) or, where no FP8 matrix unit exists,
through the emulated path: the same fp8 operands dequantized to float32 and multiplied in float32. Both
paths compute the same function (up to float32 accumulation order).

Legend: M tokens (all leading dims flattened), K in_features, N out_features. Suffixes: _hp high
precision, _fp8 quantized, _t transposed; scales are quantization multipliers (x_fp8 = x * scale).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from fp8 import quant
from fp8.backend import Fp8Backend, get_backend
from fp8.fsdp_allgather import gathered_fp8
from fp8.recipes import Recipe, get_recipe


def _row_major(a: torch.Tensor) -> torch.Tensor:
    return a if a.stride(-1) == 1 else quant.transpose(a.t())


def _col_major(b: torch.Tensor) -> torch.Tensor:
    return b if b.stride(-2) == 1 else quant.transpose(b).t()


def _as_row_vec(s: torch.Tensor, n: int) -> torch.Tensor:
    """Scale of the right operand as the (1, N) float32 row _scaled_mm's rowwise mode wants."""
    return s.reshape(1, -1).expand(1, n).contiguous() if s.numel() == 1 else s.reshape(1, n).contiguous()


def _as_col_vec(s: torch.Tensor, m: int) -> torch.Tensor:
    return s.reshape(-1, 1).expand(m, 1).contiguous() if s.numel() == 1 else s.reshape(m, 1).contiguous()


def _autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    enabled = device_type in ("cpu", "cuda") and torch.is_autocast_enabled(device_type)
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def scaled_mm(
    a_fp8: torch.Tensor,
    b_fp8: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    use_scaled_mm: bool,
    fast_accum: bool = False,
) -> torch.Tensor:
    """a (M, K) @ b (K, N) dequantized: (a / scale_a) @ (b / scale_b).

    scale_a: 0-d or (M, 1); scale_b: 0-d or (1, N). use_scaled_mm=False runs the emulated float32 path.
    """
    inv_a, inv_b = scale_a.reciprocal(), scale_b.reciprocal()
    if not use_scaled_mm:
        a32 = a_fp8.float() * inv_a
        b32 = b_fp8.float() * inv_b
        # A forward under bf16 autocast would otherwise run this float32 product as a bf16 matmul: both operands
        # rounded to bf16 (not what _scaled_mm computes), and on CPUs without native bf16 a matmul many times slower.
        with _autocast_off(a32.device.type):
            out = a32 @ b32
    else:
        m, n = a_fp8.shape[0], b_fp8.shape[1]
        tensorwise = inv_a.numel() == 1 and inv_b.numel() == 1
        if tensorwise:
            inv_a, inv_b = inv_a.reshape(()), inv_b.reshape(())
            mm_dtype = out_dtype
        else:
            # Rowwise _scaled_mm needs both scales as vectors and a bf16 output (cuBLASLt/CUTLASS constraint).
            inv_a, inv_b = _as_col_vec(inv_a, m), _as_row_vec(inv_b, n)
            mm_dtype = torch.bfloat16
        out = torch._scaled_mm(
            _row_major(a_fp8),
            _col_major(b_fp8),
            scale_a=inv_a,
            scale_b=inv_b,
            out_dtype=mm_dtype,
            use_fast_accum=fast_accum,
        )
    # Never a no-op .to(): in torch 2.11, an autograd.Function forward compiled by Dynamo that returned the tensor
    # .to() handed back unchanged got a zero gradient in backward (every compiled FP8 block on CPU).
    return out if out.dtype == out_dtype else out.to(out_dtype)


def health_stats(x_hp: torch.Tensor, x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 [saturated_frac, underflow_frac, amax] of one quantized input; stays on device, no extra pass
    (fractions from a strided sample of rows, amax read off the scales: fp8.health.health_stats_ref)."""
    return quant.health_stats(x_hp.detach(), x_fp8, scale.detach(), dtype)


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """An activation in the high-precision dtype its fp8 cast starts from: autocast's when it is on (as the bf16 matmul
    it replaces would run), else its own.

    Weights are not converted: every FP8 layer casts its weight to fp8 from the dtype it is stored in (float32 master
    weights on one worker, FSDP2's gathered dtype otherwise), which saves writing and reading a bf16 copy of each
    weight every step and rounds once instead of twice. The weight gradient comes back in the weight's own dtype."""
    return x.to(torch.get_autocast_dtype(x.device.type)) if torch.is_autocast_enabled(x.device.type) else x


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_NK, w_amax, recipe: Recipe, backend: Fp8Backend, use_scaled_mm: bool):
        e4m3, pow2 = backend.e4m3, recipe.pow2_scales
        if recipe.granularity == "tensorwise":
            x_fp8, sx = quant.quantize_tensorwise(x_MK, e4m3, pow2)
            # A weight FSDP2 all-gathered in fp8 (fp8.fsdp_allgather) comes cast, with its global scale; w_amax, where
            # given, is max |w| kept since the weight last changed (fp8.weight_amax): the cast then reads w once.
            w_fp8, sw = gathered_fp8(w_NK) or quant.quantize_tensorwise(w_NK, e4m3, pow2, amax=w_amax)
            # One scale serves either layout: keep the fp8 copies for backward (half the bytes of x_hp); backward
            # transposes them for the GEMMs that read them the other way (fp8.quant.transpose).
            ctx.save_for_backward(x_fp8, sx, w_fp8, sw)
            sw_1N = sw
        else:
            # Backward contracts over other dims, so it needs other scales: cast both layouts now, from one
            # read, and keep the fp8 column-scaled copies (x_fp8_t_KM, w_fp8_t_KN) instead of x_hp and w_hp.
            if recipe.grad_weight_hp:
                x_fp8, sx = quant.quantize_rowwise(x_MK, e4m3, -1, pow2)
                x_saved, sx_saved = x_MK, sx
            else:
                x_fp8, sx, x_saved, sx_saved = quant.quantize_rowwise_and_colwise(x_MK, e4m3, pow2)
            w_fp8, sw_N1, w_fp8_t_KN, sw_1K = quant.quantize_rowwise_and_colwise(w_NK, e4m3, pow2)
            ctx.save_for_backward(x_saved, sx_saved, w_fp8_t_KN, sw_1K)
            sw_1N = sw_N1.reshape(1, -1)
        y_MN = scaled_mm(x_fp8, w_fp8.t(), sx, sw_1N, x_MK.dtype, use_scaled_mm, fast_accum=True)
        stats = health_stats(x_MK, x_fp8, sx, e4m3)
        ctx.recipe, ctx.backend, ctx.use_scaled_mm, ctx.w_dtype = recipe, backend, use_scaled_mm, w_NK.dtype
        ctx.mark_non_differentiable(stats)
        return y_MN, stats

    @staticmethod
    def backward(ctx, gy_MN, _grad_stats):
        recipe: Recipe = ctx.recipe
        backend: Fp8Backend = ctx.backend
        use, pow2 = ctx.use_scaled_mm, recipe.pow2_scales
        gy_MN = gy_MN.contiguous()
        out_dtype = gy_MN.dtype
        gy_dtype = backend.e5m2 if recipe.grad_output_e5m2 else backend.e4m3
        if recipe.granularity == "tensorwise":
            gy_fp8, sg = quant.quantize_tensorwise(gy_MN, gy_dtype, pow2)
            x_fp8, sx, w_fp8, sw = ctx.saved_tensors
            gx_MK = scaled_mm(gy_fp8, w_fp8, sg, sw, out_dtype, use)  # scaled_mm makes the transposed copies
            # The weight gradient comes out of the GEMM in the weight's dtype (a float32 master weight's too): a bf16
            # result converted afterwards is one more kernel reading 2 and writing 4 bytes per weight every step.
            gw_NK = scaled_mm(gy_fp8.t(), x_fp8, sg, sx, ctx.w_dtype, use)
            return gx_MK, gw_NK, None, None, None, None
        x_saved, sx_saved, w_fp8_t_KN, sw_1K = ctx.saved_tensors
        if recipe.grad_weight_hp:
            gy_fp8, sg_M1 = quant.quantize_rowwise(gy_MN, gy_dtype, -1, pow2)
            gw_NK = gy_MN.t() @ x_saved.to(out_dtype)
        else:
            gy_fp8, sg_M1, gy_fp8_t_NM, sg_1N = quant.quantize_rowwise_and_colwise(gy_MN, gy_dtype, pow2)
            gw_NK = scaled_mm(gy_fp8_t_NM, x_saved.t(), sg_1N.reshape(-1, 1), sx_saved, out_dtype, use)
        gx_MK = scaled_mm(gy_fp8, w_fp8_t_KN.t(), sg_M1, sw_1K, out_dtype, use)
        return gx_MK, gw_NK.to(ctx.w_dtype), None, None, None, None


class Float8Linear(nn.Linear):
    """nn.Linear whose matmuls run in FP8 while `fp8_enabled`; parameters stay in their own dtype.

    `fp8_enabled=False` (set_precision "bf16") computes exactly nn.Linear's F.linear. `emulate`: None picks
    by backend (CPU/old GPUs emulate), True forces the float32 emulation, False forces torch._scaled_mm
    (also on CPU, where torch implements it: used to test that both paths agree).
    """

    # fp8.fsdp_allgather wraps the weight of a layer that says so (it cannot import this module: this one imports it).
    fsdp_fp8_all_gather_eligible = True

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=None, recipe="tensorwise"):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.recipe: Recipe = get_recipe(recipe)
        self.fp8_enabled: bool = True
        self.emulate: bool | None = None
        # The health buffer holds garbage after to_empty() until a forward in fp8 writes it.
        self.fp8_health_valid: bool = False
        # Non-persistent: checkpoints of converted and plain models have identical keys.
        self.register_buffer("fp8_health_stats", torch.zeros(3, device=device), persistent=False)
        self._init_weight_amax(device)

    def _init_weight_amax(self, device) -> None:
        # max |weight| where fp8.weight_amax keeps it: written by the optimizer step that writes the weight, reduced
        # again after any other change, so the tensorwise cast skips its pass over the weight. weight_amax_of: None
        # (not kept), "weight" (the whole weight: the forward's cast reads it) or "shard" (this rank's FSDP2 shard:
        # the fp8 all-gather's global scale reads it).
        self.register_buffer("weight_amax", torch.zeros((), device=device), persistent=False)
        self.weight_amax_of: str | None = None

    def kept_weight_amax(self) -> torch.Tensor | None:
        """The weight's amax for the tensorwise cast where it is kept, else None (the cast reduces it). A module moved
        to another float dtype since (module.to(torch.bfloat16)) holds a rounded amax: not used."""
        kept = self.weight_amax_of == "weight" and self.weight_amax.dtype == torch.float32
        return self.weight_amax if kept and self.recipe.granularity == "tensorwise" else None

    @classmethod
    def from_float(cls, mod: nn.Linear, recipe: str | Recipe = "tensorwise") -> Float8Linear:
        """Wrap an nn.Linear, sharing its Parameter objects (optimizer state stays attached)."""
        with torch.device("meta"):
            new = cls(mod.in_features, mod.out_features, bias=mod.bias is not None, recipe=recipe)
        new.weight = mod.weight
        new.bias = mod.bias
        new.fp8_health_stats = torch.zeros(3, device=mod.weight.device)
        new._init_weight_amax(mod.weight.device)
        new.train(mod.training)
        quant.look_up_kernels_eagerly()  # before any compile traces the casts (fp8.quant._kernels)
        return new

    def extra_repr(self) -> str:
        mode = self.recipe.name if self.fp8_enabled else "high precision"
        return f"{super().extra_repr()}, fp8={mode}"

    def fp8_backend(self, device: torch.device) -> tuple[Fp8Backend, bool]:
        """(the FP8 backend of `device`, whether the GEMMs run through torch._scaled_mm rather than emulated)."""
        backend = get_backend(device)
        return backend, (not backend.emulate) if self.emulate is None else (not self.emulate)

    def record_health(self, stats: torch.Tensor) -> None:
        """Keep the health statistics of the forward that just ran (fp8_health reads them)."""
        with torch.no_grad():
            self.fp8_health_stats.copy_(stats)
        if not self.fp8_health_valid:
            self.fp8_health_valid = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.fp8_enabled:
            return F.linear(x, self.weight, self.bias)
        x = to_compute_dtype(x)
        backend, use_scaled_mm = self.fp8_backend(x.device)
        x_MK = x.reshape(-1, self.in_features)
        y_MN, stats = _Fp8LinearFn.apply(x_MK, self.weight, self.kept_weight_amax(), self.recipe, backend,
                                         use_scaled_mm)
        self.record_health(stats)
        y = y_MN.reshape(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y
