"""The parameters and buffers a checkpointed callable reads, and swapping them for the
recomputation.

The recomputation must read barriered copies of the parameters and buffers, not the originals:
then XLA cannot merge it with the forward, nor start it before the gradient arrives. Writing
the copies into the modules' own `_parameters`/`_buffers` slots for the duration of the
recomputation works for any callable that reaches them through the module (`forward`, other
methods, `functools.partial` of `__call__`) and also keeps buffer updates made during the
recomputation (BatchNorm running statistics) out of the real buffers, so they happen once.

Tensors a module holds as plain attributes (views aside) are put back as the forward saw
them, too (not copied, not barriered): a forward pre-hook of the checkpointed module runs once,
outside the checkpoint, and may set one per call (`spectral_norm`'s `weight`, pruning's
masked weight). A module called twice before backward would otherwise be recomputed with the
second call's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

# (the dict that holds the tensor, its key, the index of the tensor in the deduplicated list)
_Slot = tuple[dict[str, torch.Tensor | None], str, int]


@dataclass(frozen=True)
class ModuleTensors:
    """The distinct parameters and buffers of some modules and every slot that holds them,
    and the tensors the modules hold as plain attributes when the call starts."""

    params: tuple[torch.Tensor, ...]
    buffers: tuple[torch.Tensor, ...]
    param_slots: tuple[_Slot, ...]
    buffer_slots: tuple[_Slot, ...]
    attributes: tuple[tuple[dict[str, object], str, torch.Tensor], ...]

    @classmethod
    def of(cls, modules: Iterable[nn.Module]) -> ModuleTensors:
        # Read at every checkpointed call (module state may change between calls), so walked
        # through the modules' own dicts rather than `named_modules()`.
        params: list[torch.Tensor] = []
        buffers: list[torch.Tensor] = []
        param_slots: list[_Slot] = []
        buffer_slots: list[_Slot] = []
        index_of: dict[int, int] = {}
        attributes: list[tuple[dict[str, object], str, torch.Tensor]] = []
        seen: set[int] = set()
        pending = list(modules)
        while pending:
            module = pending.pop()
            if module is None or id(module) in seen:
                continue
            seen.add(id(module))
            state = module.__dict__
            # Plain tensor attributes computed for the call (`weight_orig / sigma`). Views are
            # left to whoever put them there: FSDP's views of its flat parameter are rebuilt
            # for the recomputation and must be read as they are then.
            attributes += [
                (state, k, v)
                for k, v in state.items()
                if type(v) is torch.Tensor and v._base is None
            ]
            for holder, tensors, slots in (
                (state["_parameters"], params, param_slots),
                (state["_buffers"], buffers, buffer_slots),
            ):
                for name, tensor in holder.items():
                    if tensor is None:
                        continue
                    # Tied tensors are one input with several slots.
                    index = index_of.setdefault(id(tensor), len(tensors))
                    if index == len(tensors):
                        tensors.append(tensor)
                    slots.append((holder, name, index))
            pending.extend(reversed(state["_modules"].values()))
        return cls(
            tuple(params),
            tuple(buffers),
            tuple(param_slots),
            tuple(buffer_slots),
            tuple(attributes),
        )

    @contextmanager
    def substituted(
        self, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]
    ) -> Iterator[None]:
        """Let the modules read `params`/`buffers` in place of their own inside the block."""
        saved: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor | None]] = []
        replaced: list[tuple[dict[str, object], str, object]] = []
        try:
            for state, name, tensor in self.attributes:
                if name in state:
                    replaced.append((state, name, state[name]))
                    state[name] = tensor
            for slots, name, index in self.param_slots:
                # A parameter slot its owner removed between forward and backward stays removed
                # (FSDP1 with use_orig_params=True takes the parameters out, and the block reads
                # FSDP's views). Every other slot reads the forward's parameter, even if someone
                # put another tensor there since (functional_call, reassignment).
                if name not in slots:
                    continue
                saved.append((slots, name, slots[name]))
                slots[name] = params[index]
            for slots, name, index in self.buffer_slots:
                # Buffers always read the forward's values, even if the forward replaced them.
                saved.append((slots, name, slots[name]))
                slots[name] = buffers[index]
            yield
        finally:
            for slots, name, original in reversed(saved):
                slots[name] = original
            for state, name, value in reversed(replaced):
                state[name] = value
