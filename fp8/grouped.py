"""FP8 grouped GEMM for MoE experts (rowwise, power-of-two scales), forward and backward.

Semantics are torch._grouped_mm's for a 2D activation and a 3D expert weight:

    out_MN[rows of group e] = x_MK[rows of group e] @ w_EKN[e]

with `offs_E` int32 cumulative end offsets (group e owns rows offs[e-1]:offs[e]). Rows past offs[-1]
are left unspecified, as in torch.

The three GEMMs and their fp8 operands (scales always along the contraction dim):
    forward      out  = x @ w[e]          x rowwise (M,), w per expert per column (E, N)
    grad_input   gx   = gy @ w[e]^T       gy rowwise (M,), w per expert per row (E, K)
    grad_weight  gw[e] = x_e^T @ gy_e     contraction over the group's tokens; three choices (wgrad_scaling):
        "global"      one scale per column of x (K,) and of gy (N,) over all rows. Both fp8 layouts of x come
                      from ONE fused rowwise+colwise cast in forward, which saves the 1-byte transposed copy
                      for backward instead of the 2-byte x; the same for gy in backward.
        "per_expert"  one scale per (expert, column) (E, K) and (E, N): finer when experts' activations differ
                      in magnitude by orders, at the cost of two extra jagged casts over x and gy in backward.
        "hp"          no fp8 at all: a bf16 grouped GEMM on x and gy (the rowwise_gw_hp recipe's choice for
                      dense layers): only row casts remain, the weight gradient keeps full precision. The
                      default: on the H200 (torch 2.11) the fp8 grouped GEMM that contracts over the jagged
                      token dim is barely faster than bf16 at DeepSeek-MoE-16B shapes (w13: 1.72 vs 1.88 ms) or
                      slower (w2: 2.03 vs 1.07 ms), so fp8 there only adds casts (BENCHMARKS.md, MoE section).

The weight may be any [E, K, N] layout. Stored [E, N, K] (nn.Linear's out x in, passed as the column-major view
w.transpose(-2, -1)), the forward cast is a plain row cast of that storage and grad_weight is computed directly
in the storage layout (gw^T = gy^T x), so no transposed copy of a weight-sized tensor is made.

Paths: torch._scaled_grouped_mm on CUDA sm90 and on ROCm (torch routes it to Composable Kernel); on any
other device an emulated path runs the same fp8 operands dequantized to float32 through torch._grouped_mm.
The CUDA kernel reads fp8 groups at 16-element alignment: token groups should be padded to multiples
of 16 rows (torchtitan does the same) for the grad_weight GEMM, whose contraction dim is the token dim.
Rows past offs[-1] take part in the "global" column scales: callers keep them zero (models/deepseek_moe pads
with zero rows and gives the slack to the last group, so there are none).

Legend: M routed tokens, K in dim, N out dim, E experts.
"""

from __future__ import annotations

import os

import torch

from fp8 import quant
from fp8.backend import Fp8Backend, get_backend
from fp8.linear import health_stats, to_compute_dtype
from fp8.recipes import group_ids


