"""xla_wrap.integrations.transformers on tiny Hugging Face models built from configs (no
downloads): LlamaForCausalLM and GPT2LMHeadModel, both with Dropout."""

from __future__ import annotations

import copy
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import internal

from models import hf_step, layers_of, tiny_gpt2

transformers = pytest.importorskip("transformers")
xla_hf = pytest.importorskip("xla_wrap.integrations.transformers")

VOCAB, SEQ, BATCH = 64, 16, 2


def llama(layers: int = 2, width: int = 32) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        intermediate_size=2 * width,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.1,
    )
    return transformers.LlamaForCausalLM(config)


def gpt2(layers: int = 2, width: int = 32) -> nn.Module:
    return tiny_gpt2(layers, width)


MODELS = [pytest.param(llama, id="llama"), pytest.param(gpt2, id="gpt2")]


def _record_calls(model: nn.Module) -> list[list[bool]]:
    """Per layer, whether each call of its MLP was a recomputation. transformers checkpoints a
    layer's ``forward``, inside its hooks, so the MLP inside it is what runs again; a pre-hook,
    because on eager devices the recomputation stops inside the MLP, once the last tensor the
    layer saved for backward exists."""
    calls: list[list[bool]] = []
    for layer in layers_of(model):
        record: list[bool] = []
        calls.append(record)
        layer.mlp.register_forward_pre_hook(
            lambda *_, r=record: r.append(xla_wrap.is_recomputing())
        )
    return calls


def _labelled(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"input_ids": ids, "labels": ids}


def _ids(device: torch.device | str = "cpu") -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    return ids.to(device)


