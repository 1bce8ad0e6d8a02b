"""How arrays lie on the mesh: logical axes, batch layout and checks, per-replica random draws.

Owns `_layout` (the one logical-axis lookup and batch-divisibility check), `_batch` (batch
signatures, per-process agreement and placement) and `_replica_rng` (each data-parallel
replica's rows of one device's draw). May import `distributed` and the root modules; `nn`,
`step`, `strategies`, the callbacks and the fit build on it.
"""