@torch.compiler.disable
def _grouped_emulated(a32: torch.Tensor, b32: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    # float32 torch._grouped_mm runs on CPU but its fake-tensor rule admits bf16 only, so keep it out of
    # compiled graphs (a graph break on the emulated path; the GPU path has none).
    return torch._grouped_mm(a32, b32, offs_E)


WGRAD_SCALINGS = ("global", "per_expert", "hp")


def _is_column_major(w_EKN: torch.Tensor) -> bool:
    """[E, K, N] stored as [E, N, K] row-major (the transposed view of an [E, out, in] parameter)."""
    return w_EKN.stride(-2) == 1 and w_EKN.stride(-1) == w_EKN.shape[-2]


def _scaled_or_emulated_2d3d(a_fp8, sa_M1, b_fp8, sb_E1N, offs_E, use_scaled: bool, fast_accum: bool):
    """out[rows of e] = a[rows of e] @ b[e], fp8 operands with scales along K (a: per row, b: per expert column)."""
    if use_scaled:
        # Both dequant multipliers in one multi-tensor launch (host time per launch counts in eager op bodies).
        inv_a, inv_b = torch._foreach_reciprocal([sa_M1, sb_E1N])
        return torch._scaled_grouped_mm(
            a_fp8,
            b_fp8,
            inv_a.reshape(-1),
            inv_b.reshape(b_fp8.shape[0], -1),
            offs_E,
            out_dtype=torch.bfloat16,
            use_fast_accum=fast_accum,
        )
    return _grouped_emulated(a_fp8.float() / sa_M1, b_fp8.float() / sb_E1N, offs_E)


def _wgrad(x_fp8_t_KM, sx_EK, gy_fp8_t_NM, sg_EN, offs_E, use_scaled: bool, out_ENK: bool) -> torch.Tensor:
    """gw[e] = x_e^T @ gy_e from the transposed fp8 operands and their per-(group, column) scales.

    out_ENK: compute gw^T = gy^T x instead, laid out [E, N, K] row-major, and return its [E, K, N] view, so the
    gradient of an [E, N, K]-stored weight lands in the weight's own layout.
    """
    if use_scaled:
        if out_ENK:
            gw_ENK = torch._scaled_grouped_mm(
                gy_fp8_t_NM, x_fp8_t_KM.t(), sg_EN.reciprocal().reshape(-1), sx_EK.reciprocal().reshape(-1),
                offs_E, out_dtype=torch.bfloat16,
            )
            return gw_ENK.transpose(-2, -1)
        return torch._scaled_grouped_mm(
            x_fp8_t_KM, gy_fp8_t_NM.t(), sx_EK.reciprocal().reshape(-1), sg_EN.reciprocal().reshape(-1),
            offs_E, out_dtype=torch.bfloat16,
        )
    # Dequantize each row with its group's scales (rows past offs[-1] belong to no group: zeros).
    gid_M = group_ids(offs_E, x_fp8_t_KM.shape[1]).long()
    inv_x_GK = torch.cat([sx_EK.reciprocal(), sx_EK.new_zeros(1, sx_EK.shape[1])])
    inv_g_GN = torch.cat([sg_EN.reciprocal(), sg_EN.new_zeros(1, sg_EN.shape[1])])
    x32_KM = x_fp8_t_KM.float() * inv_x_GK[gid_M].t()
    g32_MN = gy_fp8_t_NM.float().t() * inv_g_GN[gid_M]
    return _grouped_emulated(x32_KM, g32_MN, offs_E)


def _grouped_hp(a_MK, b_EKN, offs_E) -> torch.Tensor:
    """rows of group e of a times b[e] in a's precision (bf16 grouped GEMM on CUDA; float32 emulated elsewhere)."""
    if a_MK.dtype == torch.bfloat16 and a_MK.is_cuda:
        return torch._grouped_mm(a_MK, b_EKN.to(a_MK.dtype), offs=offs_E)
    return _grouped_emulated(a_MK.float(), b_EKN.float(), offs_E).to(a_MK.dtype)


def _wgrad_hp(x_MK, gy_MN, offs_E, out_ENK: bool) -> torch.Tensor:
    """gw[e] = x_e^T @ gy_e in the activations' precision (bf16 grouped GEMM; float32 emulated off CUDA)."""
    a, b = (gy_MN.t(), x_MK) if out_ENK else (x_MK.t(), gy_MN)
    if a.dtype == torch.bfloat16 and a.is_cuda:
        gw = torch._grouped_mm(a, b, offs=offs_E)
    else:
        gw = _grouped_emulated(a.float(), b.float(), offs_E)
    return gw.transpose(-2, -1) if out_ENK else gw


def _grouped_forward(x_MK, w_EKN, offs_E, e4m3: torch.dtype, use_scaled: bool, pow2: bool, wgrad: str,
                     dgrad: str = "fp8"):
    """-> (out_MN, stats, saved_x, sw_EN, q_EKN): saved_x is what backward needs of x (see _grouped_backward); sw_EN the
    weight's forward scales (per expert and output column, along K), which dgrad="fp8_reuse" reuses; q_EKN the
    forward's quantized weight in the grad-input GEMM's [E, K, N] row-major layout when dgrad == "fp8_keep", else
    None."""
    x_MK = x_MK.contiguous()
    if wgrad == "global":
        # Both layouts from one fused cast; backward keeps the 1-byte transposed copy, not x.
        x_fp8, sx_M1, x_fp8_t_KM, sx_1K = quant.quantize_rowwise_and_colwise(x_MK, e4m3, pow2)
        saved_x = (x_fp8_t_KM, sx_1K)
    else:
        x_fp8, sx_M1 = quant.quantize_rowwise(x_MK, e4m3, -1, pow2)
        saved_x = (x_MK,)
    # Per expert, per output column n, scaled along K, column-major (strides (K*N, 1, K)) as the grouped
    # GEMM's right operand wants: a plain row cast when w is already stored [E, N, K].
    if dgrad == "fp8_keep":
        # The same cast written in both layouts by one kernel: backward then needs no second read of w.
        w_fp8, sw_E1N, q_EKN = quant.quantize_colwise_3d_both_layouts(w_EKN, e4m3, pow2)
    else:
        w_fp8, sw_E1N = quant.quantize_colwise_3d(w_EKN, e4m3, pow2)
        q_EKN = None
    out_MN = _scaled_or_emulated_2d3d(x_fp8, sx_M1, w_fp8, sw_E1N, offs_E, use_scaled, fast_accum=True)
    stats = health_stats(x_MK, x_fp8, sx_M1, e4m3)
    return out_MN.to(x_MK.dtype), stats, saved_x, sw_E1N.reshape(sw_E1N.shape[0], -1), q_EKN


def _grouped_backward(gy_MN, w_EKN, offs_E, saved_x, e4m3: torch.dtype, use_scaled: bool, pow2: bool, wgrad: str,
                      dgrad: str = "fp8", sw_EN: torch.Tensor | None = None, q_EKN: torch.Tensor | None = None):
    """-> (gx_MK, gw_EKN) for the saved_x of _grouped_forward. Both always: expert weights always train.
    dgrad: how the grad-input GEMM runs, "fp8" | "fp8_fast" (fast accumulation) | "hp" (the activations' precision)
    | "fp8_reuse" (needs sw_EN, the forward's weight scales) | "fp8_keep" (also needs q_EKN, the forward's quantized
    weight in the [E, K, N] layout); see Fp8GroupedMM.dgrad_for."""
    hp_dgrad = dgrad == "hp"
    reuse = dgrad in _REUSES_FORWARD_WEIGHT
    gy_MN = gy_MN.contiguous()
    if wgrad == "global":
        gy_fp8, sg_M1, gy_fp8_t_NM, sg_1N = quant.quantize_rowwise_and_colwise(gy_MN, e4m3, pow2)
    elif not hp_dgrad and not reuse:
        gy_fp8, sg_M1 = quant.quantize_rowwise(gy_MN, e4m3, -1, pow2)
    if hp_dgrad:
        gx_MK = _grouped_hp(gy_MN, w_EKN.transpose(-2, -1), offs_E)
    elif reuse:
        # The forward's quantized weight, q[e, k, n] = sat(w[e, k, n] * sw[e, n]), recast from w by the saved scales
        # (one read, no amax pass) into the [E, K, N] row-major layout this GEMM reads; its scales lie along N, the
        # contraction dim here, so they move onto gy's columns (exact: powers of two), group by group:
        #   gx[m, k] = sum_n (gy[m, n] / sw[e(m), n]) * q[e(m), k, n]
        # and gy / sw is quantized per row as gy would be. Replaces the two-pass column cast of w. "fp8_keep": the
        # forward's cast already wrote q in this layout.
        if q_EKN is None:
            q_EKN = quant.cast_rows_transposed_batched(w_EKN.transpose(-2, -1), sw_EN, e4m3)
        num_groups = sw_EN.shape[0]
        inv_sw_GN = torch.cat([sw_EN.reciprocal(), sw_EN.new_zeros(1, sw_EN.shape[1])])  # rows past offs[-1]: 0
        if pow2:  # powers of two are exact in bf16 (fp32's exponent range): half the bytes the cast kernel reads
            inv_sw_GN = inv_sw_GN.to(torch.bfloat16)
        gid_M = group_ids(offs_E, gy_MN.shape[0]).to(torch.int32).clamp_(max=num_groups)
        gy_fp8, sg_M1 = quant.quantize_rowwise_group_scaled(gy_MN, inv_sw_GN, gid_M, e4m3, pow2)
        ones_E1K = sw_EN.new_ones(num_groups, 1, q_EKN.shape[1])
        gx_MK = _scaled_or_emulated_2d3d(gy_fp8, sg_M1, q_EKN.transpose(-2, -1), ones_E1K, offs_E, use_scaled,
                                         fast_accum=True).to(gy_MN.dtype)
    else:
        # w per (expert, row k) along N, laid out [E, K, N] row-major: its transpose is the column-major
        # [E, N, K] right operand of gx = gy @ w^T.
        w_fp8_r, sw_EK1 = quant.quantize_rowwise_of_column_major_3d(w_EKN, e4m3, pow2)
        gx_MK = _scaled_or_emulated_2d3d(
            gy_fp8, sg_M1, w_fp8_r.transpose(-2, -1), sw_EK1.transpose(-2, -1), offs_E, use_scaled,
            fast_accum=dgrad == "fp8_fast",
        ).to(gy_MN.dtype)
    out_ENK = _is_column_major(w_EKN)
    if wgrad == "hp":
        (x_MK,) = saved_x
        gw_EKN = _wgrad_hp(x_MK, gy_MN, offs_E, out_ENK)
    else:
        if wgrad == "global":
            x_fp8_t_KM, sx_1K = saved_x
            sx_EK, sg_EN = sx_1K.expand(w_EKN.shape[0], -1), sg_1N.expand(w_EKN.shape[0], -1)
        else:  # per_expert
            (x_MK,) = saved_x
            x_fp8_t_KM, sx_EK = quant.quantize_jagged_colwise(x_MK, offs_E, e4m3, pow2)
            gy_fp8_t_NM, sg_EN = quant.quantize_jagged_colwise(gy_MN, offs_E, e4m3, pow2)
        gw_EKN = _wgrad(x_fp8_t_KM, sx_EK, gy_fp8_t_NM, sg_EN, offs_E, use_scaled, out_ENK)
    return gx_MK, gw_EKN.to(w_EKN.dtype)


class _Fp8GroupedMMFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_EKN, offs_E, backend: Fp8Backend, use_scaled: bool, pow2: bool, wgrad_scaling: str,
                dgrad: str):
        out_MN, stats, saved_x, sw_EN, q_EKN = _grouped_forward(x_MK, w_EKN, offs_E, backend.e4m3, use_scaled, pow2,
                                                                wgrad_scaling, dgrad)
        ctx.save_for_backward(w_EKN, offs_E, sw_EN, q_EKN, *saved_x)
        ctx.e4m3, ctx.use_scaled, ctx.pow2, ctx.wgrad = backend.e4m3, use_scaled, pow2, wgrad_scaling
        ctx.dgrad = dgrad
        ctx.mark_non_differentiable(stats)
        return out_MN, stats

    @staticmethod
    def backward(ctx, gy_MN, _grad_stats):
        w_EKN, offs_E, sw_EN, q_EKN, *saved_x = ctx.saved_tensors
        gx_MK, gw_EKN = _grouped_backward(
            gy_MN, w_EKN, offs_E, tuple(saved_x), ctx.e4m3, ctx.use_scaled, ctx.pow2, ctx.wgrad, ctx.dgrad, sw_EN, q_EKN
        )
        return gx_MK, gw_EKN, None, None, None, None, None, None


