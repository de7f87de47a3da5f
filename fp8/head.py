"""FP8 LM output head with the token cross-entropy fused into it (tensorwise recipe).

    logits_MV = x_MK @ w_VK^T            (fp8 GEMM, bf16 logits, kept for backward as an unfused head keeps them)
    loss      = mean over counted rows of (logsumexp(logits) - logits[target])
    g_MV      = d loss / d logits = coef * (softmax(logits) - onehot(target)),  coef = grad_loss / counted rows
    gx_MK     = g_MV @ w_VK              (fp8 GEMM)
    gw_VK     = g_MV^T @ x_MK            (fp8 GEMM)

Why fused: an unfused FP8 head receives g from the loss as a bf16 [M, V] tensor (16384 tokens x 102400 vocab =
3.4 GB for DeepSeek-MoE-16B, the largest tensor of the step) and moves it five times: written by the loss backward,
read by an amax pass and by the cast, its fp8 copy read and written again by the transpose the grad-weight GEMM
needs. Here the forward's loss kernel also records each row's largest |softmax - onehot| (so g's amax is known with
no pass over g), and one backward kernel forms g from the saved logits and writes it as fp8 in both layouts: one
read of the logits and two 1-byte writes (fp8/kernels/cross_entropy.py).

Numerics: the same function as Float8Linear(tensorwise) followed by models.loss.token_cross_entropy, except that g is
quantized from fp32 instead of from its bf16 rounding, with the dynamic scale of its exact amax; x and w are cast as
Float8Linear casts them (e4m3, dynamic tensorwise scales), g as its grad_output (e5m2 under the tensorwise recipe).

Only the tensorwise recipe fuses (a rowwise g would need per-row scales along V for one GEMM and per-column ones for
the other: the fused kernel's single amax serves both layouts only for one tensor-wide scale); other recipes, bf16
(set_precision), a biased head, or fused_loss=False run the unfused head and loss. Legend: M tokens, K model dim,
V vocabulary.
"""

from __future__ import annotations

import torch

from fp8 import quant
from fp8.backend import Fp8Backend
from fp8.linear import Float8Linear, health_stats, scaled_mm, to_compute_dtype

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets count neither in the loss nor in its mean


class _Fp8LinearCrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_VK, w_amax, targets_M, backend: Fp8Backend, use_scaled_mm: bool,
                grad_dtype: torch.dtype):
        e4m3 = backend.e4m3
        x_fp8, sx = quant.quantize_tensorwise(x_MK, e4m3)
        w_fp8, sw = quant.quantize_tensorwise(w_VK, e4m3, amax=w_amax)  # w_amax: Float8Linear.kept_weight_amax
        logits_MV = scaled_mm(x_fp8, w_fp8.t(), sx, sw, x_MK.dtype, use_scaled_mm, fast_accum=True)
        lse_M, loss_M, gamax_M = quant.cross_entropy_fwd(logits_MV, targets_M, IGNORE_INDEX)
        counted = (targets_M != IGNORE_INDEX).sum().float()
        loss = loss_M.sum() / counted  # all targets ignored: 0 / 0 = NaN, as F.cross_entropy gives
        ctx.save_for_backward(logits_MV, targets_M, lse_M, gamax_M.amax(), counted, x_fp8, sx, w_fp8, sw)
        ctx.use_scaled_mm, ctx.grad_dtype, ctx.w_dtype = use_scaled_mm, grad_dtype, w_VK.dtype
        stats = health_stats(x_MK, x_fp8, sx, e4m3)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, _grad_stats):
        logits_MV, targets_M, lse_M, gamax, counted, x_fp8, sx, w_fp8, sw = ctx.saved_tensors
        # No counted row (every target ignored): the loss is NaN but its gradient is zero, as F.cross_entropy's
        # (a NaN coef would poison every gradient of an accumulated step)
        coef = torch.where(counted > 0, grad_loss.float() / counted.clamp_min(1), 0.0)
        g_fp8, g_fp8_t, sg = quant.cross_entropy_grad_cast(logits_MV, targets_M, lse_M, gamax, coef, ctx.grad_dtype,
                                                           IGNORE_INDEX)
        gx_MK = scaled_mm(g_fp8, w_fp8, sg, sw, logits_MV.dtype, ctx.use_scaled_mm)
        # g's row-major copy is freed before the weight gradient is allocated: this is the step's peak of memory
        # (the logits, g twice, a [V, K] gradient), and a converted float32 gradient beside both copies of g once
        # cost 1.9 GiB of peak on Llama3-8B's head (8192 tokens x 128256 vocabulary, H100). The GEMM writes the
        # weight's dtype itself (float32 master weights): no bf16 result converted by another kernel.
        del g_fp8
        gw_VK = scaled_mm(g_fp8_t, x_fp8, sg, sx, ctx.w_dtype, ctx.use_scaled_mm)
        return gx_MK, gw_VK, None, None, None, None, None


