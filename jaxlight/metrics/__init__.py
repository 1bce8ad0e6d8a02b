"""Metrics: `self.log` inside traced steps, training metrics, epoch sums, exact evaluation totals.

Owns `_metrics` (what a step logs, collected while it is traced), `_host_logs` (what the
training batch hooks log, with their step's metrics) and `_eval_totals` (weighted means and clu
merges accumulated on device, one batch at a time). Imports nothing of jaxlight
but `_errors`.
"""