# How the opaque ops' bodies run on GPUs (FP8_GROUPED_BODY, read at each call):
#   "compiled"  _grouped_forward / _grouped_backward through torch.compile (default on CUDA). Why: an eager body is a
#               Python dispatch per cast, GEMM and statistic, and on the H200 hosts a Triton launch from Python cost
#               270-530 us of host time against 16-20 us for a torch op (benchmarks/grouped_host.py,
#               results/session7): at DeepSeek-MoE-16B's w13 the forward body took 0.9-1.6 ms of host time for
#               1.6 ms of GPU work, so a slow host starved the GPU. Compiled, Inductor launches the same Triton casts
#               with its own launchers and fuses the health statistics: 431 vs 916 us of host time per forward,
#               1538 vs 3125 us per forward + backward, and the MoE training step 125.62 vs 130.80 ms (same run).
#               The body still runs inside the opaque op, so the outer graph and its gradients are what "opaque"
#               mode gives (no autograd is traced here: the bodies are plain functions of tensors).
#   "eager"     the Python bodies as written (always on CPU, where the emulated path runs outside compile).
#   Under CUDA-graph trees (torch.compile mode="reduce-overhead") the bodies run eagerly: where steps are not
#   marked (cudagraph_mark_step_begin), the trees find iterations by dynamo's generation counter, which entering any
#   torch.compile'd function bumps, so a compiled body inside a graphed block made the trees treat that step's own
#   live outputs as stale ("accessing tensor output of CUDAGraphs that has been overwritten", session 8 on the
#   H200). Graph replay skips the bodies' Python anyway. orchestration's compile_blocks sets this (set_body_mode).
BODY_MODES = ("compiled", "eager")
_BODY_ENV = "FP8_GROUPED_BODY"
_COMPILED_BODIES: dict = {}
_body_mode_override: str | None = None