def _plain(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    plain = make().train()
    # A key/value cache filled while training concatenates keys, which moves the attention's
    # last bits; checkpointing turns it off, so the reference runs without it too.
    plain.config.use_cache = False
    return plain


def _assert_trains_bitwise_alike(plain: nn.Module, twin: nn.Module) -> None:
    ids = _ids()
    plain_loss, plain_grads = hf_step(plain, _labelled(ids))
    loss, grads = hf_step(twin, _labelled(ids))
    assert torch.equal(loss, plain_loss)
    assert len(grads) == len(plain_grads) and all(g is not None for g in grads)
    for got, expected in zip(grads, plain_grads, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("make", MODELS)
def test_transformers_layers_checkpointed_bitwise_on_eager_cpu(
    make: Callable[[], nn.Module],
) -> None:
    plain = _plain(make)
    twin = copy.deepcopy(plain)
    xla_hf.gradient_checkpointing_enable(twin)
    calls = _record_calls(twin)
    _assert_trains_bitwise_alike(plain, twin)
    assert calls == [[False, True]] * len(calls)  # every layer recomputed once in backward


def test_every_n_layers_and_disable() -> None:
    torch.manual_seed(0)
    model = gpt2(layers=4).train()
    assert model.config.use_cache is True
    xla_hf.gradient_checkpointing_enable(model, every_n_layers=2, preserve_rng_state=True)
    assert model.config.use_cache is False
    calls = _record_calls(model)
    hf_step(model, _labelled(_ids()))
    assert calls == [[False, True], [False], [False, True], [False]]
    xla_hf.gradient_checkpointing_disable(model)
    assert model.config.use_cache is True
    for record in calls:
        record.clear()
    hf_step(model, _labelled(_ids()))
    assert calls == [[False]] * 4


@pytest.mark.xla
@pytest.mark.parametrize("make", MODELS)
def test_transformers_on_xla_same_training_and_lower_peak(
    make: Callable[..., nn.Module], xla_device: torch.device
) -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm

    from xla_wrap import introspect

    torch.manual_seed(0)
    plain = make(layers=4, width=64).train()
    plain.config.use_cache = False
    twin = copy.deepcopy(plain)
    xla_hf.gradient_checkpointing_enable(twin)
    results = []
    for model in (plain, twin):
        model.to(xla_device)
        ids = _ids(xla_device)
        torch_xla.sync()
        out: dict[str, Any] = {}

        def step(model: nn.Module = model, ids: torch.Tensor = ids, out: dict = out) -> None:
            xm.set_rng_state(11, str(xla_device))
            loss = model(ids, labels=ids).loss
            loss.backward()
            torch_xla.sync()
            out["loss"] = loss.item()

        program = introspect.compiled_memory(step)
        grads = [p.grad.cpu() for p in model.parameters()]
        results.append((out["loss"], grads, program.total_bytes))
        barriers = re.findall(r"= \((.*?)\) opt-barrier\(", program.optimized_hlo)
    # transformers hands over `partial(Layer.forward, layer, ...)`: the layer is found from it,
    # and its weights go through the barrier with the saved inputs.
    weight = "f32[{},{}]".format(*next(layers_of(twin)[0].mlp.parameters()).shape)
    assert any(weight in operands for operands in barriers), (weight, barriers[:1])
    (plain_loss, plain_grads, plain_peak), (loss, grads, peak) = results
    assert loss == pytest.approx(plain_loss, rel=1e-5)
    for got, expected in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert peak < plain_peak


class _NoCheckpointing(transformers.GPT2LMHeadModel):  # type: ignore[misc,name-defined]
    supports_gradient_checkpointing = False


class _OldFormat(transformers.GPT2LMHeadModel):  # type: ignore[misc,name-defined]
    def _set_gradient_checkpointing(self, module: nn.Module, value: bool = False) -> None:
        pass  # the hook's format before transformers 4.35, still found in Hub modeling files


def test_bad_models_and_options_are_refused_with_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = "xla_wrap.integrations.transformers.gradient_checkpointing_enable"
    with pytest.raises(xla_wrap.CheckpointTypeError, match=rf"^{api}: expected a transformers"):
        xla_hf.gradient_checkpointing_enable(nn.Linear(2, 2))
    unsupported = _NoCheckpointing(gpt2().config)
    with pytest.raises(xla_wrap.CheckpointValueError, match="supports_gradient_checkpointing"):
        xla_hf.gradient_checkpointing_enable(unsupported)
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"before transformers 4\.35"):
        xla_hf.gradient_checkpointing_enable(_OldFormat(gpt2().config))
    with pytest.raises(xla_wrap.CheckpointValueError, match="every_n_layers"):
        xla_hf.gradient_checkpointing_enable(gpt2(), every_n_layers=0)
    with pytest.raises(xla_wrap.CheckpointTypeError, match="preserve_rng_state, use_reentrant"):
        xla_hf.gradient_checkpointing_enable(gpt2(), reentrant=True)
    model = gpt2()
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'xla_wrap\[hf\]'"):
        xla_hf.gradient_checkpointing_enable(model)


@pytest.mark.parametrize("make", MODELS)
def test_transformers_layers_with_a_save_policy_bitwise_on_eager_cpu(
    make: Callable[[], nn.Module],
) -> None:
    plain = _plain(make)
    twin = copy.deepcopy(plain)
    full = copy.deepcopy(plain)
    xla_hf.gradient_checkpointing_enable(full)
    xla_hf.gradient_checkpointing_enable(twin, policy="dots_saveable")

    def activations(model: nn.Module) -> int:
        saved = xla_wrap.introspect.saved_residuals(lambda i: model(i, labels=i).loss, _ids())
        return sum(r.kind == "activation" for r in saved)

    # The policy reaches every layer's checkpoint: it keeps the products, which full
    # checkpointing recomputes.
    assert activations(twin) > activations(full)
    _assert_trains_bitwise_alike(plain, twin)


@pytest.mark.xla
@pytest.mark.parametrize(
    ("make", "stacked"),
    [(llama, False), (gpt2, False), (llama, True)],
    ids=["llama", "gpt2", "llama-stacked"],
)
def test_scanned_transformers_layers_give_the_loops_loss_and_gradients(
    make: Callable[..., nn.Module], stacked: bool, xla_device: torch.device, tmp_path: Path
) -> None:
    """``scan=True``: the decoder layers run as one scanned stack (with ``stack_parameters``,
    stored stacked). Compared in eval mode (no Dropout: the scanned stack draws its own masks)
    with the loop on XLA. (Against eager CPU, GPT-2's tied embedding gradient differs on XLA
    already without xla_wrap.)"""
    import torch_xla

    torch.manual_seed(0)
    plain = make(layers=3).eval()
    plain.config.use_cache = False
    twin = copy.deepcopy(plain)
    xla_hf.gradient_checkpointing_enable(
        twin, scan=True, stack_parameters=stacked, policy="dots_saveable"
    )
    scanned = [m for m in twin.modules() if isinstance(m, xla_wrap.ScannedLayers)]
    assert len(scanned) == 1 and len(scanned[0]) == 3
    assert scanned[0].parameters_stacked == stacked
    assert list(twin.state_dict()) == list(plain.state_dict())
    if stacked:  # transformers' own checkpoint files, through safetensors, load unscanned
        twin.save_pretrained(tmp_path)
        loaded = type(plain).from_pretrained(tmp_path)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in plain.state_dict().items())
    runs = []
    for model in (plain, twin):
        model.to(xla_device)
        loss, _ = hf_step(model, _labelled(_ids(xla_device)))
        grads = list(internal.per_layer_gradients(model).values())
        torch_xla.sync()
        runs.append((loss.cpu(), [g.cpu() for g in grads]))
    (expected_loss, expected), (loss, grads) = runs
    assert float(loss) == pytest.approx(float(expected_loss), rel=1e-5)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    xla_hf.gradient_checkpointing_disable(twin)
    assert not any(isinstance(m, xla_wrap.ScannedLayers) for m in twin.modules())
    assert [n for n, _ in twin.named_parameters()] == [n for n, _ in plain.named_parameters()]


