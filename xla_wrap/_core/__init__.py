"""The checkpoint core: the engine (engine.py, its rules at its head), where a checkpoint
starts (checkpoint.py), options, save-policy selection, the modules' tensors, the public
barrier, the wrapper, and applying it to a model."""
