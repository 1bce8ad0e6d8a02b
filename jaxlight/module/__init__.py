"""The module a user subclasses: `TrainModule`, its Lightning-named hooks, the porting checks.

Owns `_module` (`TrainModule`), `_hooks` (`ModuleHooks`, the hooks with Lightning's names) and
`_porting` (Lightning habits refused at setup with the jaxlight form). May import
`callbacks` (the logger type), `checkpoint` (`load_from_checkpoint`), `hparams`, `metrics`,
`step` (the trace-time guards an assignment to `self` consults) and the root modules; only
the fit, the recipes and the CLI import it.
"""