def test_scan_refuses_options_it_cannot_apply() -> None:
    with pytest.raises(xla_wrap.CheckpointValueError, match="every_n_layers=2"):
        xla_hf.gradient_checkpointing_enable(llama(), scan=True, every_n_layers=2)
    with pytest.raises(xla_wrap.CheckpointValueError, match="without scan=True"):
        xla_hf.gradient_checkpointing_enable(llama(), stack_parameters=True)


@pytest.mark.xla
def test_a_plan_through_the_drop_in_checkpoints_its_layers_and_trains_bitwise(
    xla_device: torch.device,
) -> None:
    plain = _plain(lambda: llama(layers=4, width=64))
    on_xla = copy.deepcopy(plain).to(xla_device)
    ids = _ids(xla_device)

    def plan_for(budget: int | float) -> xla_wrap.CheckpointPlan:
        return xla_wrap.plan_checkpointing(
            on_xla, ids, budget=budget, labels=ids, loss=lambda out: out.loss, progress=False
        )

    unplanned = plan_for(1.0).unplanned_peak_bytes
    with pytest.raises(xla_wrap.BudgetUnreachableError) as raised:
        plan_for(1)
    plan = plan_for((raised.value.smallest_peak_bytes + unplanned) // 2)
    assert list(plan.choices) == [f"model.layers.{i}" for i in range(4)]
    assert plan.checkpointed and plan.peak_bytes <= plan.budget_bytes
    twin = copy.deepcopy(plain)
    xla_hf.gradient_checkpointing_enable(twin, plan=plan)
    for name, choice in plan.choices.items():
        layer = twin.get_submodule(name)
        assert isinstance(layer, xla_wrap.CheckpointWrapper) == (choice != "none"), name
    _assert_trains_bitwise_alike(plain, twin)
    xla_hf.gradient_checkpointing_disable(twin)
    assert not any(isinstance(m, xla_wrap.CheckpointWrapper) for m in twin.modules())
    with pytest.raises(ValueError, match=r"expected a CheckpointPlan as `plan` and nothing else"):
        xla_hf.gradient_checkpointing_enable(twin, plan=plan, every_n_layers=2)


def test_every_n_layers_is_the_plan_that_fully_recomputes_every_nth_layer() -> None:
    torch.manual_seed(0)
    model = gpt2(layers=4).train()
    plan = xla_wrap.CheckpointPlan(
        choices={f"transformer.h.{i}": "full" if i % 2 == 0 else "none" for i in range(4)},
        budget_bytes=0, peak_bytes=0, predicted_peak_bytes=0, recompute_flops=0,
        unplanned_peak_bytes=0, unplanned_flops=0,
    )  # fmt: skip
    xla_hf.gradient_checkpointing_enable(model, plan=plan)
    calls = _record_calls(model)
    hf_step(model, _labelled(_ids()))
    assert calls == [[False, True], [False], [False, True], [False]]  # as every_n_layers=2


@pytest.mark.parametrize("stacked", [False, True], ids=["per-layer", "stacked"])
def test_scan_refuses_gpt2_when_its_attention_scales_by_the_layer_index(
    stacked: bool, device: torch.device
) -> None:
    """``scale_attn_by_inverse_layer_idx=True`` divides each layer's attention scores by its
    ``layer_idx + 1`` (a ``scaling`` its forward reads): a scan would use layer 0's for all.
    By default GPT-2 reads nothing that differs (its index only for a cache, which training
    does not pass) and scans (test above)."""
    torch.manual_seed(0)
    model = tiny_gpt2(layers=3, scale_attn_by_inverse_layer_idx=True, use_cache=False)
    xla_hf.gradient_checkpointing_enable(model, scan=True, stack_parameters=stacked)
    model.to(device)
    head_scale = (32 / 4) ** -0.5  # 1 / sqrt(head_dim), then / (layer_idx + 1)
    ours, theirs = (f"{v:.9f}"[:7] for v in (head_scale, head_scale / 2))  # 5 digits, unrounded
    expected = rf"layer 1's 'attn.scaling' = {theirs}\d* where layer 0 has {ours}"
    with pytest.raises(xla_wrap.CheckpointError, match=expected):
        hf_step(model, _labelled(_ids(device)))