@torch.compiler.disable
def fp8_linear_cross_entropy(head: Float8Linear, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of head(x) against targets, fused as the module docstring describes.

    Runs eagerly (outside torch.compile: its work is four large GEMMs and six kernels, nothing for Inductor to
    fuse). Writes the head's health statistics as its forward does.
    """
    x = to_compute_dtype(x)
    backend, use_scaled_mm = head.fp8_backend(x.device)
    targets = targets.reshape(-1)
    # The loss kernel does not check targets: an id outside [0, V) would be a wrong loss (it reads a clamped column)
    # and a gradient without its -1. Checked on the device (no host sync): a failure raises at the next
    # synchronisation.
    torch._assert_async(((targets >= 0) & (targets < head.out_features) | (targets == IGNORE_INDEX)).all(),
                        "fp8_linear_cross_entropy: a target id lies outside [0, vocab_size) and is not ignore_index")
    grad_dtype = backend.e5m2 if head.recipe.grad_output_e5m2 else backend.e4m3
    loss, stats = _Fp8LinearCrossEntropyFn.apply(x.reshape(-1, head.in_features), head.weight,
                                                 head.kept_weight_amax(), targets, backend, use_scaled_mm, grad_dtype)
    head.record_health(stats)
    return loss


class Float8LMHead(Float8Linear):
    """The LM output head as a Float8Linear that can also return the loss: forward(x) gives logits as any
    Float8Linear; forward(x, targets=...) gives the mean token cross-entropy through the fused FP8 path
    (fp8_linear_cross_entropy), called through the module so that wrappers' hooks (FSDP2's unshard) run.

    fused_loss: False keeps the unfused head and loss even where fusing applies (for A/B measurements; fused is the
    measured winner at a 102400-token vocabulary, for a little more peak memory: BENCHMARKS.md).
    """

    # The head runs its own fused kernels on the weight it is given, so FSDP2 gathers it in its own dtype.
    fsdp_fp8_all_gather_eligible = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_loss: bool = True

    def fuses_loss(self) -> bool:
        """Whether forward(x, targets) runs now: FP8 on, tensorwise recipe with dynamic (not power-of-two) scales, no
        bias, fused_loss on."""
        return (self.fused_loss and self.fp8_enabled and self.recipe.granularity == "tensorwise"
                and not self.recipe.pow2_scales and self.bias is None)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        if not self.fuses_loss():
            raise ValueError(
                f"Float8LMHead(targets=...) computes the fused FP8 loss, which needs fp8 on, the tensorwise recipe "
                f"without power-of-two scales, no bias and fused_loss=True (now: fp8_enabled={self.fp8_enabled}, "
                f"recipe={self.recipe.name}, pow2_scales={self.recipe.pow2_scales}, "
                f"bias={self.bias is not None}, fused_loss={self.fused_loss}); call it without targets and apply the "
                "loss to the logits (models.loss.model_lm_loss chooses for you)")
        return fp8_linear_cross_entropy(self, x, targets)
