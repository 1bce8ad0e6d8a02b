"""The train state: one pytree, created abstractly first and then directly in its shards.

Owns `_state` (`TrainState`, the abstract model, `ModelSpec`) and `_frozen` (parameters a
module does not train, kept outside the optimizer). May import `distributed` (device groups)
and the root modules.
"""
