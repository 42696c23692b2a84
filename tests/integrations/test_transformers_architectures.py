"""Bitwise training across transformers architectures on eager CPU, with Dropout on.

xla_wrap promises that a checkpointed model trains exactly like the unwrapped one: on eager CPU
the loss and every parameter gradient are bitwise equal, with Dropout active, for every
transformers architecture that supports gradient checkpointing. This file checks that promise
for xla_wrap's engine on decoder-only, encoder-only and
encoder-decoder models (text and speech), each built tiny from a config (no downloads), in
train mode, with every dropout probability of its config set to 0.1. It checks it two ways:

* transformers' own hook, :func:`xla_wrap.integrations.transformers.gradient_checkpointing_enable`,
  which checkpoints the ``forward`` of each ``GradientCheckpointingLayer``;
* by class, ``apply_activation_checkpointing(model, wrap_policies.by_type(Layer))``, which puts
  each layer of the model's layer lists (checkpointed in place: it stays a ``Layer``).

Each test also asserts that every layer was recomputed in backward (a forward hook on the
layer's submodules reads :func:`xla_wrap.is_recomputing`), so it cannot pass by checkpointing
nothing. (The reentrant engine xla_wrap had before was not held to this: on the five
encoder-decoders it summed the gradient of the encoder's output, which the cross-attention of
every decoder layer reads, in another order than autograd does; docs/policies.md.)
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import xla_wrap

from models import hf_step, layers_of

transformers = pytest.importorskip("transformers")
xla_hf = pytest.importorskip("xla_wrap.integrations.transformers")
modeling_layers = pytest.importorskip("transformers.modeling_layers")
get_module_class_from_name = pytest.importorskip(
    "transformers.trainer_pt_utils"
).get_module_class_from_name

VOCAB, SEQ, BATCH, LAYERS, DROPOUT = 96, 8, 2, 2, 0.1
SEED = 5

# Config keyword arguments of the tiny models, by naming family.
_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
}
_LLAMA = {**_BASE, "num_key_value_heads": 2}
_GEMMA = {**_LLAMA, "head_dim": 8}
_BERT = {**_BASE, "type_vocab_size": 2}
_GPT2 = {"vocab_size": VOCAB, "n_embd": 32, "n_layer": LAYERS, "n_head": 4, "n_positions": 64}
_SEQ2SEQ: dict[str, Any] = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "encoder_layers": LAYERS,
    "decoder_layers": LAYERS,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
    "decoder_start_token_id": 2,
}
_BART = {**_SEQ2SEQ, "max_position_embeddings": 64}


@dataclasses.dataclass
class Arch:
    """A tiny transformers model: its config and model classes, what it reads, its config."""

    config: str
    model: str
    inputs: str  # "text" (ids, labels = ids), "seq2seq" (ids, labels) or "speech"
    options: dict[str, Any]

    @property
    def layers(self) -> int:
        return LAYERS if self.inputs == "text" else 2 * LAYERS  # encoder-decoders: two stacks


ARCHS: dict[str, Arch] = {
    # decoder-only
    "llama": Arch("LlamaConfig", "LlamaForCausalLM", "text", _LLAMA),
    "mistral": Arch("MistralConfig", "MistralForCausalLM", "text", _LLAMA),
    "qwen2": Arch("Qwen2Config", "Qwen2ForCausalLM", "text", _LLAMA),
    "qwen3": Arch("Qwen3Config", "Qwen3ForCausalLM", "text", _GEMMA),
    "gemma": Arch("GemmaConfig", "GemmaForCausalLM", "text", _GEMMA),
    "gemma2": Arch(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        "text",
        {**_GEMMA, "query_pre_attn_scalar": 8, "sliding_window": 4},
    ),
    "gemma3": Arch(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        "text",
        {**_GEMMA, "query_pre_attn_scalar": 8, "sliding_window": 4},
    ),
    "phi": Arch("PhiConfig", "PhiForCausalLM", "text", _LLAMA),
    "phi3": Arch(
        "Phi3Config", "Phi3ForCausalLM", "text", {**_LLAMA, "pad_token_id": 0, "eos_token_id": 2}
    ),
    "stablelm": Arch("StableLmConfig", "StableLmForCausalLM", "text", _LLAMA),
    "olmo": Arch(
        "OlmoConfig", "OlmoForCausalLM", "text", {**_LLAMA, "pad_token_id": 0, "eos_token_id": 2}
    ),
    "gpt2": Arch(
        "GPT2Config", "GPT2LMHeadModel", "text", {**_GPT2, "bos_token_id": 0, "eos_token_id": 0}
    ),
    "gpt_neo": Arch(
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        "text",
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "num_layers": LAYERS,
            "num_heads": 4,
            "attention_types": [[["global", "local"], LAYERS // 2]],
            "window_size": 4,
            "max_position_embeddings": 64,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
    ),
    "gpt_neox": Arch("GPTNeoXConfig", "GPTNeoXForCausalLM", "text", _BASE),
    "gptj": Arch(
        "GPTJConfig",
        "GPTJForCausalLM",
        "text",
        {**_GPT2, "rotary_dim": 4, "bos_token_id": 0, "eos_token_id": 0},
    ),
    "opt": Arch(
        "OPTConfig",
        "OPTForCausalLM",
        "text",
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "ffn_dim": 64,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 4,
            "max_position_embeddings": 64,
            "word_embed_proj_dim": 32,
            "pad_token_id": 1,
        },
    ),
    "falcon": Arch(
        "FalconConfig",
        "FalconForCausalLM",
        "text",
        {
            "vocab_size": VOCAB,
            "hidden_size": 32,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": 4,
        },
    ),
    "bloom": Arch(
        "BloomConfig",
        "BloomForCausalLM",
        "text",
        {"vocab_size": VOCAB, "hidden_size": 32, "n_layer": LAYERS, "n_head": 4},
    ),
    # encoder-only
    "bert": Arch("BertConfig", "BertForMaskedLM", "text", _BERT),
    "roberta": Arch("RobertaConfig", "RobertaForMaskedLM", "text", {**_BERT, "pad_token_id": 1}),
    "distilbert": Arch(
        "DistilBertConfig",
        "DistilBertForMaskedLM",
        "text",
        {
            "vocab_size": VOCAB,
            "dim": 32,
            "hidden_dim": 64,
            "n_layers": LAYERS,
            "n_heads": 4,
            "max_position_embeddings": 64,
        },
    ),
    "electra": Arch("ElectraConfig", "ElectraForMaskedLM", "text", {**_BERT, "embedding_size": 32}),
    # encoder-decoder
    "t5": Arch(
        "T5Config",
        "T5ForConditionalGeneration",
        "seq2seq",
        {
            "vocab_size": VOCAB,
            "d_model": 32,
            "d_kv": 8,
            "d_ff": 64,
            "num_layers": LAYERS,
            "num_heads": 4,
            "relative_attention_num_buckets": 8,
            "decoder_start_token_id": 0,
        },
    ),
    "bart": Arch("BartConfig", "BartForConditionalGeneration", "seq2seq", _BART),
    "mbart": Arch("MBartConfig", "MBartForConditionalGeneration", "seq2seq", _BART),
    "marian": Arch(
        "MarianConfig", "MarianMTModel", "seq2seq", {**_BART, "decoder_start_token_id": 1}
    ),
    "whisper": Arch(
        "WhisperConfig",
        "WhisperForConditionalGeneration",
        "speech",
        {
            **_SEQ2SEQ,
            "num_mel_bins": 8,
            "max_source_positions": 8,
            "max_target_positions": 16,
            "begin_suppress_tokens": None,
            "suppress_tokens": None,
        },
    ),
}


def _is_dropout(key: str) -> bool:
    # LayerDrop skips whole layers at random; it is not Dropout and stays off.
    return "layerdrop" not in key and (
        "dropout" in key or key.endswith("pdrop") or key == "dropout_rate"
    )


def _build(arch: Arch) -> nn.Module:
    config = getattr(transformers, arch.config)(**arch.options)
    dropouts = [key for key in config.to_dict() if _is_dropout(key)]
    assert dropouts, f"{arch.config} has no dropout probability"
    for key in dropouts:
        setattr(config, key, DROPOUT)
    torch.manual_seed(0)
    model = getattr(transformers, arch.model)(config).train()
    # A key/value cache filled while training concatenates keys, which moves the attention's
    # last bits; checkpointing turns it off, so the reference runs without it too. T5 gives its
    # decoder stack a copy of the config, so every config in the model is switched off.
    for module in model.modules():
        module_config = getattr(module, "config", None)
        if module_config is not None and hasattr(module_config, "use_cache"):
            module_config.use_cache = False
    return model


def _inputs(arch: Arch, model: nn.Module) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    # Ids from 3 up: no pad, bos or eos token, which some models mask.
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    if arch.inputs == "text":
        return {"input_ids": ids, "labels": ids}
    labels = torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)  # decoder shifts these
    if arch.inputs == "seq2seq":
        return {"input_ids": ids, "labels": labels}
    config = model.config
    frames = 2 * config.max_source_positions  # Whisper's conv stem halves them
    features = torch.randn(BATCH, config.num_mel_bins, frames, generator=generator)
    return {"input_features": features, "labels": labels}


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread for these tiny models: on a busy machine each parallel op otherwise
    waits for a descheduled worker thread, about 10 ms an op. The reference and the
    checkpointed model both run with it, so the comparison is unchanged."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclasses.dataclass
class Reference:
    """An unwrapped model, its inputs, and its loss and gradients for one seeded step."""

    model: nn.Module
    inputs: dict[str, torch.Tensor]
    loss: torch.Tensor
    grads: list[torch.Tensor | None]
    layers: int
    name: str


@pytest.fixture(scope="module", params=list(ARCHS))
def reference(request: pytest.FixtureRequest) -> Reference:
    """Built and run once per architecture; each test checkpoints a deep copy."""
    arch = ARCHS[request.param]
    model = _build(arch)
    inputs = _inputs(arch, model)
    with torch.no_grad():  # Dropout is really on: another seed, another loss
        torch.manual_seed(SEED + 1)
        other = model(**inputs).loss
    loss, grads = hf_step(model, inputs)
    assert not torch.equal(loss, other)
    assert all(g is not None for g in grads)
    return Reference(model, inputs, loss, grads, arch.layers, request.param)


def _record_calls(layers: list[nn.Module]) -> list[list[tuple[str, bool]]]:
    """Per layer, each call of a submodule with parameters: its name and whether it was a
    recomputation. transformers checkpoints a layer's ``forward``, inside its hooks, so the
    hooks go on what runs inside it."""
    calls: list[list[tuple[str, bool]]] = []
    for layer in layers:
        record: list[tuple[str, bool]] = []
        calls.append(record)
        for name, module in layer.named_modules():
            if name and any(True for _ in module.parameters(recurse=False)):
                module.register_forward_hook(
                    lambda *_, r=record, n=name: r.append((n, xla_wrap.is_recomputing()))
                )
    return calls


def _assert_each_layer_recomputed(calls: list[list[tuple[str, bool]]], layers: int) -> None:
    assert len(calls) == layers
    for record in calls:
        forward = [name for name, again in record if not again]
        recomputed = [name for name, again in record if again]
        assert record == [(n, False) for n in forward] + [(n, True) for n in recomputed]
        # Recomputed from the start of the layer; the engine may stop early (its Rule 5), once
        # the last tensor saved for backward exists again.
        assert forward and recomputed and recomputed == forward[: len(recomputed)]


def _assert_trains_bitwise_alike(reference: Reference, twin: nn.Module) -> None:
    loss, grads = hf_step(twin, reference.inputs)
    assert torch.equal(loss, reference.loss)
    assert len(grads) == len(reference.grads)
    for got, expected in zip(grads, reference.grads, strict=True):
        assert got is not None and expected is not None
        assert torch.equal(got, expected)


def test_gradient_checkpointing_enable_is_bitwise(reference: Reference) -> None:
    twin = copy.deepcopy(reference.model)
    xla_hf.gradient_checkpointing_enable(twin)
    layers = layers_of(twin)
    checkpointed = [
        m
        for m in twin.modules()
        if isinstance(m, modeling_layers.GradientCheckpointingLayer) and m.gradient_checkpointing
    ]
    assert {id(m) for m in checkpointed} == {id(m) for m in layers}
    calls = _record_calls(layers)
    _assert_trains_bitwise_alike(reference, twin)
    _assert_each_layer_recomputed(calls, reference.layers)


def test_apply_activation_checkpointing_by_type_is_bitwise(reference: Reference) -> None:
    twin = copy.deepcopy(reference.model)
    layers = layers_of(twin)
    calls = _record_calls(layers)
    classes = {type(layer) for layer in layers}
    xla_wrap.apply_activation_checkpointing(twin, xla_wrap.wrap_policies.by_type(*classes))
    wrappers = [m for m in twin.modules() if isinstance(m, xla_wrap.CheckpointWrapper)]
    assert len(wrappers) == len(layers)
    # Code that finds layers by class, or by class name (transformers' FSDP wrapping), still
    # finds every one of them, in place.
    found = [m for m in twin.modules() if isinstance(m, tuple(classes))]
    assert [id(m) for m in found] == [id(m) for m in layers] == [id(m) for m in wrappers]
    for cls in classes:
        by_name = get_module_class_from_name(twin, cls.__name__)
        assert by_name is not None and issubclass(by_name, cls)
    _assert_trains_bitwise_alike(reference, twin)
    _assert_each_layer_recomputed(calls, reference.layers)


# The layer lists a scan refuses, and why (docs/scan.md): Gemma2's attention reads its
# `sliding_window`, which alternates between layers (refused when called); T5's first block
# alone holds the relative attention bias (no list found); layers returning a tuple (GPT-Neo,
# Falcon, Bloom: refused when called; GPT-Neo's alternating local/global attention is a
# per-layer buffer, which a scan brings per layer).
_NOT_SCANNED: dict[str, type[Exception]] = {
    "gemma2": xla_wrap.CheckpointError,
    "gpt_neo": xla_wrap.CheckpointTypeError,
    "t5": xla_wrap.CheckpointValueError,
    "falcon": xla_wrap.CheckpointTypeError,
    "bloom": xla_wrap.CheckpointTypeError,
}


def test_scanned_with_stacked_parameters_is_bitwise_or_refused(reference: Reference) -> None:
    """``scan=True, stack_parameters=True``: off XLA the scanned stack is the checkpointed
    loop, run on each layer's slices of the stacked parameters; its loss and every per-layer
    gradient (by state_dict name) are the unwrapped model's, bitwise, with Dropout."""
    from xla_wrap import internal

    twin = copy.deepcopy(reference.model)
    if reference.name in _NOT_SCANNED:
        with pytest.raises(_NOT_SCANNED[reference.name]):
            xla_hf.gradient_checkpointing_enable(twin, scan=True, stack_parameters=True)
            hf_step(twin, reference.inputs)
        return
    xla_hf.gradient_checkpointing_enable(twin, scan=True, stack_parameters=True)
    assert any(getattr(m, "parameters_stacked", False) for m in twin.modules())
    assert list(twin.state_dict()) == list(reference.model.state_dict())
    loss, _ = hf_step(twin, reference.inputs)
    assert torch.equal(loss, reference.loss)
    expected = internal.per_layer_gradients(reference.model)
    got = internal.per_layer_gradients(twin)
    assert got.keys() == expected.keys()
    for key, grad in expected.items():  # None only for frozen ones (Marian's positions)
        assert (got[key] is None) if grad is None else torch.equal(got[key], grad), key