def set_body_mode(mode: str | None) -> None:
    """Force how the opaque ops' bodies run ("compiled" | "eager"); None goes back to FP8_GROUPED_BODY / the
    default. Process-wide: every MoE layer shares the two custom ops."""
    global _body_mode_override
    if mode is not None and mode not in BODY_MODES:
        raise ValueError(f"grouped GEMM body mode must be one of {BODY_MODES} or None, got {mode!r}")
    _body_mode_override = mode


def body_mode() -> str:
    """The body mode in force: set_body_mode's, else FP8_GROUPED_BODY's, else "compiled"."""
    if _body_mode_override is not None:
        return _body_mode_override
    mode = os.environ.get(_BODY_ENV, "compiled")
    if mode not in BODY_MODES:
        raise ValueError(f"{_BODY_ENV} must be one of {BODY_MODES}, got {mode!r}")
    return mode


def _run_body(fn, on_cuda: bool, *args):
    """fn(*args), through torch.compile unless the body mode (set_body_mode, else FP8_GROUPED_BODY) is eager, off CUDA,
    while tracing, or while a CUDA graph is being captured (compiling there could launch autotuning inside the
    capture; captured, the eager body's launch cost is paid once anyway)."""
    mode = body_mode()
    if (mode == "eager" or not on_cuda or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()):
        return fn(*args)
    if fn not in _COMPILED_BODIES:
        # dynamic=False: each layer shape (w13, w2) gets its own specialised code, as the blocks do.
        # fullgraph=False: a graph break would cost speed, never a training run (tests pin that there is none).
        _COMPILED_BODIES[fn] = torch.compile(fn, dynamic=False)
    # Same guards on every call, whoever calls: detached inputs and grad mode off (callers differ in both - the
    # compiled block, eager code, the no-grad shadow check - and each difference would be a recompile; the bodies
    # compute no gradients themselves).
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else
                     tuple(t.detach() for t in a) if isinstance(a, tuple) else a for a in args)
    with torch.no_grad():
        return _COMPILED_BODIES[fn](*detached)


