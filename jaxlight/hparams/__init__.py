"""Hyperparameters: `save_hyperparameters()`, `module.hparams.x`, rebuilding from a checkpoint.

Owns `_hparams` (the mixin `TrainModule` and `DataModule` share, and the record checkpoints
carry). Imports nothing of jaxlight but `_errors`, so that data, checkpoints and the module can
all read it.
"""
