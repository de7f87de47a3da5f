"""AdamW with torch.optim.AdamW's state, settings and checkpoints, stepped by one Triton launch for all parameters,
with the gradient clip folded into that launch.

Why (profiles of benchmarks/train_step.py; BENCHMARKS.md has the figures): torch's fused AdamW reached about half of
the GPU's HBM bandwidth for the 8-layer Llama3-8B-width model's bf16 parameters, in a launch per 320 chunks of 65536
elements (multi_tensor_apply's limit), and the clip's scaling pass (`clip_grads_with_norm_`: one more read and write
of every gradient) came on top, in the dense and the MoE step alike. Both precisions pay them, so they are pure step
time for every run.

Here: one launch over BLOCK-element chunks of every parameter of a dtype bucket. A table of per-tensor addresses
(parameter, gradient, exp_avg, exp_avg_sq, step) lives on the device and is re-sent only when an address changes
(gradients set to None each step usually come back at the same addresses from the caching allocator). The clip
coefficient min(1, max_norm / (norm + 1e-6)) is computed in the kernel from the gradient norm on the device, so a
clipped step reads each gradient once and writes it never.

Math: torch's fused AdamW (decoupled weight decay), in fp32 whatever the storage dtype:
    p  <- p - lr * wd * p
    m  <- beta1 * m + (1 - beta1) * g
    v  <- beta2 * v + (1 - beta2) * g^2
    p  <- p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
with t the step count after this step (torch increments it first; here it is incremented by one foreach add after the
launch, because the chunks of one tensor must all read the same count). `adamw_reference_step` is the same in
PyTorch (float64 in tests).

Anything the kernel does not cover - amsgrad, maximize, capturable, differentiable, a tensor lr, a closure, sparse or
non-contiguous gradients, parameters or states that are not 16-byte aligned, devices other than CUDA (ROCm included:
unverified), no Triton - goes through torch.optim.AdamW.step unchanged (with clip_grads_with_norm_ first when a clip was asked).
The state dict is torch's (exp_avg, exp_avg_sq, a float32 step on the device as the fused implementation keeps it),
so checkpoints load into either implementation. Gradients at unaligned addresses (views into FSDP2's flat
reduce-scatter output at odd offsets) run through the kernel without the alignment hint on them (scalar accesses).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    # max |x| with NaN kept, as torch.amax and the FP8 casts reduce it (the weight amax is theirs: fp8.weight_amax)
    from fp8.kernels.triton_fp8 import _abs_max

    HAS_TRITON = True
except ImportError:  # CPU-only installs: torch's step runs instead
    triton = None
    tl = None
    HAS_TRITON = False

# Elements per program and warps: the fastest of benchmarks/adamw.py's sweeps (bf16 and fp32 parameters, clip
# included; BENCHMARKS.md): smaller programs won with scalar accesses, and vector accesses (HINT_POINTERS) at 512
# elements and 4 warps won over all, near the HBM bandwidth.
BLOCK = 512
NUM_WARPS = 4
HINT_POINTERS = True  # state 16-byte alignment to the compiler where it holds (see the kernel); False: no hints
# The amax reduction runs one program per weight, reading its chunk partials AMAX_SEGMENT_BLOCK at a time: Llama3-8B's
# head has ~10^6 chunks (a 4 MB read, ~130 loads at this block, not ~1000 serial ones at 1024), its block linears
# 10^4-10^5. Chosen by that count, not timed (benchmarks/adamw.py: ours_clip_kept_amax_ms).
AMAX_SEGMENT_BLOCK = 8192
AMAX_SEGMENT_WARPS = 8
# Columns of the address table, one row per tensor.
_P, _M, _V, _STEP = 0, 1, 2, 3


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def adamw_reference_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float,
                         beta1: float, beta2: float, eps: float, weight_decay: float,
                         clip_coef: float = 1.0) -> None:
    """One AdamW step in place, in the tensors' own dtype (float64 in tests): the kernel's math, for checking it.
    `step` is the count after this step; `clip_coef` multiplies the gradient first."""
    g = g * clip_coef
    p.mul_(1 - lr * weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias1 = 1 - beta1**step
    bias2_sqrt = (1 - beta2**step) ** 0.5
    p.sub_((lr / bias1) * m / (v.sqrt() / bias2_sqrt + eps))


if HAS_TRITON:

    @triton.jit
    def _adamw_update(p, g, m, v, coef, lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt):
        g = g * coef
        p = p - (lr * weight_decay) * p
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        return p, m, v

    @triton.jit
    def _adamw_chunks_kernel(addr_ptr, grad_addr_ptr, numel_ptr, chunk_tensor_ptr, chunk_index_ptr, norm_ptr,
                             gate_ptr, amax_partial_ptr, lr, beta1, beta2, eps, weight_decay, max_norm,
                             P_DTYPE: tl.constexpr, G_DTYPE: tl.constexpr, S_DTYPE: tl.constexpr,
                             CLIP: tl.constexpr, GATED: tl.constexpr, AMAX: tl.constexpr, BLOCK: tl.constexpr,
                             ALIGNED_STATES: tl.constexpr, ALIGNED_GRADS: tl.constexpr):
        chunk = tl.program_id(0)
        t = tl.load(chunk_tensor_ptr + chunk).to(tl.int64)
        # The chunk's first element as index * BLOCK: the compiler then knows it is a multiple of BLOCK and, with the
        # 16-byte aligned addresses below, issues vector loads (a start loaded as such would be of unknown alignment).
        start = tl.load(chunk_index_ptr + chunk).to(tl.int64) * BLOCK
        row = addr_ptr + t * 4
        p_ptr = tl.load(row + 0).to(tl.pointer_type(P_DTYPE))
        m_ptr = tl.load(row + 1).to(tl.pointer_type(S_DTYPE))
        v_ptr = tl.load(row + 2).to(tl.pointer_type(S_DTYPE))
        g_ptr = tl.load(grad_addr_ptr + t).to(tl.pointer_type(G_DTYPE))
        # 16-byte alignment stated on the pointers themselves (checked on the host) lets the compiler issue vector
        # accesses; stated on the integer before the cast it never reached the loads (no vector loads in the
        # PTX). Gradients may be views at any offset into a flat buffer (FSDP2's reduce-scatter output): those
        # steps run without the hint on them.
        if ALIGNED_STATES:
            p_ptr = tl.multiple_of(p_ptr, 16)
            m_ptr = tl.multiple_of(m_ptr, 16)
            v_ptr = tl.multiple_of(v_ptr, 16)
        if ALIGNED_GRADS:
            g_ptr = tl.multiple_of(g_ptr, 16)
        step_ptr = tl.load(row + 3).to(tl.pointer_type(tl.float32))
        n = tl.load(numel_ptr + t)
        if GATED:
            # A gate of 0 (the guard will reject this step): every access masked off, nothing written. As a mask,
            # not an early return: a 0-gate step is rare, and this keeps the kernel's one code path.
            n = tl.where(tl.load(gate_ptr) != 0.0, n, 0)

        step = tl.load(step_ptr) + 1.0
        bias1 = 1.0 - tl.exp2(step * tl.log2(beta1))
        bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * tl.log2(beta2)))
        coef = 1.0
        if CLIP:
            coef = tl.minimum(max_norm / (tl.load(norm_ptr).to(tl.float32) + 1e-6), 1.0)

        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            # Whole chunks without a mask: a mask against a numel of unknown divisibility stops the compiler from
            # vectorizing the accesses (the first GPU run of this kernel, masked everywhere, moved bf16 at half
            # the bandwidth of torch's fused AdamW).
            p, m, v = _adamw_update(tl.load(p_ptr + offs).to(tl.float32), tl.load(g_ptr + offs).to(tl.float32),
                                    tl.load(m_ptr + offs).to(tl.float32), tl.load(v_ptr + offs).to(tl.float32),
                                    coef, lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt)
            p_stored = p.to(P_DTYPE)
            tl.store(p_ptr + offs, p_stored)
            tl.store(m_ptr + offs, m.to(S_DTYPE))
            tl.store(v_ptr + offs, v.to(S_DTYPE))
            if AMAX:
                tl.store(amax_partial_ptr + chunk, _abs_max(p_stored, 0))
        else:  # the tensor's last, partial chunk
            mask = offs < n
            p, m, v = _adamw_update(tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                                    tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                                    tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                                    tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32),
                                    coef, lr, beta1, beta2, eps, weight_decay, bias1, bias2_sqrt)
            p_stored = p.to(P_DTYPE)
            tl.store(p_ptr + offs, p_stored, mask=mask)
            tl.store(m_ptr + offs, m.to(S_DTYPE), mask=mask)
            tl.store(v_ptr + offs, v.to(S_DTYPE), mask=mask)
            if AMAX:  # (a gated-off step masks every element: its partials are unread, _amax_segments keeps the amax)
                tl.store(amax_partial_ptr + chunk, _abs_max(tl.where(mask, p_stored.to(tl.float32), 0.0), 0))

    @triton.jit
    def _amax_segments_kernel(amax_partial_ptr, first_chunk_ptr, chunk_count_ptr, amax_addr_ptr, gate_ptr,
                              GATED: tl.constexpr, BLOCK: tl.constexpr):
        # Tensor t's amax = the max of its chunks' partials (its chunks are consecutive; none: an empty FSDP2 shard,
        # amax 0), written where it is kept (address 0: not kept); unchanged on a gated-off step, whose weights did
        # not change either.
        t = tl.program_id(0)
        addr = tl.load(amax_addr_ptr + t)
        first = tl.load(first_chunk_ptr + t)
        count = tl.load(chunk_count_ptr + t)
        active = addr != 0
        if GATED:
            active = active & (tl.load(gate_ptr) != 0.0)
        if active:
            acc = tl.zeros((BLOCK,), dtype=tl.float32)
            for i in range(0, count, BLOCK):
                offs = i + tl.arange(0, BLOCK)
                part = tl.load(amax_partial_ptr + first + offs, mask=offs < count, other=0.0)
                acc = tl.where((part != part) | (part > acc), part, acc)  # noqa: PLR0124 - NaN wins, as in torch.amax
            tl.store(addr.to(tl.pointer_type(tl.float32)), _abs_max(acc, 0))

    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
else:
    _TL_DTYPES = {}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2 parameters, their gradients and AdamW states), else the tensor itself.
    `_local_tensor` instead of to_local(): to_local() is an autograd call, costly in host time for hundreds of tensors.
    A weight FSDP2 all-gathers in fp8 (fp8.fsdp_allgather.Fp8AllGatherWeight) is a wrapper without storage of its own:
    its plain master tensor, which the kernel updates in place."""
    local = getattr(t, "_local_tensor", t)
    return getattr(local, "fp8_all_gather_master", local)


