"""The model a worker trains: built on meta, converted to FP8, sharded by FSDP2, materialized and compiled, with the
checks that refuse a model/precision combination which would fail or silently run slower than asked."""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from fp8.convert import TrainingConversion
from orchestration.config import JobConfig
from orchestration.data.byte_stream import VOCAB_SIZE as BYTE_VOCAB_SIZE
from orchestration.training.compile import compile_if_enabled
from orchestration.training.distributed import shard_and_materialize
from orchestration.training.elastic import layout_for


class TrainingModel(NamedTuple):
    """A worker's model, ready to train: the module (sharded and materialized), its FP8 recipe (None: bf16), what the
    FP8 conversion did (None: bf16), and whether its blocks are compiled."""

    model: torch.nn.Module
    recipe: str | None
    fp8_layers: TrainingConversion | None
    compiled: bool


def build_training_model(job: JobConfig, world_size: int, device: torch.device,
                         data_vocab_size: int = BYTE_VOCAB_SIZE, size_rule: bool | None = None) -> TrainingModel:
    """Model -> FP8 conversion -> parallel layout (FSDP2 / HSDP / expert parallelism) -> materialize -> compile.

    size_rule: leave the layers too small for FP8 to pay in bf16 (fp8.convert.layers_too_small); None: on GPUs only
    (on CPU FP8 is emulated for correctness, not speed). The configured micro-batch decides, not a world size's: the
    same layers run FP8 at every world size of an elastic run."""
    import fp8
    from models.registry import build_model

    # Built on meta, converted and sharded there, then materialized and initialised on the device one unit at a
    # time (init_weights_by_unit): no full copy on the host (a 70B model is 280 GB in fp32, and initialising even a
    # few 8B-width layers on one CPU thread is slow), the same weights at every world size.
    model = build_model(job.model.name, device="meta", overrides=dict(job.model.overrides),
                        min_vocab_size=data_vocab_size)
    p = job.precision
    recipe, conversion = None, None
    if p.name == "fp8":
        recipe = p.recipe if p.recipe != "auto" else fp8.recommended_recipe(device)
        apply_size_rule = device.type == "cuda" if size_rule is None else size_rule
        conversion = fp8.convert.convert_for_training(
            model, job.model.name, recipe, fp8.get_backend(device), output_head=p.fp8_output_head,
            experts=p.fp8_experts, tokens_per_forward=job.train.micro_batch_size * job.data.seq_len
            if apply_size_rule else None)
    fp8_all_gather = fp8_all_gather_on(job, recipe)
    template = copy.deepcopy(model)  # on meta: no memory
    layout = layout_for(job, world_size, getattr(model.args, "n_routed_experts", 0))
    model = shard_and_materialize(model, template, layout, job.train.seed, device, p.fsdp_param_dtype,
                                  p.fsdp_reduce_dtype, job.model.activation_checkpointing, fp8_all_gather,
                                  job.train.expert_dispatch_fp8)
    compiled = compile_if_enabled(model, job, device)
    return TrainingModel(model, recipe, conversion, compiled)


def import_hf_weights(model: torch.nn.Module, job: JobConfig) -> dict:
    """Replace the model's initial weights by those of the Hugging Face checkpoint model.init_from (checked against
    the model when the config was loaded), each rank reading the rows it holds. Returns the weights_imported event's
    fields: the source's path and digests, tensors, bytes read on this rank, seconds."""
    from models.registry import resolve_flavor
    from orchestration.interop.import_hf import import_weights

    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    return import_weights(model, job.model.init_from, flavor.family, flavor.args)


def planned_recipe(job: JobConfig) -> str:
    """The recipe precision=fp8 trains with, known before any worker starts: precision.recipe, or for auto the one
    fp8.recommended_recipe gives the job's GPUs (rowwise_gw_hp on AMD: cluster.device rocm or an MI fabric preset;
    tensorwise elsewhere)."""
    from models import scaling

    if job.precision.recipe != "auto":
        return job.precision.recipe
    fabric = scaling.FABRICS.get(job.cluster.fabric)
    amd = job.cluster.device == "rocm" or (fabric is not None and fabric.accelerator.startswith("mi"))
    return "rowwise_gw_hp" if amd else "tensorwise"


def fp8_all_gather_on(job: JobConfig, recipe: str | None) -> bool:
    """Whether FSDP2 is asked to gather the FP8 linears' weights in fp8: precision.fp8_all_gather, or where it is null,
    on for tensorwise, the one recipe whose weights have one scale (the gathered fp8 bytes are then the GEMM's
    operand). Only tensorwise layers are gathered so (fp8.fsdp_allgather), whatever is asked."""
    p = job.precision
    return p.fp8_all_gather if p.fp8_all_gather is not None else recipe == "tensorwise"


