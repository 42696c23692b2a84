"""FSDP glue: units built around checkpoints, and the hooks that keep FSDP out of the core."""
