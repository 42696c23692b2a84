"""The trainers users already run, with xla_wrap's checkpointing: transformers' own switch
after ``xla_wrap.integrations.transformers.install()`` (eager CPU and a real ``Trainer`` on
XLA:CPU), TRL's ``SFTTrainer``, and Accelerate's ``Accelerator``. Tiny GPT-2 models built from
configs, a few steps each."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap
from xla_wrap import introspect

from _workers import WORKERS

pytestmark = [
    # The trainers' own: torch_xla's renamed helpers, transformers' renamed switch (the old
    # name, `gradient_checkpointing`, is what users set and what this file tests).
    pytest.mark.filterwarnings("ignore:Use torch_xla:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings(
        "ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning"
    ),
    pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning"),
]

transformers = pytest.importorskip("transformers")
xla_hf = pytest.importorskip("xla_wrap.integrations.transformers")

VOCAB, SEQ, BATCH, STEPS = 64, 32, 4, 4


def gpt2(layers: int = 4) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=layers, n_head=2,
        bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


@pytest.fixture
def installed() -> Iterator[None]:
    xla_hf.install()
    try:
        yield
    finally:
        xla_hf.uninstall()


def _recomputations(model: nn.Module) -> list[bool]:
    """``is_recomputing()`` at each start of the first layer's MLP: True only where xla_wrap
    recomputes it (PyTorch's checkpoint recomputes too, but not as xla_wrap)."""
    seen: list[bool] = []
    mlp = model.transformer.h[0].mlp
    mlp.register_forward_pre_hook(lambda *_: seen.append(xla_wrap.is_recomputing()))
    return seen


def _eager_step(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # a cache changes numerics
    loss.backward()
    return loss.detach()


def test_install_checkpoints_with_xla_wrap_only_where_asked_off_xla() -> None:
    reference = gpt2(layers=2)
    expected = _eager_step(reference)
    cases: list[tuple[Callable[[], None], dict[str, Any] | None, list[bool]]] = [
        # Off XLA, transformers' own switch keeps torch.utils.checkpoint: it recomputes the
        # layer, but not as xla_wrap.
        (lambda: xla_hf.install(), None, [False, False]),
        (lambda: xla_hf.install(everywhere=True), None, [False, True]),
        # An option only xla_wrap has asks for xla_wrap by name.
        (lambda: xla_hf.install(), {"policy": "dots_saveable"}, [False, True]),
    ]
    try:
        for install, kwargs, recomputed in cases:
            install()
            model = gpt2(layers=2)
            model.train()
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            seen = _recomputations(model)
            assert torch.equal(_eager_step(model), expected)
            assert seen == recomputed, (kwargs, seen)
            for plain, wrapped in zip(reference.parameters(), model.parameters(), strict=True):
                assert torch.equal(plain.grad, wrapped.grad)
    finally:
        xla_hf.uninstall()


def test_uninstall_restores_transformers_checkpoint_and_install_is_idempotent() -> None:
    import torch.utils.checkpoint as torch_checkpoint
    import transformers.modeling_utils as modeling

    original = modeling.checkpoint
    assert original is torch_checkpoint.checkpoint and not xla_hf.installed()
    xla_hf.install()
    xla_hf.install()  # again: still one layer of patching
    try:
        assert xla_hf.installed() and modeling.checkpoint is not original
    finally:
        xla_hf.uninstall()
    assert modeling.checkpoint is original and not xla_hf.installed()
    xla_hf.uninstall()  # not installed: nothing to do
    with pytest.raises(xla_wrap.CheckpointTypeError, match=r"install: expected True or False"):
        xla_hf.install(everywhere="yes")  # type: ignore[arg-type]
    assert not xla_hf.installed()


def test_checkpoint_options_xla_wrap_lacks_are_refused_naming_them(installed: None) -> None:
    xla_hf.install(everywhere=True)
    model = gpt2(layers=1)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"determinism_check": "none"})
    with pytest.raises(xla_wrap.CheckpointTypeError, match=r"\['determinism_check'\]"):
        _eager_step(model)


@pytest.mark.parametrize("everywhere", [False, True])
def test_transformers_offload_and_every_n_layers_reach_the_checkpoint(
    installed: None, everywhere: bool
) -> None:
    xla_hf.install(everywhere=everywhere)
    reference = gpt2(layers=2)
    expected = _eager_step(reference)
    model = gpt2(layers=2)
    model.train()
    model.activation_checkpointing_enable(offload=True, every_n_layers=2)
    layers = model.transformer.h
    assert [layer.gradient_checkpointing for layer in layers] == [True, False]
    # transformers' pinned-memory offload became an option of the checkpoint, which takes it
    # as offload_to_cpu (xla_wrap) or as transformers' own `save_on_cpu` (elsewhere).
    assert layers[0]._gradient_checkpointing_func.keywords == {
        "use_reentrant": False,
        "offload": True,
    }
    seen = _recomputations(model)
    assert torch.equal(_eager_step(model), expected)
    assert seen == [False, everywhere]
    for plain, wrapped in zip(reference.parameters(), model.parameters(), strict=True):
        assert torch.equal(plain.grad, wrapped.grad)


