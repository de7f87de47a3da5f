"""FP8 grouped GEMM for MoE experts (rowwise, power-of-two scales), forward and backward.

Semantics are torch._grouped_mm's for a 2D activation and a 3D expert weight:

    out_MN[rows of group e] = x_MK[rows of group e] @ w_EKN[e]

with `offs_E` int32 cumulative end offsets (group e owns rows offs[e-1]:offs[e]). Rows past offs[-1]
are left unspecified, as in torch. Groups may start at any row: no padding between them is needed (torch's rowwise
grouped kernel reads groups that start at unaligned rows correctly, tests/test_fp8_gpu.py), because no fp8 GEMM here
contracts over the token dim.

The three GEMMs (scales always along the contraction dim, powers of two so scaling is exact):
    forward      out  = x @ w[e]          x rowwise (M,), w per expert per column (E, N)
    grad_input   gx   = gy @ w[e]^T       on the weight exactly as forward quantized it, in the [E, K, N] row-major
                                          layout this GEMM reads, its scales folded into gy's row cast (exact: powers
                                          of two). Faster than a second column cast of w and than bf16 for
                                          DeepSeek-MoE-16B's routed experts, gx as accurate (BENCHMARKS.md, "MoE
                                          grouped FFN"). Where that weight comes from (_keeps_fp8_weight):
                                          - w stored wider than the tokens' dtype (float32 master weights under bf16
                                            autocast): the forward's fp8 bytes, transposed by the forward and kept
                                            (1 byte a weight; a bf16 copy for backward would be 2);
                                          - w in the tokens' dtype (FSDP2's bf16 gather): w itself is kept, which
                                            costs nothing (FSDP2 frees it after the forward and gathers it again for
                                            the backward), and recast there by the forward's saved scales (one read,
                                            no amax pass).
    grad_weight  gw[e] = x_e^T @ gy_e     in the activations' precision (bf16 grouped GEMM): the fp8 grouped GEMM
                                          that contracts over the jagged token dim is barely faster than bf16 at
                                          DeepSeek-MoE-16B shapes or slower, so fp8 there only adds casts and the
                                          whole FFN ran slower; the weight gradient keeps bf16 accuracy
                                          (BENCHMARKS.md, "Tried, did not pay").

The weight may be any [E, K, N] layout and any float dtype. Stored [E, N, K] (nn.Linear's out x in, passed as the
column-major view w.transpose(-2, -1)), the forward cast is a plain row cast of that storage and grad_weight is
computed directly in the storage layout (gw^T = gy^T x), so no high-precision transposed copy is made. Only the tokens
take autocast's dtype: float32 master weights are cast to fp8 as they are stored, so no bf16 copy of the experts is
written, read back and kept for backward (BENCHMARKS.md, "Expert weights cast from float32").

Paths: torch._scaled_grouped_mm on CUDA sm90 and on ROCm (torch routes it to Composable Kernel); on any
other device an emulated path runs the same fp8 operands dequantized to float32 through torch._grouped_mm.

Legend: M routed tokens, K in dim, N out dim, E experts.
"""

from __future__ import annotations

import torch

from fp8 import quant
from fp8.backend import Fp8Backend, get_backend
from fp8.linear import health_stats, to_compute_dtype
from fp8.reference import group_ids

# Power-of-two scales: scaling is exact, so only the fp8 cast rounds, and the grad-input GEMM can move the weight's
# forward scales onto gy's columns without changing a bit.
_POW2 = True


@torch.compiler.disable
def _grouped_emulated(a32: torch.Tensor, b32: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    # float32 torch._grouped_mm runs on CPU but its fake-tensor rule admits bf16 only, so keep it out of
    # compiled graphs (a graph break on the emulated path; the GPU path has none).
    return torch._grouped_mm(a32, b32, offs_E)


def _is_column_major(w_EKN: torch.Tensor) -> bool:
    """[E, K, N] stored as [E, N, K] row-major (the transposed view of an [E, out, in] parameter)."""
    return w_EKN.stride(-2) == 1 and w_EKN.stride(-1) == w_EKN.shape[-2]


def _scaled_or_emulated_2d3d(a_fp8, sa_M1, b_fp8, sb_E1N, offs_E, use_scaled: bool):
    """out[rows of e] = a[rows of e] @ b[e], fp8 operands with scales along K (a: per row, b: per expert column).
    Fast accumulation on the GPU: the promoted kernel ran w2's grad-input several times slower, for gx's SQNR against
    float64 within 0.5 dB of fast accumulation's (BENCHMARKS.md, "Tried, did not pay")."""
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
            use_fast_accum=True,
        )
    return _grouped_emulated(a_fp8.float() / sa_M1, b_fp8.float() / sb_E1N, offs_E)


