"""The model a worker trains: built on meta, converted to FP8, sharded by FSDP2, materialized and compiled, with the
checks that refuse a model/precision combination which would fail or silently run slower than asked."""

from __future__ import annotations

import copy
import logging

import torch

from fp8.linear import Float8Linear
from orchestration.config import JobConfig
from orchestration.data.byte_stream import VOCAB_SIZE as BYTE_VOCAB_SIZE
from orchestration.training.compile import compile_blocks, compile_enabled
from orchestration.training.distributed import (
    broadcast_from_rank0_if_unsharded,
    init_weights_by_unit,
    parallelize,
    resolve_shard_group_size,
)
from orchestration.training.elastic import ParallelLayout, plan_layout

logger = logging.getLogger(__name__)


def build_training_model(job: JobConfig, world_size: int, device: torch.device,
                         data_vocab_size: int = BYTE_VOCAB_SIZE, keep_bf16: frozenset[str] = frozenset()):
    """Model -> FP8 conversion -> FSDP2 -> materialize. Returns (model, fp8_recipe or None).

    keep_bf16: layers (by name) left in bf16 although FP8 could convert them (fp8_kept_in_bf16: too small to pay)."""
    from models.registry import build_model

    # Built on meta, converted and sharded there, then materialized and initialised on the device one unit at a
    # time (init_weights_by_unit): no full copy on the host (a 70B model is 280 GB in fp32, and initialising even a
    # few 8B-width layers on one CPU thread is slow), the same weights at every world size.
    model = build_model(job.model.name, device="meta", overrides=dict(job.model.overrides))
    require_vocab_covers_data(model, job.model.name, data_vocab_size)
    recipe = None
    if job.precision.name == "fp8":
        import fp8

        recipe = job.precision.recipe if job.precision.recipe != "auto" else fp8.recommended_recipe(device)
        module_filter = fp8.convert.make_module_filter(output_head=job.precision.fp8_output_head,
                                                       experts=job.precision.fp8_experts)
        if keep_bf16:
            eligible = module_filter

            def module_filter(name: str, module: torch.nn.Module) -> bool:
                return eligible(name, module) and name not in keep_bf16

        fp8.convert_to_fp8(model, recipe, module_filter=module_filter)
        if not fp8.precision_state(model)["modules"]:
            # An "fp8" run with nothing in fp8 would fail later, at the first shadow check or RetryFP8.
            raise ValueError(
                f"precision=fp8 converts no layer of model {job.model.name}: none of its linears has both sizes a "
                "multiple of 16 and no MoE experts run in FP8 (precision.fp8_experts); use precision=bf16")
        if job.precision.fp8_output_head:
            require_fp8_output_head(model, job.model.name)
        require_fp8_grouped_gemm(model, fp8.get_backend(device))
    template = copy.deepcopy(model)  # on meta: no memory
    layout = layout_for(job, world_size)
    model = parallelize(model, world_size, layout.sharding if world_size > 1 else job.train.sharding,
                        job.precision.fsdp_param_dtype, job.precision.fsdp_reduce_dtype,
                        job.model.activation_checkpointing, fp8_all_gather=fp8_all_gather_enabled(job, recipe),
                        shard_group_size=layout.shard_group_size, expert_parallel=layout.expert_parallel,
                        fp8_dispatch=job.train.expert_dispatch_fp8)
    model.parallel_layout = layout  # what this (re)start runs, for the worker's events and logs
    if world_size > 1:
        logger.info("parallel layout at world size %d: %s%s", world_size, layout.describe(),
                    "".join(f"; {note}" for note in layout.notes))
    init_weights_by_unit(model, template, job.train.seed, device)
    broadcast_from_rank0_if_unsharded(model, world_size, job.train.sharding)
    if job.precision.weight_copies:
        from fp8.weight_copies import attach_weight_copies

        # After the weights exist and before compile traces the layers that read the copies.
        attach_weight_copies(model, getattr(torch, job.precision.compute_dtype))
    if device.type == "cuda":
        # gpu_mem_peak_gib reports the training's peak, not the transient full-size unit of the initialisation
        torch.cuda.reset_peak_memory_stats(device)
    if compile_enabled(job, device):
        compile_blocks(model, job.model.compile_mode)
    return model, recipe