def test_install_after_a_reload_of_the_integration_still_restores_transformers() -> None:
    import importlib

    import torch.utils.checkpoint as torch_checkpoint
    import transformers.modeling_utils as modeling

    xla_hf.install()
    reloaded = importlib.reload(xla_hf)  # a notebook's autoreload
    try:
        reloaded.install()
        assert reloaded.installed()
        model = gpt2(layers=1)
        model.train()
        model.gradient_checkpointing_enable()
        _eager_step(model)  # no recursion into the earlier import's function
    finally:
        reloaded.uninstall()
    assert modeling.checkpoint is torch_checkpoint.checkpoint and not xla_hf.installed()


def test_pytorch_selective_checkpointing_is_refused_pointing_at_a_policy(installed: None) -> None:
    xla_hf.install(everywhere=True)
    model = gpt2(layers=1)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"context_fn": object()})
    with pytest.raises(xla_wrap.CheckpointValueError, match=r"context_fn.*'policy'"):
        _eager_step(model)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(
            0, VOCAB, (BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(0)
        )

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def _train(trainer: Any) -> tuple[list[float], int]:
    """The trainer's logged losses and the largest compiled program's peak. XLA's generator
    starts from the same seed for every run, so Dropout draws the same masks."""
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(0)
    programs = introspect.compiled_programs(trainer.train)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS
    return losses, max(p.total_bytes for p in programs)


def _arguments(checkpointing: bool, **more: Any) -> dict[str, Any]:
    return dict(
        output_dir=tempfile.mkdtemp(prefix="xla_wrap_trainer_"),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        gradient_checkpointing=checkpointing,
        optim="adamw_torch",  # the default fused AdamW refuses XLA tensors
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        **more,
    )


@pytest.mark.xla
def test_trainer_flag_trains_like_no_checkpointing_with_a_lower_peak(
    xla_device: torch.device, installed: None
) -> None:
    pytest.importorskip("accelerate")
    runs = {}
    for checkpointing in (False, True):
        model = gpt2()
        seen = _recomputations(model)
        arguments = transformers.TrainingArguments(**_arguments(checkpointing))
        trainer = transformers.Trainer(model=model, args=arguments, train_dataset=_Tokens())
        runs[checkpointing] = _train(trainer)
        assert next(model.parameters()).device.type == "xla"
        assert any(seen) is checkpointing  # the flag checkpointed with xla_wrap
    (plain, plain_peak), (ours, our_peak) = runs[False], runs[True]
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=0)
    assert our_peak < 0.8 * plain_peak


@pytest.mark.xla
def test_trl_sft_trainer_default_checkpointing_trains_like_none(
    xla_device: torch.device, installed: None
) -> None:
    # SFTConfig turns gradient checkpointing on by default: without install() it fails on XLA.
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    words = [f"w{i}" for i in range(VOCAB - 3)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    draw = torch.Generator().manual_seed(0)
    texts = [
        " ".join(words[j] for j in torch.randint(0, len(words), (SEQ - 8,), generator=draw))
        for _ in range(BATCH * STEPS)
    ]
    runs = {}
    for checkpointing in (False, True):
        model = gpt2()
        seen = _recomputations(model)
        config = trl.SFTConfig(**_arguments(checkpointing, max_length=SEQ, packing=False))
        assert trl.SFTConfig(output_dir=config.output_dir).gradient_checkpointing is True
        trainer = trl.SFTTrainer(
            model=model,
            args=config,
            train_dataset=datasets.Dataset.from_dict({"text": texts}),
            processing_class=tokenizer,
        )
        runs[checkpointing] = _train(trainer)
        assert any(seen) is checkpointing
    (plain, plain_peak), (ours, our_peak) = runs[False], runs[True]
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=0)
    assert our_peak < plain_peak


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down, self.drop = nn.Linear(64, 256), nn.Linear(256, 64), nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.tanh(self.up(x))))