# ---------------------------------------------------------------------------------------------------------------
# Opaque form: the same forward and backward as two torch.library custom ops. torch.compile keeps each one call in
# the block's graph (no graph break, no tracing of the casts and GEMMs inside, which the traced form got wrong on the
# H200), and the op bodies run exactly the eager code above.


@torch.library.custom_op("elastic_fp8::grouped_mm_fwd", mutates_args=())
def _grouped_fwd_op(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, e4m3: torch.dtype, use_scaled: bool, pow2: bool,
    wgrad: str, dgrad: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out_MN, stats, x_fp8_t_KM, sx_1K, sw_EN, q_EKN); x_fp8_t_KM and sx_1K are empty unless wgrad == "global"
    (else backward re-reads x itself, which an op output may not alias), sw_EN unless dgrad is "fp8_reuse" or
    "fp8_keep", q_EKN unless dgrad == "fp8_keep"."""
    out_MN, stats, saved_x, sw_EN, q_EKN = _run_body(_grouped_forward, x_MK.is_cuda, x_MK, w_EKN, offs_E, e4m3,
                                                     use_scaled, pow2, wgrad, dgrad)
    sw_keep = sw_EN.contiguous() if dgrad in _REUSES_FORWARD_WEIGHT else x_MK.new_empty(0, dtype=torch.float32)
    q_keep = q_EKN.contiguous() if q_EKN is not None else x_MK.new_empty(0, dtype=e4m3)
    if wgrad == "global":
        x_fp8_t_KM, sx_1K = saved_x
        return out_MN, stats, x_fp8_t_KM.contiguous(), sx_1K.contiguous(), sw_keep, q_keep
    return out_MN, stats, x_MK.new_empty(0, dtype=e4m3), x_MK.new_empty(0, dtype=torch.float32), sw_keep, q_keep


@_grouped_fwd_op.register_fake
def _(x_MK, w_EKN, offs_E, e4m3, use_scaled, pow2, wgrad, dgrad):
    M, K = x_MK.shape
    N = w_EKN.shape[-1]
    out = x_MK.new_empty(M, N)
    stats = x_MK.new_empty(3, dtype=torch.float32)
    sw_keep = x_MK.new_empty((w_EKN.shape[0], N) if dgrad in _REUSES_FORWARD_WEIGHT else (0,), dtype=torch.float32)
    q_keep = x_MK.new_empty(tuple(w_EKN.shape) if dgrad == "fp8_keep" else (0,), dtype=e4m3)
    if wgrad == "global":
        return (out, stats, x_MK.new_empty(K, M, dtype=e4m3), x_MK.new_empty(1, K, dtype=torch.float32), sw_keep,
                q_keep)
    return out, stats, x_MK.new_empty(0, dtype=e4m3), x_MK.new_empty(0, dtype=torch.float32), sw_keep, q_keep


def _gw_storage_shape(w_EKN: torch.Tensor) -> tuple[int, int, int]:
    E, K, N = w_EKN.shape
    return (E, N, K) if _is_column_major(w_EKN) else (E, K, N)


@torch.library.custom_op("elastic_fp8::grouped_mm_bwd", mutates_args=())
def _grouped_bwd_op(
    gy_MN: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, x_MK: torch.Tensor, x_fp8_t_KM: torch.Tensor,
    sx_1K: torch.Tensor, sw_EN: torch.Tensor, q_EKN: torch.Tensor, e4m3: torch.dtype, use_scaled: bool, pow2: bool,
    wgrad: str, dgrad: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (gx_MK, gw) with gw contiguous in the weight's storage layout ([E, N, K] for column-major w)."""
    saved_x = (x_fp8_t_KM, sx_1K) if wgrad == "global" else (x_MK,)
    gx_MK, gw_EKN = _run_body(_grouped_backward, gy_MN.is_cuda, gy_MN, w_EKN, offs_E, saved_x, e4m3, use_scaled,
                              pow2, wgrad, dgrad, sw_EN, q_EKN if dgrad == "fp8_keep" else None)
    gw = gw_EKN.transpose(-2, -1) if _is_column_major(w_EKN) else gw_EKN
    return gx_MK.contiguous(), gw.contiguous()