@dataclass
class _Bucket:
    """The tensors of one parameter group that share (param, grad, state) dtypes, and their device tables."""
    params: list[torch.Tensor]
    addr: torch.Tensor  # int64 [T, 4] on the device: param, exp_avg, exp_avg_sq, step
    numel: torch.Tensor  # int64 [T]
    numels: list[int]  # the same on the host
    chunk_tensor: torch.Tensor  # int32 [C]
    chunk_index: torch.Tensor  # int32 [C]
    steps: list[torch.Tensor]
    grad_addr: torch.Tensor  # int64 [T] on the device
    grad_addr_host: list[int]
    staging: torch.Tensor  # int64 [T], pinned on CUDA: the host side of grad_addr's copies
    copied: torch.cuda.Event | None  # recorded after the last copy out of `staging`
    dtypes: tuple
    # The weights whose amax the step keeps (keep_weight_amax), None when none of the bucket's: per tensor the address
    # of its 0-d float32 amax (0: not kept), its first chunk and chunk count; one float32 partial per chunk.
    amax_addr: torch.Tensor | None = None  # int64 [T]
    first_chunk: torch.Tensor | None = None  # int32 [T]
    chunk_count: torch.Tensor | None = None  # int32 [T]
    amax_partial: torch.Tensor | None = None  # float32 [C]


class ChunkedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose step runs as one Triton launch per dtype bucket (see the module docstring).

    `clip_and_step(grad_norm, max_norm)` is clip_grads_with_norm_(params, max_norm, grad_norm) followed by step(),
    with the scaling done inside the launch."""

    def __init__(self, params, *args, **kwargs) -> None:
        super().__init__(params, *args, **kwargs)
        # id(param group) -> (ids and addresses of its params with gradients, its buckets or None: torch's step)
        self._buckets: dict[int, tuple[tuple, list[_Bucket] | None]] = {}
        self._clip: tuple[torch.Tensor, float] | None = None
        self.kernel_steps = 0  # kernel launches, a gated-off step's included (tests and benchmarks read it)
        self.last_compiled = None  # the last launch's compiled kernel (benchmarks/adamw.py reads its PTX)
        # id(param) -> the module whose `weight_amax` buffer the step writes (keep_weight_amax)
        self._amax_holders: dict[int, torch.nn.Module] = {}

    def keep_weight_amax(self, holders: list[torch.nn.Module]) -> None:
        """Write max |weight| of each holder's `weight` (of its local shard under FSDP2) into its 0-d float32 buffer
        `weight_amax` at every kernel step, from the values the step stores (fp8.weight_amax: the tensorwise FP8 layers
        then skip their weight's amax pass). Steps that go through torch's AdamW do not: fp8.weight_amax sees their
        writes in the weights' version counters and reduces again. The buffer is looked up at every step, so a module
        given a new buffer is followed."""
        self._amax_holders = {id(m.weight): m for m in holders}
        self._buckets.clear()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._buckets.clear()  # new state tensors: new addresses

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        if hasattr(self, "_buckets"):
            self._buckets.clear()

    def clip_and_step(self, grad_norm: torch.Tensor, max_norm: float, gate: torch.Tensor | None = None) -> bool:
        """gate: a 0-d device tensor; the update (step counts included) takes effect only where it is 1. Only the
        kernel can take a gated step: returns False, having done nothing, if this step would go through torch's
        AdamW (the caller then steps after reading its decision). Returns True when the step was launched."""
        self._clip = (grad_norm, float(max_norm))
        try:
            if gate is None:
                self.step()
                return True
            return self._kernel_step(gate)
        finally:
            self._clip = None

    @torch.no_grad()
    def _kernel_step(self, gate: torch.Tensor | None) -> bool:
        launches = self._plan_kernel_step()
        if launches is None:
            return False
        for group, bucket, grad_addrs, grads_aligned in launches:
            device = bucket.addr.device
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                self._launch(bucket, group, grad_addrs, grads_aligned, gate)
        self.kernel_steps += 1  # launches: a step gated off counts too
        return True

    @torch.no_grad()
    def step(self, closure=None):
        if closure is None and self._kernel_step(None):
            return None
        if self._clip is not None:
            grad_norm, max_norm = self._clip
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, grad_norm)
        return super().step(closure)

    # -- which steps the kernel takes --------------------------------------------------------------------------
    # Host time matters here: the step starts right after the guard's host read, with the GPU idle until the first
    # launch. Parameters and states are checked once per set of parameter addresses (a bucket build); each step
    # checks only the gradients (dtype, size, layout, alignment).
    def _plan_kernel_step(self) -> list | None:
        """(group, bucket, gradient addresses, all aligned) for every launch of this step, or None: torch's step runs."""
        launches = []
        for group in self.param_groups:
            if not self._group_supported(group):  # settings can change between steps (a tensor lr, amsgrad)
                return None
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            buckets = self._buckets_for(group, params)
            if buckets is None:
                return None
            for bucket in buckets:
                grads = self._gradient_addresses(bucket)
                if grads is None:
                    return None
                launches.append((group, bucket, *grads))
        return launches

    @staticmethod
    def _group_supported(group: dict) -> bool:
        beta1, beta2 = group["betas"]
        return (HAS_TRITON and not group["amsgrad"] and not group["maximize"] and not group["capturable"]
                and not group["differentiable"] and not torch.is_tensor(group["lr"])
                and not torch.is_tensor(beta1) and not torch.is_tensor(beta2) and 0.0 < beta1 < 1.0
                and 0.0 < beta2 < 1.0)

    @staticmethod
    def _params_supported(params: list[torch.Tensor]) -> bool:
        for p in params:
            lp = _local(p)
            # A wrapper tensor subclass (torchao's FP8 expert weights, say) has no storage of its own at data_ptr():
            # the kernel would read and write through a bogus address (an illegal memory access on a GPU).
            if type(lp) not in (torch.Tensor, torch.nn.Parameter):
                return False
            on_device = lp.is_cuda and torch.version.hip is None
            if not (on_device or (interpreting() and lp.device.type == "cpu")):
                return False
            if lp.dtype not in _TL_DTYPES or not lp.is_contiguous() or lp.data_ptr() % 16:
                return False
        return True

    def _states_supported(self, params: list[torch.Tensor]) -> bool:
        """exp_avg and exp_avg_sq shaped like their parameter, contiguous, 16-byte aligned (as torch creates them; a
        state dict loaded from elsewhere might not be). The step count is on the device already (_init_states)."""
        for p in params:
            state, lp = self.state[p], _local(p)
            for name in ("exp_avg", "exp_avg_sq"):
                t = _local(state[name])
                if t.shape != lp.shape or not t.is_contiguous() or t.data_ptr() % 16 or t.device != lp.device:
                    return False
        return True

    @staticmethod
    def _gradient_addresses(bucket: _Bucket) -> tuple[list[int], bool] | None:
        """The bucket's gradients' addresses and whether all are 16-byte aligned, or None where one does not fit the
        kernel (dtype, size, layout): a sparse gradient, a strided view."""
        grad_dtype = bucket.dtypes[1]
        grads = [_local(p.grad) for p in bucket.params]
        for g, n in zip(grads, bucket.numels):
            if type(g) is not torch.Tensor or g.dtype is not grad_dtype or g.layout is not torch.strided or g.numel() != n or not g.is_contiguous():
                return None
        addrs = list(map(torch.Tensor.data_ptr, grads))
        return addrs, not any(a % 16 for a in addrs)

    # -- the step ----------------------------------------------------------------------------------------------
    def _launch(self, bucket: _Bucket, group: dict, grad_addrs: list[int], grads_aligned: bool,
                gate: torch.Tensor | None) -> None:
        """Send the gradients' addresses if they moved, run the kernel, count the step (on the current stream); a
        0-d `gate` tensor: all of it only where the gate is 1."""
        beta1, beta2 = group["betas"]
        self._send_grad_addresses(bucket, grad_addrs)
        # The step counts advance by the gate (0 or 1), added on the device as a list of tensors: _foreach_add_ with
        # one 0-d CUDA tensor as its scalar synchronises the host (train_step.py --sync-probe: the GPU then drained
        # before the next step was launched).
        step_increment = 1.0 if gate is None else [gate.detach().reshape(()).to(torch.float32)] * len(bucket.steps)
        if bucket.chunk_tensor.numel() == 0:  # only empty parameters: nothing to update but the step counts
            torch._foreach_add_(bucket.steps, step_increment)
            return
        p_dtype, g_dtype, s_dtype, _ = bucket.dtypes
        if self._clip is not None:
            norm, max_norm = self._clip[0].detach().reshape(1).float(), self._clip[1]
        else:
            norm, max_norm = bucket.numel, 0.0  # unread (CLIP=False)
        gate_arg = bucket.numel if gate is None else gate.detach().reshape(1)  # (unread when not GATED)
        amax = bucket.amax_addr is not None
        self.last_compiled = _adamw_chunks_kernel[(bucket.chunk_tensor.numel(),)](
            bucket.addr, bucket.grad_addr, bucket.numel, bucket.chunk_tensor, bucket.chunk_index, norm, gate_arg,
            bucket.amax_partial if amax else bucket.numel,  # (unwritten when not AMAX)
            float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
            float(max_norm), P_DTYPE=_TL_DTYPES[p_dtype], G_DTYPE=_TL_DTYPES[g_dtype], S_DTYPE=_TL_DTYPES[s_dtype],
            CLIP=self._clip is not None, GATED=gate is not None, AMAX=amax, BLOCK=BLOCK, ALIGNED_STATES=HINT_POINTERS,
            ALIGNED_GRADS=HINT_POINTERS and grads_aligned, num_warps=NUM_WARPS)
        if amax:
            _amax_segments_kernel[(len(bucket.params),)](
                bucket.amax_partial, bucket.first_chunk, bucket.chunk_count, bucket.amax_addr, gate_arg,
                GATED=gate is not None, BLOCK=AMAX_SEGMENT_BLOCK, num_warps=AMAX_SEGMENT_WARPS)
        torch._foreach_add_(bucket.steps, step_increment)

    def _init_states(self, group: dict, params: list[torch.Tensor]) -> None:
        """Torch's own lazy state initialisation (so the state dict is torch's), for parameters without state; a step
        count restored on the CPU (a checkpoint of an unfused run) moves to the parameter's device as float32."""
        if any(len(self.state[p]) == 0 for p in params):
            self._init_group(group, [], [], [], [], [], [])
        for p in params:
            state = self.state[p]
            step = state["step"]
            if step.device != _local(p).device or step.dtype != torch.float32:
                state["step"] = step.to(device=_local(p).device, dtype=torch.float32)

    def _buckets_for(self, group: dict, params: list[torch.Tensor]) -> list[_Bucket] | None:
        """The group's buckets for these parameters (None: the kernel cannot step them), rebuilt when the set of
        parameters with gradients or a parameter's address changes; states change only through load_state_dict,
        which forgets the buckets."""
        # The amax buffers' addresses: a holder given a new buffer rebuilds the bucket (checked once per holder, not per
        # parameter: this runs every step, on the host time before the launch).
        key = (tuple(map(id, params)), tuple(map(torch.Tensor.data_ptr, map(_local, params))),
               tuple(m.weight_amax.data_ptr() for m in self._amax_holders.values()))
        cached = self._buckets.get(id(group))
        if cached is not None and cached[0] == key:
            return cached[1]
        buckets = None
        if self._params_supported(params):
            self._init_states(group, params)
            by_dtypes: dict[tuple, list[torch.Tensor]] = {}
            for p in params:
                state = self.state[p]
                dtypes = (_local(p).dtype, _local(p.grad).dtype, _local(state["exp_avg"]).dtype,
                          _local(state["exp_avg_sq"]).dtype)
                by_dtypes.setdefault(dtypes, []).append(p)
            if (all(d[1] in _TL_DTYPES and d[2] in _TL_DTYPES and d[2] == d[3] for d in by_dtypes)
                    and self._states_supported(params)):
                buckets = [self._make_bucket(ps, dtypes) for dtypes, ps in by_dtypes.items()]
        self._buckets[id(group)] = (key, buckets)
        return buckets

    def _amax_address(self, p: torch.Tensor) -> int:
        """The address the step writes the amax of p's local tensor (the whole weight, or this rank's FSDP2 shard) to:
        its holder's `weight_amax` where that is a 0-d float32 buffer on that tensor's device, else 0 (not kept)."""
        holder = self._amax_holders.get(id(p))
        lp = _local(p)
        if holder is None or type(lp) not in (torch.Tensor, torch.nn.Parameter):
            return 0
        buf = holder.weight_amax
        ok = buf.dtype == torch.float32 and buf.numel() == 1 and buf.device == lp.device and buf.data_ptr() % 4 == 0
        return buf.data_ptr() if ok else 0

    def _make_bucket(self, params: list[torch.Tensor], dtypes: tuple) -> _Bucket:
        device = _local(params[0]).device
        rows, numels, chunk_tensor, chunk_index, steps, first_chunk, chunk_count = [], [], [], [], [], [], []
        for i, p in enumerate(params):
            state = self.state[p]
            lp, m, v = _local(p), _local(state["exp_avg"]), _local(state["exp_avg_sq"])
            rows.append([lp.data_ptr(), m.data_ptr(), v.data_ptr(), state["step"].data_ptr()])
            numels.append(lp.numel())
            chunks = -(-lp.numel() // BLOCK)
            first_chunk.append(len(chunk_tensor))
            chunk_count.append(chunks)
            chunk_tensor += [i] * chunks
            chunk_index += range(chunks)
            steps.append(state["step"])
        pinned = device.type == "cuda"
        amax_addr = [self._amax_address(p) for p in params]
        kept = any(amax_addr)
        return _Bucket(
            params=params, addr=torch.tensor(rows, dtype=torch.int64).to(device),
            numel=torch.tensor(numels, dtype=torch.int64).to(device), numels=numels,
            chunk_tensor=torch.tensor(chunk_tensor, dtype=torch.int32).to(device),
            chunk_index=torch.tensor(chunk_index, dtype=torch.int32).to(device), steps=steps,
            grad_addr=torch.zeros(len(params), dtype=torch.int64, device=device), grad_addr_host=[],
            staging=torch.zeros(len(params), dtype=torch.int64, pin_memory=pinned), copied=None, dtypes=dtypes,
            amax_addr=torch.tensor(amax_addr, dtype=torch.int64).to(device) if kept else None,
            first_chunk=torch.tensor(first_chunk, dtype=torch.int32).to(device) if kept else None,
            chunk_count=torch.tensor(chunk_count, dtype=torch.int32).to(device) if kept else None,
            amax_partial=torch.empty(len(chunk_tensor), dtype=torch.float32, device=device) if kept else None)

    @staticmethod
    def _send_grad_addresses(bucket: _Bucket, addrs: list[int]) -> None:
        """Copy the gradients' addresses to the device when they changed since the last step (asynchronously: the
        staging buffer is pinned, and reused only after its previous copy finished)."""
        if addrs == bucket.grad_addr_host:
            return
        if bucket.copied is not None:
            bucket.copied.synchronize()
        bucket.staging.copy_(torch.tensor(addrs, dtype=torch.int64))
        bucket.grad_addr.copy_(bucket.staging, non_blocking=True)
        if bucket.grad_addr.is_cuda:
            bucket.copied = torch.cuda.Event()
            bucket.copied.record()
        bucket.grad_addr_host = addrs


def clip_and_step(optimizer: torch.optim.Optimizer, params, grad_norm: torch.Tensor, max_norm: float,
                  gate: torch.Tensor | None = None) -> bool:
    """Scale the gradients by min(1, max_norm / (grad_norm + 1e-6)) and step: inside ChunkedAdamW's launch, or as
    clip_grads_with_norm_ then step() for any other optimizer (the worker's and train_step.py's one path).
    gate (0-d device tensor): a step that takes effect only where it is 1, which only ChunkedAdamW's kernel can
    take; returns False (nothing done) where it cannot, True when the step was launched."""
    if isinstance(optimizer, ChunkedAdamW):
        return optimizer.clip_and_step(grad_norm, max_norm, gate)
    if gate is not None:
        return False
    # One multi-tensor scaling per device mesh: a DTensor op refuses operands on different meshes (FSDP's and the
    # expert-parallel experts'), and torch's clip passes all gradients of a device to one foreach call.
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, grad_norm)
    optimizer.step()
    return True
