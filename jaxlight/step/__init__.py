"""The compiled step's pure functions, assembled once from the module and the callbacks.

Owns `_step` (the one place step transforms are composed), `_user_step` (calls into the user's
steps, errors naming the batch) and `_microbatch` (microbatch scans: gradient accumulation's
layouts, which the strategies call). May import `metrics`, `state`, `schedules`, `sharding`,
`nn` and the root modules; `strategies` compile what it builds, and `optim` routes to it.
"""