def _wgrad_hp(x_MK, gy_MN, offs_E, out_ENK: bool) -> torch.Tensor:
    """gw[e] = x_e^T @ gy_e in the activations' precision (bf16 grouped GEMM; float32 emulated off CUDA)."""
    a, b = (gy_MN.t(), x_MK) if out_ENK else (x_MK.t(), gy_MN)
    if a.dtype == torch.bfloat16 and a.is_cuda:
        gw = torch._grouped_mm(a, b, offs=offs_E)
    else:
        gw = _grouped_emulated(a.float(), b.float(), offs_E)
    return gw.transpose(-2, -1) if out_ENK else gw


def _keeps_fp8_weight(w_EKN: torch.Tensor, x_MK: torch.Tensor) -> bool:
    """Whether the forward keeps its fp8 weight for backward rather than the weight itself (module docstring)."""
    return w_EKN.dtype != x_MK.dtype


def _grouped_forward(x_MK, w_EKN, offs_E, e4m3: torch.dtype, use_scaled: bool, keep_fp8_weight: bool):
    """-> (out_MN, stats, sw_EN, q_EKN): sw_EN the weight's forward scales (per expert and output column, along K) and
    q_EKN the forward's fp8 weight as a row-major [E, K, N] copy when keep_fp8_weight (else an empty tensor), which the
    grad-input GEMM reuses."""
    x_MK = x_MK.contiguous()
    x_fp8, sx_M1 = quant.quantize_rowwise(x_MK, e4m3, -1, _POW2)
    # Per expert, per output column n, scaled along K, column-major (strides (K*N, 1, K)) as the grouped
    # GEMM's right operand wants: a plain row cast when w is already stored [E, N, K].
    w_fp8, sw_E1N = quant.quantize_colwise_3d(w_EKN, e4m3, _POW2)
    out_MN = _scaled_or_emulated_2d3d(x_fp8, sx_M1, w_fp8, sw_E1N, offs_E, use_scaled)
    stats = health_stats(x_MK, x_fp8, sx_M1, e4m3)
    # The same fp8 bytes transposed, row-major [E, K, N]: kept for the grad-input GEMM instead of the weight.
    q_EKN = quant.transpose(w_fp8.transpose(-2, -1)) if keep_fp8_weight else w_fp8.new_empty(0)
    return out_MN.to(x_MK.dtype), stats, sw_E1N.reshape(sw_E1N.shape[0], -1), q_EKN


def _grouped_backward(gy_MN, kept_EKN, offs_E, x_MK, sw_EN, kept_is_fp8: bool, w_column_major: bool,
                      w_dtype: torch.dtype, e4m3: torch.dtype, use_scaled: bool):
    """-> (gx_MK, gw_EKN) from the forward's input x, what it kept of the weight (its fp8 weight q_EKN when
    kept_is_fp8, else the weight w_EKN) and the weight's scales sw_EN; gw_EKN in w_dtype, a view of the weight's
    storage layout (w_column_major: stored [E, N, K]). Both always: expert weights always train."""
    gy_MN = gy_MN.contiguous()
    # The forward's quantized weight q[e, k, n] = sat(w[e, k, n] * sw[e, n]), kept or recast from w by the saved scales
    # into the [E, K, N] row-major layout this GEMM reads; its scales lie along N, the contraction dim here, so they
    # move onto gy's columns (exact: powers of two), group by group:
    #   gx[m, k] = sum_n (gy[m, n] / sw[e(m), n]) * q[e(m), k, n]
    # and gy / sw is quantized per row as gy would be.
    q_EKN = kept_EKN if kept_is_fp8 else quant.cast_rows_transposed_batched(kept_EKN.transpose(-2, -1), sw_EN, e4m3)
    num_groups = sw_EN.shape[0]
    inv_sw_GN = torch.cat([sw_EN.reciprocal(), sw_EN.new_zeros(1, sw_EN.shape[1])])  # rows past offs[-1]: 0
    # Powers of two are exact in bf16 (fp32's exponent range): half the bytes the cast kernel reads.
    inv_sw_GN = inv_sw_GN.to(torch.bfloat16)
    gid_M = group_ids(offs_E, gy_MN.shape[0]).to(torch.int32).clamp_(max=num_groups)
    gy_fp8, sg_M1 = quant.quantize_rowwise_group_scaled(gy_MN, inv_sw_GN, gid_M, e4m3, _POW2)
    ones_E1K = sw_EN.new_ones(num_groups, 1, q_EKN.shape[1])
    gx_MK = _scaled_or_emulated_2d3d(gy_fp8, sg_M1, q_EKN.transpose(-2, -1), ones_E1K, offs_E,
                                     use_scaled).to(gy_MN.dtype)
    gw_EKN = _wgrad_hp(x_MK, gy_MN, offs_E, w_column_major)
    return gx_MK, gw_EKN.to(w_dtype)