def import_hf_weights(model: torch.nn.Module, job: JobConfig) -> dict:
    """Replace the model's initial weights by those of the Hugging Face checkpoint model.init_from (checked against
    the model when the config was loaded), each rank reading the rows it holds. Returns the weights_imported event's
    fields: the source's path and digests, tensors, bytes read on this rank, seconds."""
    from models.registry import resolve_flavor
    from orchestration.interop.import_hf import import_weights

    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    return import_weights(model, job.model.init_from, flavor.family, flavor.args)


def fp8_kept_in_bf16(job: JobConfig, on_gpu: bool) -> tuple[dict[str, str], int]:
    """Which layers FP8 would convert but stay in bf16 because their GEMMs are too small to pay at the job's
    micro-batch x seq_len tokens (fp8.size_rule), by name with their sizes; and how many layers FP8 could convert.
    Only on GPUs (on CPU FP8 is emulated for correctness, not speed: everything eligible converts). The configured
    micro-batch, not a world size's, decides: the same layers run FP8 at every world size of an elastic run."""
    import fp8
    from models.registry import build_model

    if job.precision.name != "fp8":
        return {}, 0
    model = build_model(job.model.name, device="meta", overrides=dict(job.model.overrides))
    module_filter = fp8.convert.make_module_filter(output_head=job.precision.fp8_output_head,
                                                   experts=job.precision.fp8_experts)
    eligible = sum(1 for name, m in model.named_modules() if name and module_filter(name, m)
                   and (type(m) is torch.nn.Linear or fp8.convert.is_grouped_experts(m)))
    if not on_gpu:
        return {}, eligible
    return fp8_too_small(model, module_filter, job.train.micro_batch_size * job.data.seq_len), eligible


def planned_weight_copy_bytes(job: JobConfig, keep_bf16: frozenset[str] | set[str] = frozenset()) -> int:
    """Bytes per worker of the weights' compute copies (fp8.weight_copies) of an unsharded run of this job: the
    model converted as build_training_model converts it (keep_bf16: fp8_kept_in_bf16's layers), on meta."""
    import fp8
    from fp8.weight_copies import copy_bytes
    from models.registry import build_model

    if not job.precision.weight_copies:
        return 0
    model = build_model(job.model.name, device="meta", overrides=dict(job.model.overrides))
    if job.precision.name == "fp8":
        eligible = fp8.convert.make_module_filter(output_head=job.precision.fp8_output_head,
                                                  experts=job.precision.fp8_experts)
        # The recipe only sizes the scales here (rowwise: a vector, tensorwise: one value): auto counts rowwise's.
        recipe = "rowwise" if job.precision.recipe == "auto" else job.precision.recipe
        fp8.convert_to_fp8(model, recipe, module_filter=lambda name, m: eligible(name, m) and name not in keep_bf16)
    return copy_bytes(model, getattr(torch, job.precision.compute_dtype))


def fp8_too_small(model: torch.nn.Module, module_filter, tokens_per_forward: int) -> dict[str, str]:
    """The layers `module_filter` would convert whose GEMMs are too small at tokens_per_forward for FP8 to pay
    (fp8.size_rule), by name, each with its size: they stay in bf16."""
    from fp8.convert import is_grouped_experts
    from fp8.size_rule import expert_group_pays, linear_pays

    small = {}
    for name, module in model.named_modules():
        if not name or not module_filter(name, module):
            continue
        if type(module) is torch.nn.Linear:
            if not linear_pays(tokens_per_forward, module.in_features, module.out_features):
                small[name] = f"linear {module.in_features}->{module.out_features}"
        elif is_grouped_experts(module):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            args = parent.args  # the MoE layer's: routing (top-k of E) and the expert sizes
            if not expert_group_pays(tokens_per_forward, args.n_activated_experts, args.n_routed_experts, args.dim,
                                     args.moe_inter_dim):
                small[name] = (f"experts {args.n_routed_experts} x {args.dim}->{args.moe_inter_dim}, "
                               f"top-{args.n_activated_experts}")
    return small


