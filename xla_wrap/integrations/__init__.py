"""Drop-in checkpointing for other libraries' models. Each submodule imports its library only
when used: `xla_wrap.integrations.transformers` needs the `hf` extra."""