def _accelerate_run(accelerate: Any, checkpointing: bool) -> tuple[list[float], int]:
    """Four SGD steps of a residual MLP prepared by an ``Accelerator``: the losses and the
    compiled peak."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch.manual_seed(0)
    model = nn.Sequential(*(_Residual() for _ in range(6)), nn.Linear(64, 1))
    if checkpointing:
        xla_wrap.apply_activation_checkpointing(model, xla_wrap.wrap_policies.by_type(_Residual))
    accelerator = accelerate.Accelerator()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert accelerator.device.type == "xla"
    assert sum(isinstance(m, xla_wrap.CheckpointWrapper) for m in model.modules()) == (
        6 if checkpointing else 0
    )
    draw = torch.Generator().manual_seed(0)
    batches = [torch.randn(128, 64, generator=draw) for _ in range(STEPS)]
    losses: list[float] = []

    def train() -> None:
        for x in batches:
            loss = model(x.to(accelerator.device)).pow(2).mean()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            torch_xla.sync()
            losses.append(loss.item())

    xm.set_rng_state(0)
    programs = introspect.compiled_programs(train)
    return losses, max(p.total_bytes for p in programs)


@pytest.mark.xla
def test_accelerate_trains_a_checkpointed_model_like_the_plain_one(
    xla_device: torch.device,
) -> None:
    accelerate = pytest.importorskip("accelerate")
    plain, plain_peak = _accelerate_run(accelerate, checkpointing=False)
    ours, our_peak = _accelerate_run(accelerate, checkpointing=True)
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=0)
    assert our_peak < 0.85 * plain_peak


def _lightning_run(checkpointing: bool) -> tuple[list[float], int]:
    """Four SGD steps of a residual MLP under Lightning's single-device XLA strategy: the
    losses and the compiled peak."""
    import lightning
    import torch_xla.core.xla_model as xm
    from lightning.pytorch.accelerators import XLAAccelerator

    class XlaCpu(XLAAccelerator):
        """Lightning's XLA accelerator, told about XLA:CPU's one device: Lightning counts TPU
        chips only and refuses "tpu" elsewhere (docs/integrations.md). The rest is Lightning's
        own XLA code (SingleDeviceXLAStrategy, its optimizer step and device transfers)."""

        @staticmethod
        def auto_device_count() -> int:
            return 1

        @staticmethod
        def is_available() -> bool:
            return True

        @staticmethod
        def parse_devices(devices: Any) -> int:
            return 1

        @staticmethod
        def get_parallel_devices(devices: Any) -> list[torch.device]:
            return [torch.device("xla", 0)]

    class Regression(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*(_Residual() for _ in range(6)), nn.Linear(64, 1))
            if checkpointing:
                xla_wrap.apply_activation_checkpointing(
                    self.net, xla_wrap.wrap_policies.by_type(_Residual)
                )
            self.losses: list[torch.Tensor] = []

        def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
            loss = self.net(batch[0]).pow(2).mean()
            assert loss.device.type == "xla"
            self.losses.append(loss.detach())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    module = Regression()
    draw = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(128 * STEPS, 64, generator=draw))
    trainer = lightning.Trainer(
        accelerator=XlaCpu(),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    assert type(trainer.strategy).__name__ == "SingleDeviceXLAStrategy"
    xm.set_rng_state(0)
    loader = torch.utils.data.DataLoader(data, batch_size=128)
    programs = introspect.compiled_programs(lambda: trainer.fit(module, loader))
    return [float(loss) for loss in module.losses], max(p.total_bytes for p in programs)


@pytest.mark.xla
@pytest.mark.filterwarnings("ignore::UserWarning:lightning.*")
def test_lightning_single_device_xla_trains_a_checkpointed_model_like_the_plain_one(
    xla_device: torch.device,
) -> None:
    pytest.importorskip("lightning")
    plain, plain_peak = _lightning_run(checkpointing=False)
    ours, our_peak = _lightning_run(checkpointing=True)
    assert len(ours) == STEPS
    torch.testing.assert_close(ours, plain, rtol=1e-5, atol=0)
    assert our_peak < 0.85 * plain_peak


@pytest.mark.xla
@pytest.mark.subprocess
def test_trainer_with_xla_fsdpv2_trains_like_fsdpv2_alone_with_either_route() -> None:
    pytest.importorskip("torch_xla")
    pytest.importorskip("accelerate")
    import json
    import os
    import subprocess
    import sys

    worker = WORKERS / "trainer_fsdpv2.py"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "CPU_NUM_DEVICES")}
    done = subprocess.run(
        [sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    for how, run in runs.items():
        assert "error" not in run, (how, run.get("error"))
        assert run["fsdp_units"] == 5, how  # the root and one unit per layer, found by name
    plain = runs["plain"]
    assert len(plain["losses"]) == 4 and not plain["recomputed_by_xla_wrap"]
    for how in ("apply_activation_checkpointing", "flag after install()"):
        assert runs[how]["recomputed_by_xla_wrap"], how
        torch.testing.assert_close(runs[how]["losses"], plain["losses"], rtol=1e-5, atol=0)
    applied = runs["apply_activation_checkpointing"]
    assert applied["peak_bytes"] < 0.9 * plain["peak_bytes"]
    # Both routes build the same program: the second run found it in XLA's cache.
    assert applied["compiled"] and not runs["flag after install()"]["compiled"]