class _Fp8GroupedMMFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_EKN, offs_E, backend: Fp8Backend, use_scaled: bool):
        keep_fp8 = _keeps_fp8_weight(w_EKN, x_MK)
        out_MN, stats, sw_EN, q_EKN = _grouped_forward(x_MK, w_EKN, offs_E, backend.e4m3, use_scaled, keep_fp8)
        ctx.save_for_backward(q_EKN if keep_fp8 else w_EKN, offs_E, sw_EN, x_MK)
        ctx.keep_fp8, ctx.w_column_major, ctx.w_dtype = keep_fp8, _is_column_major(w_EKN), w_EKN.dtype
        ctx.e4m3, ctx.use_scaled = backend.e4m3, use_scaled
        ctx.mark_non_differentiable(stats)
        return out_MN, stats

    @staticmethod
    def backward(ctx, gy_MN, _grad_stats):
        kept_EKN, offs_E, sw_EN, x_MK = ctx.saved_tensors
        gx_MK, gw_EKN = _grouped_backward(gy_MN, kept_EKN, offs_E, x_MK.contiguous(), sw_EN, ctx.keep_fp8,
                                          ctx.w_column_major, ctx.w_dtype, ctx.e4m3, ctx.use_scaled)
        return gx_MK, gw_EKN, None, None, None


# How the opaque ops' bodies run on GPUs:
#   "compiled"  _grouped_forward / _grouped_backward through torch.compile (default on CUDA). Why: an eager body is a
#               Python dispatch per cast, GEMM and statistic, and a Triton launch from Python costs far more host
#               time than a torch op (benchmarks/grouped_host.py): at DeepSeek-MoE-16B's w13 the forward body's host
#               time was about its GPU time, so a slow host starved the GPU. Compiled, Inductor launches the same
#               Triton casts with its own launchers and fuses the health statistics: about half the host time, and a
#               faster MoE training step (BENCHMARKS.md, "Tried, did not pay").
#               The body still runs inside the opaque op, so the outer graph and its gradients are what "opaque"
#               mode gives (no autograd is traced here: the bodies are plain functions of tensors).
#   "eager"     the Python bodies as written (always on CPU, where the emulated path runs outside compile).
#   Under CUDA-graph trees (torch.compile mode="reduce-overhead") the bodies run eagerly: where steps are not
#   marked (cudagraph_mark_step_begin), the trees find iterations by dynamo's generation counter, which entering any
#   torch.compile'd function bumps, so a compiled body inside a graphed block made the trees treat that step's own
#   live outputs as stale ("accessing tensor output of CUDAGraphs that has been overwritten"). Graph
#   replay skips the bodies' Python anyway. orchestration's compile_blocks sets this (set_body_mode).
BODY_MODES = ("compiled", "eager")
_COMPILED_BODIES: dict = {}
_body_mode_override: str | None = None


def set_body_mode(mode: str | None) -> None:
    """Force how the opaque ops' bodies run ("compiled" | "eager"); None goes back to the default ("compiled").
    Process-wide: every MoE layer shares the two custom ops."""
    global _body_mode_override
    if mode is not None and mode not in BODY_MODES:
        raise ValueError(f"grouped GEMM body mode must be one of {BODY_MODES} or None, got {mode!r}")
    _body_mode_override = mode