def fp8_weight_copy_layers(job: JobConfig, world_size: int, converted: tuple[str, ...], model) -> tuple[str, ...]:
    """Which of the converted FP8 layers keep an fp8 copy of their weight from forward to backward at this world size
    (models.planning counts 1 byte a weight for each), as shard_and_materialize sets them up:
    - a linear keeps its fp8 weight unless FSDP2 gathers it in fp8 (precision.fp8_all_gather, tensorwise; never the
      head): the saved fp8 weight is then FSDP2's own gather buffer, freed after the forward and gathered again for
      the backward;
    - routed experts keep their fp8 weight where it reaches the GEMM wider than the tokens (fp8.grouped): stored in
      float32 where FSDP2 does not gather them (one worker, replicas, expert parallelism), else in the dtype FSDP2
      gathers them in (precision.fsdp_param_dtype); in the tokens' dtype they keep the weight itself."""
    from torch import nn

    from fp8.convert import is_output_head

    p = job.precision
    layout = layout_for(job, world_size, getattr(model.args, "n_routed_experts", 0))
    sharded = layout.world_size > 1 and layout.sharding != "none"
    recipe = planned_recipe(job)
    fp8_gathered = sharded and recipe == "tensorwise" and fp8_all_gather_on(job, recipe)
    experts_dtype = p.fsdp_gather_dtype() if sharded and layout.expert_parallel == 1 else "float32"
    keep = []
    for name in converted:
        module = model.get_submodule(name)
        if isinstance(module, nn.Linear):
            if not (fp8_gathered and not is_output_head(name, module)):
                keep.append(name)
        elif experts_dtype != p.compute_dtype:
            keep.append(name)
    return tuple(keep)


def plan_worker_memory(job: JobConfig, world_size: int, micro_batch: int, flavor, model, converted: tuple[str, ...]):
    """One worker's memory plan (models.planning.ModelPlan) at this world size and micro-batch, in the layout the
    workers run it (layout_for): FSDP over the world, HSDP's shard groups (a node's GPUs: cluster.fabric's, else the
    world as on one node) or full replicas; float32 master weights, whatever FSDP2 gathers them in; with the fp8
    weight copies the converted layers keep (fp8_weight_copy_layers)."""
    from models import scaling
    from models.planning import plan_model

    fabric = scaling.FABRICS.get(job.cluster.fabric)
    layout = layout_for(job, world_size, getattr(model.args, "n_routed_experts", 0),
                        gpus_per_node=fabric.gpus_per_node if fabric is not None else None)
    return plan_model(flavor, world_size=world_size, seq_len=job.data.seq_len, micro_batch=micro_batch,
                      sharding={"fsdp": "fsdp", "hsdp": "hsdp", "none": "replicate"}[layout.sharding],
                      shard_degree=layout.shard_group_size,
                      activation_checkpointing=job.model.activation_checkpointing, param_dtype_bytes=4, model=model,
                      fp8_weight_copy_layers=fp8_weight_copy_layers(job, world_size, converted, model))


class Fp8Plan(NamedTuple):
    """What build_training_model will do with a job's layers, known before Ray (the plan reads it): the layers FP8
    would convert but keeps in bf16 (too small to pay: fp8.convert.layers_too_small), by name with their sizes; how
    many layers FP8 could convert; the names of those it converts (the memory plan counts their fp8 weight copies)."""

    kept_bf16: dict[str, str]
    eligible: int
    converted: tuple[str, ...]


def plan_fp8(job: JobConfig, on_gpu: bool, micro_batch: int | None = None, model=None) -> Fp8Plan:
    """The conversion build_training_model will make, read off the job's model on meta (the size rule only on
    GPUs). micro_batch: another than the job's (the machine defaults try several); model: its meta build, to reuse."""
    import fp8
    from models.registry import build_model

    p = job.precision
    if p.name != "fp8":
        return Fp8Plan({}, 0, ())
    if model is None:
        model = build_model(job.model.name, device="meta", overrides=dict(job.model.overrides))
    module_filter = fp8.convert.make_module_filter(output_head=p.fp8_output_head, experts=p.fp8_experts)
    tokens = (micro_batch or job.train.micro_batch_size) * job.data.seq_len
    names, kept = fp8.convert.conversion_plan(model, module_filter, tokens if on_gpu else None)
    return Fp8Plan(kept, len(names), tuple(n for n in names if n not in kept))