def require_vocab_covers_data(model: torch.nn.Module, model_name: str, data_vocab_size: int) -> None:
    """The data's token ids (0..data_vocab_size-1: bytes, or a prepared corpus's tokenizer) must be rows of the model's
    vocabulary: a smaller vocabulary would fail at the first step (an index error in the embedding or the loss; on a
    GPU the fused FP8 head's loss kernel does not check targets). The config check refuses it before Ray starts
    (orchestration.data.select.fit_model_vocab); this one covers a worker started without it (torchrun, tests)."""
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if vocab is not None and vocab < data_vocab_size:
        raise ValueError(f"model {model_name} has vocab_size={vocab}, below the {data_vocab_size} token ids of the "
                         f"data; set model.overrides.vocab_size to at least {data_vocab_size}")


def require_fp8_output_head(model: torch.nn.Module, model_name: str) -> None:
    """precision.fp8_output_head=true must convert the head; a head left in bf16 would pass for an FP8 one silently
    (the speed and the risk the user opted into would both be missing from the run)."""
    import fp8

    heads = fp8.convert.output_heads(model)
    if not heads:
        raise ValueError(f"precision.fp8_output_head=true but model {model_name} has no output head named 'output' "
                         "or 'lm_head'; set precision.fp8_output_head=false")
    for name, head in heads:
        if not isinstance(head, Float8Linear):
            padded_vocab = -(-head.out_features // 16) * 16
            raise ValueError(  # noqa: TRY004 - a config value to change, not a wrong Python type
                f"precision.fp8_output_head=true but model {model_name}'s head {name} ({head.in_features} -> "
                f"{head.out_features}) cannot run in FP8: FP8 GEMMs need both sizes to be multiples of 16; pad the "
                f"vocabulary (model.overrides.vocab_size={padded_vocab}) or the width, or set "
                "precision.fp8_output_head=false")


def require_fp8_grouped_gemm(model: torch.nn.Module, backend) -> None:
    """FP8 experts on a GPU without torch._scaled_grouped_mm would run the emulated path: float32 grouped GEMMs,
    slower than bf16 and far more memory. Refuse, naming the settings that keep the run FP8 elsewhere. (The CPU
    emulates by design: correctness runs.)"""
    import fp8

    if backend.kind == "cpu" or backend.has_scaled_grouped_mm:
        return
    experts = [name for name, module in model.named_modules() if fp8.convert.is_fp8_grouped(module)]
    if not experts:
        return
    where = ("gfx942 or gfx950 with a torch ROCm build that includes MSLK / FBGEMM GenAI" if backend.kind == "rocm"
             else "sm90 (H100/H200)")
    raise ValueError(
        f"this GPU ({backend.kind} {backend.arch}) has no FP8 grouped GEMM in this torch build (torch."
        f"_scaled_grouped_mm needs {where}), so the MoE experts ({experts[0]}, ...) cannot run in FP8: set "
        "precision.fp8_experts=false (experts in bf16, the other layers in FP8) or precision=bf16")


def fp8_all_gather_enabled(job: JobConfig, recipe: str | None) -> bool:
    """precision.fp8_all_gather, where null means: on for the tensorwise recipe (the only one whose weights have one
    scale, so the gathered fp8 bytes are the GEMM's operand). parallelize ignores it unless FSDP2 shards."""
    if job.precision.fp8_all_gather is not None:
        return job.precision.fp8_all_gather
    return recipe == "tensorwise"


def layout_for(job: JobConfig, world_size: int) -> ParallelLayout:
    """The parallel layout this world size runs (orchestration.training.elastic.plan_layout): at every (re)start, so a
    resize keeps expert parallelism and HSDP's shard groups dividing the world size."""
    from models.registry import resolve_flavor

    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    experts = getattr(flavor.args, "n_routed_experts", 0)
    configured_group = job.train.shard_group_size
    if job.train.sharding == "hsdp" and configured_group is None:
        configured_group = resolve_shard_group_size(None, world_size)
    return plan_layout(world_size, job.train.sharding, configured_group, job.train.expert_parallel, experts)