def body_mode() -> str:
    """The body mode in force: set_body_mode's, else "compiled"."""
    return _body_mode_override if _body_mode_override is not None else "compiled"


def _run_body(fn, on_cuda: bool, *args):
    """fn(*args), through torch.compile unless the body mode (set_body_mode) is eager, off CUDA, while tracing, or while
    a CUDA graph is being captured (compiling there could launch autotuning inside the capture; captured, the eager
    body's launch cost is paid once anyway)."""
    if (body_mode() == "eager" or not on_cuda or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()):
        return fn(*args)
    if fn not in _COMPILED_BODIES:
        # dynamic=False: each layer shape (w13, w2) gets its own specialised code, as the blocks do.
        # fullgraph=False: a graph break would cost speed, never a training run (tests pin that there is none).
        _COMPILED_BODIES[fn] = torch.compile(fn, dynamic=False)
    # Same guards on every call, whoever calls: detached inputs and grad mode off (callers differ in both - the
    # compiled block, eager code, the no-grad shadow check - and each difference would be a recompile; the bodies
    # compute no gradients themselves).
    detached = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    with torch.no_grad():
        return _COMPILED_BODIES[fn](*detached)


# ---------------------------------------------------------------------------------------------------------------
# Opaque form: the same forward and backward as two torch.library custom ops. torch.compile keeps each one call in
# the block's graph (no graph break, no tracing of the casts and GEMMs inside: traced into a compiled MoE block
# (torch 2.11, CUDA), the autograd.Function left every expert weight gradient exactly zero), and the op bodies run
# exactly the eager code above.


@torch.library.custom_op("elastic_fp8::grouped_mm_fwd", mutates_args=())
def _grouped_fwd_op(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, e4m3: torch.dtype, use_scaled: bool,
    keep_fp8_weight: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out_MN, stats, sw_EN, q_EKN)."""
    out_MN, stats, sw_EN, q_EKN = _run_body(_grouped_forward, x_MK.is_cuda, x_MK, w_EKN, offs_E, e4m3, use_scaled,
                                            keep_fp8_weight)
    return out_MN, stats, sw_EN.contiguous(), q_EKN


@_grouped_fwd_op.register_fake
def _(x_MK, w_EKN, offs_E, e4m3, use_scaled, keep_fp8_weight):
    M, _ = x_MK.shape
    E, K, N = w_EKN.shape
    q_shape = (E, K, N) if keep_fp8_weight else (0,)
    return (x_MK.new_empty(M, N), x_MK.new_empty(3, dtype=torch.float32), x_MK.new_empty(E, N, dtype=torch.float32),
            x_MK.new_empty(q_shape, dtype=e4m3))


@torch.library.custom_op("elastic_fp8::grouped_mm_bwd", mutates_args=())
def _grouped_bwd_op(
    gy_MN: torch.Tensor, kept_EKN: torch.Tensor, offs_E: torch.Tensor, x_MK: torch.Tensor, sw_EN: torch.Tensor,
    kept_is_fp8: bool, w_column_major: bool, w_dtype: torch.dtype, e4m3: torch.dtype, use_scaled: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (gx_MK, gw) with gw contiguous in the weight's storage layout ([E, N, K] for column-major w) and dtype."""
    gx_MK, gw_EKN = _run_body(_grouped_backward, gy_MN.is_cuda, gy_MN, kept_EKN, offs_E, x_MK, sw_EN, kept_is_fp8,
                              w_column_major, w_dtype, e4m3, use_scaled)
    gw = gw_EKN.transpose(-2, -1) if w_column_major else gw_EKN
    return gx_MK.contiguous(), gw.contiguous()


@_grouped_bwd_op.register_fake
def _(gy_MN, kept_EKN, offs_E, x_MK, sw_EN, kept_is_fp8, w_column_major, w_dtype, e4m3, use_scaled):
    E, K, N = kept_EKN.shape
    return gy_MN.new_empty(gy_MN.shape[0], K), gy_MN.new_empty((E, N, K) if w_column_major else (E, K, N), dtype=w_dtype)


