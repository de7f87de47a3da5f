"""Model conversion and the run-time precision switch.

convert_to_fp8 swaps nn.Linear -> Float8Linear (sharing the Parameter objects) and, on every module with
a callable `grouped_mm` attribute (MoE experts), swaps that attribute for Fp8GroupedMM, keeping the
original so set_precision can switch back. Neither touches parameters, buffers in the state_dict, or
optimizer state, so the divergence fallback can flip precision mid-run and checkpoints stay compatible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from fp8.backend import Fp8Backend
from fp8.grouped import Fp8GroupedMM
from fp8.head import Float8LMHead
from fp8.linear import Float8Linear
from fp8.recipes import Recipe, get_recipe
from fp8.size_rule import expert_group_pays, linear_pays

PRECISIONS = ("fp8", "bf16")

# Last name components kept in high precision by the default filter: the LM head and MoE routers are
# small, precision-sensitive (logits, routing decisions) and cheap in bf16.
_HP_LEAF_NAMES = frozenset({"output", "lm_head", "head", "gate", "router"})

# Attributes set on converted grouped modules.
_FP8_OP = "_fp8_grouped_op"
_HP_OP = "_fp8_hp_grouped_mm"
_RECIPE_ATTR = "_fp8_recipe_name"


def default_module_filter(name: str, module: nn.Module) -> bool:
    """True if `module` (at dotted `name`) should run in FP8.

    Keeps in high precision: embeddings, the output head, routers/gates, and linears whose in or out
    features are not multiples of 16 (FP8 GEMMs need 16-element alignment).
    """
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _HP_LEAF_NAMES or "embed" in name:
        return False
    if isinstance(module, nn.Embedding):
        return False
    if isinstance(module, nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    if _is_grouped(module):
        # Expert weights [E, in, out]: both GEMM dims must be multiples of 16 as well.
        w3d = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        return all(p.shape[-1] % 16 == 0 and p.shape[-2] % 16 == 0 for p in w3d)
    return True


# Leaf names of LM output heads (the Llama3 and DeepSeek models name theirs "output"; Hugging Face's "lm_head").
_OUTPUT_HEAD_NAMES = frozenset({"output", "lm_head"})


def is_output_head(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in _OUTPUT_HEAD_NAMES


def output_heads(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's LM output heads by name (converted or not): what precision.fp8_output_head is about."""
    return [(name, module) for name, module in model.named_modules() if is_output_head(name, module)]


def make_module_filter(output_head: bool = False, experts: bool = True) -> Callable[[str, nn.Module], bool]:
    """default_module_filter with the two changes the precision config exposes.

    output_head: convert the LM output head too (16-aligned dims). Off by default, as in torchtitan and DeepSeek-V3:
    the head's logits feed the softmax directly. It is the largest single GEMM of a Llama3-8B step (vocab 128256;
    BENCHMARKS.md, "Training step vs bf16 and torchao"), so converting it is the biggest speed lever left once the
    layers are in FP8; take it with the divergence monitors on, which fall the head back to bf16 with
    the rest of the model.
    experts: convert MoE grouped experts (False keeps them in high precision: for devices without an FP8 grouped
    GEMM, where the emulated one would run in float32).
    """

    def keep(name: str, module: nn.Module) -> bool:
        if not experts and _is_grouped(module):
            return False
        if output_head and is_output_head(name, module):
            return module.in_features % 16 == 0 and module.out_features % 16 == 0
        return default_module_filter(name, module)

    return keep


def is_fp8_grouped(module: nn.Module) -> bool:
    """A grouped-experts module that convert_to_fp8 converted (whatever its current precision)."""
    return hasattr(module, _FP8_OP)


def is_grouped_experts(module: nn.Module) -> bool:
    """A module of routed experts with a grouped GEMM (what convert_to_fp8 converts besides linears)."""
    return _is_grouped(module)


def _is_grouped(module: nn.Module) -> bool:
    return callable(getattr(module, "grouped_mm", None)) and not isinstance(module, nn.Linear)