@_grouped_bwd_op.register_fake
def _(gy_MN, w_EKN, offs_E, x_MK, x_fp8_t_KM, sx_1K, sw_EN, q_EKN, e4m3, use_scaled, pow2, wgrad, dgrad):
    return gy_MN.new_empty(gy_MN.shape[0], w_EKN.shape[1]), gy_MN.new_empty(_gw_storage_shape(w_EKN), dtype=w_EKN.dtype)


def _grouped_op_setup(ctx, inputs, output):
    x_MK, w_EKN, offs_E, e4m3, use_scaled, pow2, wgrad, dgrad = inputs
    _, _, x_fp8_t_KM, sx_1K, sw_EN, q_EKN = output
    # "hp" and "per_expert" re-read x in backward; "global" keeps only the fp8 transposed copy and its scales.
    x_keep = x_MK if wgrad != "global" else x_MK.new_empty(0)
    ctx.save_for_backward(w_EKN, offs_E, x_keep, x_fp8_t_KM, sx_1K, sw_EN, q_EKN)
    ctx.args = (e4m3, use_scaled, pow2, wgrad, dgrad)
    ctx.w_column_major = _is_column_major(w_EKN)


def _grouped_op_backward(ctx, gy_MN, _g_stats, _g_xt, _g_sx, _g_sw, _g_q):
    w_EKN, offs_E, x_keep, x_fp8_t_KM, sx_1K, sw_EN, q_EKN = ctx.saved_tensors
    gx_MK, gw = _grouped_bwd_op(gy_MN, w_EKN, offs_E, x_keep, x_fp8_t_KM, sx_1K, sw_EN, q_EKN, *ctx.args)
    gw_EKN = gw.transpose(-2, -1) if ctx.w_column_major else gw
    return gx_MK, gw_EKN, None, None, None, None, None, None


torch.library.register_autograd(
    "elastic_fp8::grouped_mm_fwd", _grouped_op_backward, setup_context=_grouped_op_setup
)


# How a torch.compile'd block runs the grouped GEMM (FP8_GROUPED_MODE, read at each call; also an attribute):
#   "opaque"  the two custom ops above: one node each in the block's graph, bodies run the eager code (default).
#   "eager"   the autograd.Function outside the graph (torch.compiler.disable): a graph break around every call.
#   "traced"  the autograd.Function traced into the graph. On the H200 (torch 2.11) every expert weight gradient
#             came out exactly zero this way (forward right, eager right, the same graph on CPU right): kept only
#             to reproduce that (benchmarks/moe_grads_check.py) and for tests/test_fp8_gpu.py's checks.
GROUPED_MODES = ("opaque", "eager", "traced")
_GROUPED_MODE_ENV = "FP8_GROUPED_MODE"