def _grouped_op_setup(ctx, inputs, output):
    x_MK, w_EKN, offs_E, e4m3, use_scaled, keep_fp8_weight = inputs
    _, _, sw_EN, q_EKN = output
    # Backward re-reads x for the bf16 weight gradient, and the fp8 weight or the weight for the grad input.
    ctx.save_for_backward(q_EKN if keep_fp8_weight else w_EKN, offs_E, x_MK, sw_EN)
    ctx.w_column_major = _is_column_major(w_EKN)
    ctx.args = (keep_fp8_weight, ctx.w_column_major, w_EKN.dtype, e4m3, use_scaled)


def _grouped_op_backward(ctx, gy_MN, _g_stats, _g_sw, _g_q):
    kept_EKN, offs_E, x_MK, sw_EN = ctx.saved_tensors
    gx_MK, gw = _grouped_bwd_op(gy_MN, kept_EKN, offs_E, x_MK, sw_EN, *ctx.args)
    gw_EKN = gw.transpose(-2, -1) if ctx.w_column_major else gw
    return gx_MK, gw_EKN, None, None, None, None


torch.library.register_autograd(
    "elastic_fp8::grouped_mm_fwd", _grouped_op_backward, setup_context=_grouped_op_setup
)


# How a torch.compile'd block runs the grouped GEMM:
#   "opaque"  the two custom ops above: one node each in the block's graph, bodies run the eager code (default).
#   "eager"   the autograd.Function outside the graph (torch.compiler.disable): a graph break around every call; the
#             reference the opaque ops are tested against.
GROUPED_MODES = ("opaque", "eager")


class Fp8GroupedMM:
    """Drop-in for a GroupedExperts module's `grouped_mm` attribute: (x_MK, w_EKN, offs_E) -> out_MN.

    A plain callable (not an nn.Module), so swapping it in adds no parameters, buffers or state_dict keys.
    `last_stats` holds the on-device health scalars of its last call (see fp8_health). emulate: None picks by
    backend, True forces the float32 emulation, False forces torch._scaled_grouped_mm.
    """

    def __init__(self, emulate: bool | None = None, mode: str = "opaque"):
        if mode not in GROUPED_MODES:
            raise ValueError(f"mode must be one of {GROUPED_MODES}, got {mode!r}")
        quant.look_up_kernels_eagerly()  # before any compile traces the casts (fp8.quant._kernels)
        self.emulate = emulate
        self.mode = mode
        self.last_stats: torch.Tensor | None = None

    def _prepare(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor):
        if offs_E.dtype != torch.int32:
            raise ValueError(f"grouped_mm offsets must be int32 cumulative ends, got {offs_E.dtype}")
        x_MK = to_compute_dtype(x_MK)  # the weight is cast to fp8 from its stored dtype (module docstring)
        backend = get_backend(x_MK.device)
        use_scaled = backend.has_scaled_grouped_mm if self.emulate is None else not self.emulate
        return x_MK, w_EKN, backend, use_scaled

    def _call_function(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        x_MK, w_EKN, backend, use_scaled = self._prepare(x_MK, w_EKN, offs_E)
        out_MN, stats = _Fp8GroupedMMFn.apply(x_MK, w_EKN, offs_E, backend, use_scaled)
        self.last_stats = stats
        return out_MN

    _call_eager = torch.compiler.disable(_call_function)

    def _call_opaque(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        x_MK, w_EKN, backend, use_scaled = self._prepare(x_MK, w_EKN, offs_E)
        out_MN, stats, _, _ = _grouped_fwd_op(x_MK, w_EKN, offs_E, backend.e4m3, use_scaled,
                                              _keeps_fp8_weight(w_EKN, x_MK))
        self.last_stats = stats
        return out_MN

    def __call__(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
        if self.mode == "opaque":
            return self._call_opaque(x_MK, w_EKN, offs_E)
        return self._call_eager(x_MK, w_EKN, offs_E)

    def __repr__(self) -> str:
        return f"Fp8GroupedMM(rowwise, emulate={self.emulate}, mode={self.mode})"


def fp8_grouped_mm(x_MK: torch.Tensor, w_EKN: torch.Tensor, offs_E: torch.Tensor, emulate: bool | None = None):
    """Functional form of Fp8GroupedMM."""
    return Fp8GroupedMM(emulate=emulate)(x_MK, w_EKN, offs_E)
