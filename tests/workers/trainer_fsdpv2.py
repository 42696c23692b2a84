"""transformers' Trainer with XLA FSDPv2 (SPMD over 4 virtual CPU devices) and xla_wrap's
checkpointing, in a fresh process: SPMD and XLA's flags are set before torch_xla starts.

Trains a tiny Llama (attention Dropout 0.1) for 4 steps three times, from the same weights,
batches and seeds: without checkpointing, with the layers checkpointed by
``apply_activation_checkpointing`` before the Trainer is built, and with the Trainer's own flag
after ``xla_wrap.integrations.transformers.install()``. Prints one JSON line: per run, the
logged losses and the largest compiled program's peak (bytes, per device).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from typing import Any

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "4"
os.environ["XLA_FLAGS"] = "--xla_disable_hlo_passes=cse_barrier_expander"
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

import xla_wrap  # noqa: E402
from xla_wrap import introspect  # noqa: E402

introspect.enable_compile_dumps()  # before the first XLA device
xr.use_spmd()  # before the first XLA tensor

import transformers  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

from xla_wrap.integrations import transformers as xla_hf  # noqa: E402

STEPS = 4


class FsdpV2Trainer(transformers.Trainer):
    """transformers 5.25 reaches the scheduler before making the optimizer on its XLA FSDP
    path (``'NoneType' object has no attribute 'param_groups'``), with or without
    checkpointing; this makes it first. FSDPv2 shards the parameters in place, so the
    optimizer over the model's parameters is the one FSDPv2 trains."""

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if optimizer is None and self.optimizer is None:
            self.create_optimizer()
        return super().create_scheduler(num_training_steps, optimizer)


def run(how: str) -> dict[str, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attention_dropout=0.1, use_cache=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    if how == "apply_activation_checkpointing":
        xla_wrap.apply_activation_checkpointing(
            model, xla_wrap.wrap_policies.by_type(LlamaDecoderLayer)
        )
    if how == "flag after install()":
        xla_hf.install()
    draw = torch.Generator().manual_seed(0)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 64, (16, 32), generator=draw)]
    arguments = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="xla_wrap_fsdpv2_"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        gradient_checkpointing=how == "flag after install()",
        optim="adamw_torch",
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        fsdp="full_shard",
        fsdp_config={
            "xla": True,
            "xla_fsdp_v2": True,
            # Found by class name: a checkpointed layer keeps its class and its name.
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        },
    )
    trainer = FsdpV2Trainer(model=model, args=arguments, train_dataset=rows)
    seen: list[bool] = []
    model.model.layers[0].mlp.register_forward_pre_hook(
        lambda *_: seen.append(xla_wrap.is_recomputing())
    )
    xm.set_rng_state(0)
    compiles = met.metric_data("CompileTime")
    before = compiles[0] if compiles else 0
    try:
        peak = max(p.total_bytes for p in introspect.compiled_programs(trainer.train))
    except xla_wrap.CheckpointValueError:  # nothing compiled: an earlier run's program
        peak = None
    units = trainer.model_wrapped.modules()
    return {
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "peak_bytes": peak,
        "compiled": met.metric_data("CompileTime")[0] > before,
        "recomputed_by_xla_wrap": any(seen),
        "fsdp_units": sum(type(m).__name__ == "SpmdFullyShardedDataParallel" for m in units),
    }


def main() -> None:
    runs = {}
    for how in ("plain", "apply_activation_checkpointing", "flag after install()"):
        try:
            runs[how] = run(how)
        except Exception as error:  # reported, not raised: the test names the failing run
            runs[how] = {"error": f"{type(error).__name__}: {error}"[:500]}
    print(json.dumps(runs))


if __name__ == "__main__":
    sys.exit(main())
