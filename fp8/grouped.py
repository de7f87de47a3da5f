"""FP8 grouped GEMM for MoE experts (rowwise, power-of-two scales), forward and backward.

Semantics are torch._grouped_mm's for a 2D activation and a 3D expert weight:

    out_MN[rows of group e] = x_MK[rows of group e] @ w_EKN[e]

with `offs_E` int32 cumulative end offsets (group e owns rows offs[e-1]:offs[e]). Rows past offs[-1]
are left unspecified, as in torch.

The three GEMMs and their fp8 operands (scales always along the contraction dim):
    forward      out  = x @ w[e]          x rowwise (M,), w per expert per column (E, N)
    grad_input   gx   = gy @ w[e]^T       gy rowwise (M,), w per expert per row (E, K)
    grad_weight  gw[e] = x_e^T @ gy_e     jagged: per expert per column of x (E, K) and of gy (E, N)

Paths: torch._scaled_grouped_mm on CUDA sm90 and on ROCm (torch routes it to Composable Kernel); on any
other device an emulated path runs the same fp8 operands dequantized to float32 through torch._grouped_mm.
The CUDA kernel reads fp8 groups at 16-element alignment: token groups should be padded to multiples
of 16 rows (torchtitan does the same) for the grad_weight GEMM, whose contraction dim is the token dim.

Legend: M routed tokens, K in dim, N out dim, E experts.
"""

from __future__ import annotations

import torch

from fp8 import quant
from fp8.backend import Fp8Backend, get_backend
from fp8.linear import health_stats
from fp8.recipes import group_ids


@torch.compiler.disable
def _grouped_emulated(a32: torch.Tensor, b32: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    # float32 torch._grouped_mm runs on CPU but its fake-tensor rule admits bf16 only, so keep it out of
    # compiled graphs (a graph break on the emulated path; the GPU path has none).
    return torch._grouped_mm(a32, b32, offs_E)


class _Fp8GroupedMMFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_EKN, offs_E, backend: Fp8Backend, use_scaled: bool, pow2: bool):
        e4m3 = backend.e4m3
        x_fp8, sx_M1 = quant.quantize_rowwise(x_MK, e4m3, -1, pow2)
        # Per expert, per output column n, scaled along K; stored column-major (strides (K*N, 1, K)) as
        # the grouped GEMM's right operand wants.
        w_fp8, sw_E1N = quant.quantize_colwise_3d(w_EKN, e4m3, pow2)
        if use_scaled:
            out_MN = torch._scaled_grouped_mm(
                x_fp8,
                w_fp8,
                sx_M1.reciprocal().reshape(-1),
                sw_E1N.reciprocal().reshape(w_EKN.shape[0], -1),
                offs_E,
                out_dtype=torch.bfloat16,
                use_fast_accum=True,
            ).to(x_MK.dtype)
        else:
            x32 = x_fp8.float() / sx_M1
            w32 = w_fp8.float() / sw_E1N
            out_MN = _grouped_emulated(x32, w32, offs_E).to(x_MK.dtype)
        stats = health_stats(x_MK, x_fp8, sx_M1, e4m3)
        ctx.save_for_backward(x_MK, w_EKN, offs_E)
        ctx.backend, ctx.use_scaled, ctx.pow2 = backend, use_scaled, pow2
        ctx.mark_non_differentiable(stats)
        return out_MN, stats

    @staticmethod
    def backward(ctx, gy_MN, _grad_stats):
        x_MK, w_EKN, offs_E = ctx.saved_tensors
        backend: Fp8Backend = ctx.backend
        e4m3, pow2 = backend.e4m3, ctx.pow2
        gy_MN = gy_MN.contiguous()
        num_experts = w_EKN.shape[0]
        gy_fp8, sg_M1 = quant.quantize_rowwise(gy_MN, e4m3, -1, pow2)
        w_fp8_r, sw_EK1 = quant.quantize_rowwise(w_EKN, e4m3, -1, pow2)  # scales along N
        x_fp8_t_KM, sx_EK = quant.quantize_jagged_colwise(x_MK, offs_E, e4m3, pow2)
        gy_fp8_t_NM, sg_EN = quant.quantize_jagged_colwise(gy_MN, offs_E, e4m3, pow2)
        if ctx.use_scaled:
            gx_MK = torch._scaled_grouped_mm(
                gy_fp8,
                w_fp8_r.transpose(-2, -1),  # (E, N, K), column-major as stored
                sg_M1.reciprocal().reshape(-1),
                sw_EK1.reciprocal().reshape(num_experts, -1),
                offs_E,
                out_dtype=torch.bfloat16,
            )
            gw_EKN = torch._scaled_grouped_mm(
                x_fp8_t_KM,  # (K, M) row-major
                gy_fp8_t_NM.t(),  # (M, N) column-major
                sx_EK.reciprocal().reshape(-1),
                sg_EN.reciprocal().reshape(-1),
                offs_E,
                out_dtype=torch.bfloat16,
            )
        else:
            gy32 = gy_fp8.float() / sg_M1
            w32 = w_fp8_r.float() / sw_EK1
            gx_MK = _grouped_emulated(gy32, w32.transpose(-2, -1), offs_E)
            # Dequantize the jagged operands with their rows' group scales (rows past offs[-1] are zeros).
            gid_M = group_ids(offs_E, x_MK.shape[0]).long()
            inv_x_GK = torch.cat([sx_EK.reciprocal(), sx_EK.new_zeros(1, sx_EK.shape[1])])
            inv_g_GN = torch.cat([sg_EN.reciprocal(), sg_EN.new_zeros(1, sg_EN.shape[1])])
            x32_KM = x_fp8_t_KM.float() * inv_x_GK[gid_M].t()
            g32_MN = gy_fp8_t_NM.float().t() * inv_g_GN[gid_M]
            gw_EKN = _grouped_emulated(x32_KM, g32_MN, offs_E)
        return gx_MK.to(x_MK.dtype), gw_EKN.to(w_EKN.dtype), None, None, None, None


class Fp8GroupedMM:
    """Drop-in for a GroupedExperts module's `grouped_mm` attribute: (x_MK, w_EKN, offs_E) -> out_MN.

    A plain callable (not an nn.Module), so swapping it in adds no parameters, buffers or state_dict keys.
    `last_stats` holds the on-device health scalars of its last call (see fp8_health).
    """

    def __init__(self, emulate: bool | None = None, pow2: bool = True):
        self.emulate = emulate
        self.pow2 = pow2
        self.last_stats: torch.Tensor | None = None

    def __call__(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        if offs_E.dtype != torch.int32:
            raise ValueError(f"grouped_mm offsets must be int32 cumulative ends, got {offs_E.dtype}")
        if torch.is_autocast_enabled(x_MK.device.type):
            dt = torch.get_autocast_dtype(x_MK.device.type)
            x_MK, w_EKN = x_MK.to(dt), w_EKN.to(dt)
        elif w_EKN.dtype != x_MK.dtype:
            w_EKN = w_EKN.to(x_MK.dtype)
        backend = get_backend(x_MK.device)
        use_scaled = backend.has_scaled_grouped_mm if self.emulate is None else not self.emulate
        out_MN, stats = _Fp8GroupedMMFn.apply(x_MK, w_EKN, offs_E, backend, use_scaled, self.pow2)
        self.last_stats = stats
        return out_MN

    def __repr__(self) -> str:
        return f"Fp8GroupedMM(rowwise, emulate={self.emulate})"


def fp8_grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, emulate: bool | None = None):
    """Functional form of Fp8GroupedMM."""
    return Fp8GroupedMM(emulate=emulate)(x_MK, w_EKN, offs_E)
