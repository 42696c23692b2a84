"""Other libraries' module layouts, known in one place: how FSDP's wrapper classes are named
and under which attribute each wrapper keeps the module it wraps. Imports nothing of the
package."""

from __future__ import annotations

from torch import nn

# FSDP wrapper classes: torch_xla's FSDP and FSDPv2, PyTorch's FSDP1 and FSDP2 (whose
# fully_shard makes each module an FSDPModule), FairScale's FSDP.
FSDP_CLASS_NAMES = frozenset(
    {
        "XlaFullyShardedDataParallel",
        "SpmdFullyShardedDataParallel",
        "FullyShardedDataParallel",
        "FSDPModule",
    }
)

# The attribute under which each FSDP class keeps the module it wraps.
FSDP_WRAPPED_ATTRIBUTES = frozenset({"_fsdp_wrapped_module", "module"})

# The children through which wrappers (FSDPv2 and FSDP units, PyTorch's checkpoint_wrapper) hold
# the module they wrap; xla_wrap's own checkpoint_wrapper keeps the module itself.
WRAPPED_CHILDREN = ("_orig_module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether `module` is a unit of any FSDP (its class or a base named like FSDP's)."""
    return any(cls.__name__ in FSDP_CLASS_NAMES for cls in type(module).__mro__)


def names_without_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """Every submodule under its name without FSDP's wrapper segments (`blocks.0`, not
    `blocks.0._fsdp_wrapped_module` or `blocks.0.module`); first name wins."""
    names: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        parts = name.split(".") if name else []
        kept: list[str] = []
        parent = model
        for part in parts:
            child = parent._modules[part]
            assert child is not None
            if not (part in FSDP_WRAPPED_ATTRIBUTES and is_fsdp_unit(parent)):
                kept.append(part)
            parent = child
        names.setdefault(".".join(kept), module)
    return names


# transformers: plain attributes that differ per layer by construction and only index a cache.
LAYER_INDEX_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number"})

# torch.utils.checkpoint.checkpoint: the keywords it takes for itself (the rest go to the function).
TORCH_CHECKPOINT_KEYWORDS = frozenset(
    {"use_reentrant", "preserve_rng_state", "context_fn", "determinism_check", "debug"}
)
