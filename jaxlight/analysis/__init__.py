"""Reading compiled programs: collectives in HLO text, FLOPs with loops in full, peak FLOP/s.

Owns `_hlo` (collectives of a compiled step), `_hlo_text` (parsing optimized HLO text) and
`_flops` (FLOPs and peak FLOP/s). Imports nothing of jaxlight but `_errors`: the strategies,
callbacks (ThroughputMonitor) and `Fit.plan` read compiled steps through it.
"""
