"""The checkpoint core: options, the forward's record, both engines, save-policy selection, the
barrier, RNG replay, offload, the wrapper, and applying it to a model."""