# The grad-input GEMM gx = gy @ w^T (FP8_GROUPED_DGRAD overrides the constructor's choice, for A/B runs):
#   "fp8"       fp8, accumulated with periodic promotion to fp32 (use_fast_accum=False).
#   "fp8_fast"  fp8 with the tensor cores' fast accumulation (as the forward GEMM).
#   "hp"        in the activations' precision (bf16 grouped GEMM): no backward weight cast and no row cast of gy.
#   "fp8_reuse" fp8 (fast accumulation) on the forward's quantized weight: w recast by the forward's saved row scales
#               into the grad-input layout (one read of w, no amax pass), those scales folded into gy's row cast
#               (exact: powers of two). Replaces the two-pass column cast of w (~0.8 ms a layer of DeepSeek-MoE-16B
#               on the H200, session 16's profile); the weight enters backward as forward quantized it.
#   "width"     "hp" where gx's width K is not a multiple of 256, else "fp8": the default of sessions 4-12, when the
#               promoted fp8 kernel ran DeepSeek-MoE's w2 grad-input (K = 1408) at 0.59x of bf16.
#   "auto"      "fp8_reuse" with power-of-two scales (the default recipe), else "fp8_fast". Why: alone on the H200
#               (session 13, BENCHMARKS.md) the promoted kernel ran w2's grad-input at 1.794 ms against 0.616 ms fast
#               and 1.007 ms bf16 (w13: 1.281 / 1.215 / 1.849), fast accumulation keeping gx's SQNR against float64
#               within 0.5 dB of the promoted kernel's at both widths; and reusing the forward's quantized weight
#               took DeepSeek-MoE-16B's routed experts from 8.87 to 8.24 ms (bf16 9.16) in one run (session 17,
#               call A), its gx within 0.5 dB of fast's (tests/test_fp8_gpu.py on the H200). The folding of the
#               saved scales into gy's row cast is exact only for power-of-two scales, hence the condition.
#   "fp8_keep"  "fp8_reuse" with the weight's grad-input layout written by the forward's cast (one kernel writing both
#               layouts, quant.quantize_colwise_3d_both_layouts) and kept for backward: no second read of the bf16
#               weight (the recast: 0.36 ms for DeepSeek-MoE-16B's w13 on the H200, session 18), at the cost of one
#               byte per expert parameter alive from forward to backward - of the gathered weight under FSDP, so per
#               GPU and per MoE layer: ~15 GB for DeepSeek-MoE-16B's 27 MoE layers without activation checkpointing
#               (with it, one layer's worth; models/planning.py does not count fp8 copies). The same bytes as
#               "fp8_reuse". Not yet measured on a GPU (benchmarks/scripts/session19_a.sh): "auto" does not pick it.
DGRAD_CHOICES = ("fp8", "fp8_fast", "hp", "width", "auto", "fp8_reuse", "fp8_keep")
_DGRAD_ENV = "FP8_GROUPED_DGRAD"
# The grad-input choices that run on the forward's quantized weight, so need its saved row scales.
_REUSES_FORWARD_WEIGHT = ("fp8_reuse", "fp8_keep")

# Rows per expert group (token_group_align). An fp8 weight-gradient GEMM ("global", "per_expert") contracts over the
# token dim, laid out contiguous ([K, M] transposed copies), so each group must start 16 bytes (= 16 fp8 rows) apart:
# 16 is required there. With wgrad_scaling="hp" (the default) no fp8 GEMM contracts over tokens: the forward and
# grad-input GEMMs slice whole rows of K or N bytes (multiples of 16), and the bf16 weight-gradient GEMM is the one the
# bf16 model runs unpadded. Padding then only costs a zero-filled [S*top_k + E*(align-1), D] copy of the routed tokens
# in forward and its gradient in backward (3 more zero fills in session 18's MoE profile than bf16's). The default
# stays 16 until 1 is checked on the GPU (tests/test_fp8_gpu.py, unaligned groups; the scales' per-group reads in
# torch's rowwise kernel are the unknown) and timed (benchmarks/scripts/session19_b.sh, train_step "+align1").
DEFAULT_TOKEN_GROUP_ALIGN = 16


def check_token_group_align(align: int, wgrad_scaling: str) -> None:
    """Raise ValueError unless `align` is a power of two >= 1 that the weight-gradient GEMM allows (16 | align for
    fp8 weight gradients)."""
    if isinstance(align, bool) or not isinstance(align, int) or align < 1 or align & (align - 1):
        raise ValueError(f"token_group_align must be a power of two >= 1, got {align!r}")
    if wgrad_scaling != "hp" and align % 16:
        raise ValueError(f"token_group_align={align} with wgrad_scaling={wgrad_scaling!r}: an fp8 weight-gradient GEMM "
                         "contracts over tokens and needs 16-row aligned groups; use 16 (or a multiple) or "
                         "wgrad_scaling='hp'")