def convert_to_fp8(
    model: nn.Module,
    recipe: str | Recipe = "tensorwise",
    module_filter: Callable[[str, nn.Module], bool] | None = None,
) -> nn.Module:
    """Swap eligible layers of `model` to FP8 in place and return it.

    recipe: "tensorwise" | "rowwise" | "rowwise_gw_hp" (dense linears; MoE experts always use rowwise grouped GEMMs
    with the weight gradient in high precision, see fp8/grouped.py).
    module_filter(name, module) -> bool: which modules to convert; default `default_module_filter`
    (make_module_filter builds the ones the precision config asks for).
    Converting twice is an error (ValueError) so a recipe change cannot half-apply.
    """
    rec = get_recipe(recipe)
    keep = module_filter or default_module_filter
    if any(isinstance(m, Float8Linear) or is_fp8_grouped(m) for m in model.modules()):
        raise ValueError("model is already converted to fp8; build a fresh model to change the recipe")
    swaps: list[tuple[nn.Module, str, nn.Module, type]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and type(module) is nn.Linear and name and keep(name, module):
            parent_name, _, child = name.rpartition(".")
            # The LM head gets the class that can also fuse the loss into its backward (fp8/head.py).
            cls = Float8LMHead if is_output_head(name, module) else Float8Linear
            swaps.append((model.get_submodule(parent_name), child, module, cls))
        elif _is_grouped(module) and keep(name, module):
            setattr(module, _HP_OP, module.grouped_mm)
            setattr(module, _FP8_OP, Fp8GroupedMM())
            setattr(module, _RECIPE_ATTR, rec.name)
            _set_module(module, True)
    for parent, child, module, cls in swaps:
        setattr(parent, child, cls.from_float(module, rec))
    return model


@dataclass(frozen=True)
class TrainingConversion:
    """What convert_for_training did to a model: the recipe, how many layers FP8 could convert, and which of those
    stayed in bf16 because their GEMMs are too small to pay, by name with their sizes."""

    recipe: str
    eligible: int
    kept_bf16: dict[str, str] = field(default_factory=dict)

    @property
    def converted(self) -> int:
        return self.eligible - len(self.kept_bf16)


def convert_for_training(model: nn.Module, model_name: str, recipe: str, backend: Fp8Backend, output_head: bool,
                         experts: bool, tokens_per_forward: int | None) -> TrainingConversion:
    """Convert a training model as the precision config asks, refusing what would fail or silently not run FP8.

    output_head / experts: precision.fp8_output_head / precision.fp8_experts (make_module_filter).
    tokens_per_forward: micro-batch x seq_len, the rows each linear sees; layers whose GEMMs are too small at it
    (layers_too_small) stay in bf16. None: convert every eligible layer (CPU runs emulate FP8 for correctness, not
    speed)."""
    eligible = make_module_filter(output_head=output_head, experts=experts)
    names, kept = conversion_plan(model, eligible, tokens_per_forward)
    count = len(names)
    convert_to_fp8(model, recipe, module_filter=lambda name, m: eligible(name, m) and name not in kept)
    if not any(True for _ in _fp8_modules(model)):
        # An "fp8" run with nothing in fp8 would fail later, at the first shadow check or RetryFP8.
        raise ValueError(
            f"precision=fp8 converts no layer of model {model_name}: none of its linears has both sizes a multiple of "
            "16 and no MoE experts run in FP8 (precision.fp8_experts); use precision=bf16")
    if output_head:
        require_fp8_output_head(model, model_name)
    require_fp8_grouped_gemm(model, backend)
    return TrainingConversion(get_recipe(recipe).name, count, kept)


def conversion_plan(model: nn.Module, eligible: Callable[[str, nn.Module], bool],
                    tokens_per_forward: int | None) -> tuple[list[str], dict[str, str]]:
    """What convert_for_training will do to an unconverted model (the launcher's plan reads it before Ray starts): the
    names of the layers FP8 could convert (`eligible`: make_module_filter's), and those of them too small to pay at
    tokens_per_forward (layers_too_small; None: none kept), by name with their sizes."""
    names = [name for name, m in model.named_modules() if name and eligible(name, m)
             and (type(m) is nn.Linear or _is_grouped(m))]
    return names, layers_too_small(model, eligible, tokens_per_forward) if tokens_per_forward else {}


def layers_too_small(model: nn.Module, module_filter: Callable[[str, nn.Module], bool],
                     tokens_per_forward: int) -> dict[str, str]:
    """The layers `module_filter` would convert whose GEMMs are too small at tokens_per_forward for FP8 to pay
    (fp8.size_rule), by name, each with its size: they stay in bf16."""
    small = {}
    for name, module in model.named_modules():
        if not name or not module_filter(name, module):
            continue
        if type(module) is nn.Linear:
            if not linear_pays(tokens_per_forward, module.in_features, module.out_features):
                small[name] = f"linear {module.in_features}->{module.out_features}"
        elif _is_grouped(module):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            args = parent.args  # the MoE layer's: routing (top-k of E) and the expert sizes
            if not expert_group_pays(tokens_per_forward, args.n_activated_experts, args.n_routed_experts, args.dim,
                                     args.moe_inter_dim):
                small[name] = (f"experts {args.n_routed_experts} x {args.dim}->{args.moe_inter_dim}, "
                               f"top-{args.n_activated_experts}")
    return small


def require_fp8_output_head(model: nn.Module, model_name: str) -> None:
    """precision.fp8_output_head=true must convert the head; a head left in bf16 would pass for an FP8 one silently
    (the speed and the risk the user opted into would both be missing from the run)."""
    heads = output_heads(model)
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


def require_fp8_grouped_gemm(model: nn.Module, backend: Fp8Backend) -> None:
    """FP8 experts on a GPU without torch._scaled_grouped_mm would run the emulated path: float32 grouped GEMMs,
    slower than bf16 and far more memory. Refuse, naming the settings that keep the run FP8 elsewhere. (The CPU
    emulates by design: correctness runs.)"""
    if backend.kind == "cpu" or backend.has_scaled_grouped_mm:
        return
    experts = [name for name, module in model.named_modules() if is_fp8_grouped(module)]
    if not experts:
        return
    where = ("gfx942 or gfx950 with a torch ROCm build that includes MSLK / FBGEMM GenAI" if backend.kind == "rocm"
             else "sm90 (H100/H200)")
    raise ValueError(
        f"this GPU ({backend.kind} {backend.arch}) has no FP8 grouped GEMM in this torch build (torch."
        f"_scaled_grouped_mm needs {where}), so the MoE experts ({experts[0]}, ...) cannot run in FP8: set "
        "precision.fp8_experts=false (experts in bf16, the other layers in FP8) or precision=bf16")


def _fp8_modules(model: nn.Module):
    """(name, module) of every converted module (Float8Linear or grouped)."""
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear) or is_fp8_grouped(module):
            yield name, module


def _in_scope(name: str, scope: Iterable[str] | None) -> bool:
    if scope is None:
        return True
    return any(name == p or name.startswith(p + ".") or p == "" for p in scope)


def _set_module(module: nn.Module, fp8: bool) -> None:
    if isinstance(module, Float8Linear):
        module.fp8_enabled = fp8
    else:
        module.grouped_mm = getattr(module, _FP8_OP) if fp8 else getattr(module, _HP_OP)


def _module_is_fp8(module: nn.Module) -> bool:
    if isinstance(module, Float8Linear):
        return module.fp8_enabled
    return module.grouped_mm is getattr(module, _FP8_OP)


def set_precision(model: nn.Module, precision: str, scope: Iterable[str] | str | None = None) -> list[str]:
    """Switch the compute precision of converted modules at run time; returns the names switched.

    precision: "fp8" or "bf16" ("bf16" = the module's own high-precision path, exactly the unconverted
    computation). scope: None for the whole model, or module-name prefixes ("layers.3", ...).
    Parameters and optimizer state are untouched. Needs a converted model for "fp8".
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if isinstance(scope, str):
        scope = [scope]
    scope = list(scope) if scope is not None else None
    mods = list(_fp8_modules(model))
    if precision == "fp8" and not mods:
        raise ValueError("set_precision('fp8') on a model with no fp8 layers: call convert_to_fp8 first")
    changed = []
    for name, module in mods:
        if _in_scope(name, scope):
            _set_module(module, precision == "fp8")
            changed.append(name)
    if scope is not None and not changed and mods:
        raise ValueError(f"scope {scope} matches no fp8 module; known e.g. {[n for n, _ in mods[:5]]}")
    return changed


def precision_state(model: nn.Module) -> dict:
    """Checkpointable precision state: {"recipe": name | None, "modules": {name: "fp8" | "bf16"}}."""
    recipe = None
    modules = {}
    for name, module in _fp8_modules(model):
        modules[name] = "fp8" if _module_is_fp8(module) else "bf16"
        if isinstance(module, Float8Linear):
            recipe = module.recipe.name
        elif recipe is None:
            recipe = getattr(module, _RECIPE_ATTR, None)
    return {"recipe": recipe, "modules": modules}


def load_precision_state(model: nn.Module, state: dict) -> None:
    """Restore what precision_state saved (the model must be converted with the same layout)."""
    if not isinstance(state, dict) or "modules" not in state:
        raise ValueError("precision state must be the dict returned by precision_state(model)")
    mods = dict(_fp8_modules(model))
    unknown = sorted(set(state["modules"]) - set(mods))
    if unknown:
        raise ValueError(f"precision state names modules this model does not convert: {unknown[:5]}; the checkpoint "
                         "was made with another FP8 recipe or module filter (precision.fp8_output_head, "
                         "precision.fp8_experts): resume with the settings it was trained with")
    for name, prec in state["modules"].items():
        if prec not in PRECISIONS:
            raise ValueError(f"module {name}: precision must be one of {PRECISIONS}, got {prec!r}")
        _set_module(mods[name], prec == "fp8")


def fp8_health(model: nn.Module) -> dict[str, torch.Tensor]:
    """On-device health scalars from the last forward of every fp8-enabled layer (no host sync).

    saturated_frac: mean over layers of the fraction of sampled fp8 values at +-max.
    underflow_frac: mean over layers of the fraction of sampled nonzero inputs that cast to zero.
    amax_max: largest input amax seen. All zeros if no layer ran in fp8.
    """
    stats = []
    for _, module in _fp8_modules(model):
        if not _module_is_fp8(module):
            continue
        if isinstance(module, Float8Linear):
            if module.fp8_health_valid:
                stats.append(module.fp8_health_stats)
        else:
            last = getattr(module, _FP8_OP).last_stats
            if last is not None:
                stats.append(last)
    if not stats:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        z = torch.zeros((), device=device)
        return {"saturated_frac": z, "underflow_frac": z.clone(), "amax_max": z.clone()}
    device = stats[0].device
    all_S3 = torch.stack([s.to(device) for s in stats])
    return {
        "saturated_frac": all_S3[:, 0].mean(),
        "underflow_frac": all_S3[:, 1].mean(),
        "amax_max": all_S3[:, 2].max(),
    }