class Fp8GroupedMM:
    """Drop-in for a GroupedExperts module's `grouped_mm` attribute: (x_MK, w_EKN, offs_E) -> out_MN.

    A plain callable (not an nn.Module), so swapping it in adds no parameters, buffers or state_dict keys.
    `last_stats` holds the on-device health scalars of its last call (see fp8_health).
    """

    def __init__(self, emulate: bool | None = None, pow2: bool = True, wgrad_scaling: str = "hp",
                 mode: str | None = None, dgrad: str = "auto", token_group_align: int = DEFAULT_TOKEN_GROUP_ALIGN):
        if wgrad_scaling not in WGRAD_SCALINGS:
            raise ValueError(f"wgrad_scaling must be one of {WGRAD_SCALINGS}, got {wgrad_scaling!r}")
        check_token_group_align(token_group_align, wgrad_scaling)
        # Rows per expert group the model's routing pads to while this op serves it (see the comment above
        # check_token_group_align).
        self.token_group_align = token_group_align
        if dgrad not in DGRAD_CHOICES:
            raise ValueError(f"dgrad must be one of {DGRAD_CHOICES}, got {dgrad!r}")
        quant.look_up_kernels_eagerly()  # before any compile traces the casts (fp8.quant._kernels)
        self.dgrad = dgrad
        if mode is not None and mode not in GROUPED_MODES:
            raise ValueError(f"mode must be one of {GROUPED_MODES} (or None: ${_GROUPED_MODE_ENV}), got {mode!r}")
        self.emulate = emulate
        self.pow2 = pow2
        self.wgrad_scaling = wgrad_scaling
        self.mode = mode
        self.last_stats: torch.Tensor | None = None

    def _mode(self) -> str:
        if self.mode is not None:
            return self.mode
        mode = os.environ.get(_GROUPED_MODE_ENV, "opaque")
        if mode not in GROUPED_MODES:
            raise ValueError(f"{_GROUPED_MODE_ENV} must be one of {GROUPED_MODES}, got {mode!r}")
        return mode

    def dgrad_for(self, w_EKN: torch.Tensor) -> str:
        """How the grad-input GEMM of this weight runs: "fp8" | "fp8_fast" | "fp8_reuse" | "fp8_keep" | "hp" (see
        DGRAD_CHOICES)."""
        dgrad = os.environ.get(_DGRAD_ENV, self.dgrad)
        if dgrad not in DGRAD_CHOICES:
            raise ValueError(f"{_DGRAD_ENV} must be one of {DGRAD_CHOICES}, got {dgrad!r}")
        if dgrad == "width":
            return "hp" if w_EKN.shape[-2] % 256 != 0 else "fp8"
        if dgrad == "auto":
            return "fp8_reuse" if self.pow2 else "fp8_fast"
        return dgrad

    def hp_dgrad(self, w_EKN: torch.Tensor) -> bool:
        """Whether the grad-input GEMM of this weight runs in high precision (see DGRAD_CHOICES)."""
        return self.dgrad_for(w_EKN) == "hp"

    def _prepare(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor):
        if offs_E.dtype != torch.int32:
            raise ValueError(f"grouped_mm offsets must be int32 cumulative ends, got {offs_E.dtype}")
        x_MK, w_EKN = to_compute_dtype(x_MK, w_EKN)
        backend = get_backend(x_MK.device)
        use_scaled = backend.has_scaled_grouped_mm if self.emulate is None else not self.emulate
        return x_MK, w_EKN, backend, use_scaled, self.dgrad_for(w_EKN)

    def call_traceable(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        """The autograd.Function form (eager, or traced into a compiled graph: the "traced" mode)."""
        x_MK, w_EKN, backend, use_scaled, dgrad = self._prepare(x_MK, w_EKN, offs_E)
        out_MN, stats = _Fp8GroupedMMFn.apply(
            x_MK, w_EKN, offs_E, backend, use_scaled, self.pow2, self.wgrad_scaling, dgrad
        )
        self.last_stats = stats
        return out_MN

    def call_opaque(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        """The custom-op form: the same numbers, one graph node per direction under torch.compile."""
        x_MK, w_EKN, backend, use_scaled, dgrad = self._prepare(x_MK, w_EKN, offs_E)
        out_MN, stats, _, _, _, _ = _grouped_fwd_op(
            x_MK, w_EKN, offs_E, backend.e4m3, use_scaled, self.pow2, self.wgrad_scaling, dgrad
        )
        self.last_stats = stats
        return out_MN

    _call_eager = torch.compiler.disable(call_traceable)

    def __call__(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        mode = self._mode()
        if mode == "opaque":
            return self.call_opaque(x_MK, w_EKN, offs_E)
        if mode == "eager":
            return self._call_eager(x_MK, w_EKN, offs_E)
        return self.call_traceable(x_MK, w_EKN, offs_E)

    def __repr__(self) -> str:
        return (f"Fp8GroupedMM(rowwise, wgrad_scaling={self.wgrad_scaling}, dgrad={self.dgrad}, emulate={self.emulate},"
                f" mode={self._mode()}, token_group_align={self.token_group_align})")


def fp8_grouped_mm(
    x_MK: torch.Tensor,
    w_EKN: torch.Tensor,
    offs_E: torch.Tensor,
    emulate: bool | None = None,
    wgrad_scaling: str = "hp",
):
    """Functional form of Fp8GroupedMM."""
    return Fp8GroupedMM(emulate=emulate, wgrad_scaling=wgrad_scaling)(x_MK, w_EKN, offs_E)
