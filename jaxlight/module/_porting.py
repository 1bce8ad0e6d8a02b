"""Lightning habits that jaxlight cannot run as written, refused at setup with the jaxlight form.

A LightningModule ported by renaming mostly just works (DESIGN.md). What cannot carry over —
the model living on `self`, `(batch, batch_idx)` steps, `manual_backward` — fails deep inside
tracing with a message about JAX (`'Linear' object is not subscriptable`). `check_module` looks
at the module's class before anything is traced and says what to write instead, pointing to
the porting guide.

Example:
    >>> import jaxlight as jl
    >>> class Lit(jl.TrainModule):
    ...     def training_step(self, batch, batch_idx):
    ...         return batch
    >>> check_module(Lit())
    Traceback (most recent call last):
    ...
    jaxlight._errors.PortingError: Lit.training_step(self, batch, batch_idx) has Lightning's ...
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from flax import nnx

from jaxlight._errors import ConfigurationError, PortingError, suggest

#: Where every message points.
GUIDE = "docs/porting.md (section 'What jaxlight refuses')"

#: The step methods and the arguments jaxlight passes them.
STEPS = ("training_step", "validation_step", "test_step", "predict_step")

#: Parameter names that only a Lightning step signature has.
LIGHTNING_STEP_ARGS = ("batch_idx", "batch_nb", "batch_index", "dataloader_idx",
                       "dataloader_iter")

#: Lightning methods with no jaxlight counterpart on the module, and what to do instead.
LIGHTNING_METHODS = {
    "forward": "the model is an nnx.Module built by configure_model(self, rngs); put forward's "
               "computation into that module's __call__ and call model(x) in the steps",
    "backward": "gradients are taken by jax inside the compiled step; remove backward",
    "optimizer_step": "the optimizer is the optax transformation configure_optimizers returns; "
                      "change the update with optax (optax.chain, optax.MultiSteps) or a "
                      "callback's transform_optimizer / transform_step",
    "optimizer_zero_grad": "there are no gradient buffers to zero in JAX; remove it",
    "lr_scheduler_step": "return {'optimizer': tx, 'lr_scheduler': {'scheduler': schedule, "
                         "'interval': 'step' | 'epoch'}} from configure_optimizers",
    "configure_gradient_clipping": "use Fit(gradient_clip_val=...) or "
                                   "callbacks.GradientClipping",
    "configure_sharded_model": "build the model in configure_model(self, rngs); strategies "
                               "shard it as it is created",
    "manual_backward": "with automatic_optimization = False, training_step(self, model, "
                       "batch, opt) calls opt.step('name', loss_fn), which takes the gradient "
                       "and applies that optimizer's update",
    "toggle_optimizer": "opt.step('name', loss_fn) differentiates only the parameters bound "
                        "to that optimizer (its 'params' entry in configure_optimizers)",
    "untoggle_optimizer": "opt.step('name', loss_fn) differentiates only the parameters bound "
                          "to that optimizer; remove it",
}


def _where(module: Any, name: str) -> str:
    return f"{type(module).__name__}.{name}"


def _overrides(module: Any, name: str) -> bool:
    """Whether the module's class defines `name` itself (not jaxlight's TrainModule)."""
    for cls in type(module).__mro__:
        if cls is object or cls.__module__ == "jaxlight.module._module":  # TrainModule's defaults
            return False
        if name in vars(cls):
            return True
    return False


def _signature_text(fn) -> str:
    try:
        return str(inspect.signature(fn)).replace("(", "(self, ", 1).replace("(self, )", "(self)")
    except (TypeError, ValueError):
        return "(...)"


def check_step_signature(module: Any, name: str) -> None:
    """Refuses a step that cannot be called as `step(model, batch)` (a manual-optimization
    training_step: `step(model, batch, opt)`)."""
    fn = getattr(module, name)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to read
    params = list(sig.parameters.values())
    names = [p.name for p in params]
    # validation/test/predict_step(self, model, batch, dataloader_idx=0): jaxlight passes the
    # loader's index, as Lightning does, when several loaders are given.
    takes_idx = (name != "training_step" and names[:2] == ["model", "batch"]
                 and names[2:3] == ["dataloader_idx"])
    lightning = (names[:1] == ["batch"]
                 or any(n in LIGHTNING_STEP_ARGS for n in names
                        if not (takes_idx and n == "dataloader_idx")))
    if lightning:
        raise PortingError(
            f"{_where(module, name)}{_signature_text(fn)} has Lightning's step signature; "
            f"jaxlight passes the model and the batch: write {name}(self, model, batch) and "
            f"call model(x) where Lightning calls self(x). There is no batch_idx (steps are "
            f"compiled once; read fit.batch_idx in a callback). See {GUIDE}."
        )
    manual = name == "training_step" and getattr(module, "automatic_optimization", True) is False
    args = ("model", "batch", "opt") if manual else ("model", "batch")
    try:
        sig.bind(*[None] * len(args))
    except TypeError:
        why = (" (automatic_optimization = False: the step receives the optimizers as `opt` and "
               "calls opt.step('name', loss_fn))" if manual else "")
        raise PortingError(
            f"{_where(module, name)}{_signature_text(fn)} cannot be called as "
            f"{name}({', '.join(args)}), which is how jaxlight calls it{why}: write "
            f"{name}(self, {', '.join(args)}). See {GUIDE}."
        ) from None


#: List and set methods that collect a step's values on `self` (Lightning's epoch-end pattern).
_COLLECTING = ("append", "extend", "insert", "add")

#: What to do instead of collecting a step's values on `self`.
COLLECTING_FIX = (
    "a step is traced once and compiled, so what it appends is a tracer, not a value per "
    "batch. Log it instead: self.log('name', value, on_epoch=True) (its mean over the epoch, "
    "weighted by batch size, is in fit.callback_metrics['name'] at on_train_epoch_end / "
    "on_validation_epoch_end), or return it in the step's metrics dict")


class _SelfUse(ast.NodeVisitor):
    """Finds `self(...)`, `self.forward(...)`, `self.parameters()` and `.backward()` calls (and
    with `logging=True`, `self.log(...)` / `self.log_dict(...)`)."""

    def __init__(self, self_name: str, logging: bool = False, collecting: bool = True):
        self.self_name = self_name
        self.logging = logging
        self.collecting = collecting  # in a step: values appended to lists on self
        self.found: list[tuple[str, int]] = []

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id == self.self_name:
            self.found.append(("self(...)", node.lineno))
        elif isinstance(func, ast.Attribute):
            owner = func.value
            if isinstance(owner, ast.Name) and owner.id == self.self_name:
                flagged = ("forward", "parameters", "named_parameters", "manual_backward")
                if self.logging:
                    flagged += ("log", "log_dict")
                if func.attr in flagged:
                    self.found.append((f"self.{func.attr}(...)", node.lineno))
            elif func.attr == "backward" and not node.args and not node.keywords:
                self.found.append(("<tensor>.backward()", node.lineno))
            elif (self.collecting and func.attr in _COLLECTING and isinstance(owner, ast.Attribute)
                  and isinstance(owner.value, ast.Name) and owner.value.id == self.self_name):
                # Lightning's `self.training_step_outputs.append(loss)`, read in an epoch-end
                # hook: inside a compiled step the value is a tracer, not one per batch.
                self.found.append((f"self.{owner.attr}.{func.attr}(...)", node.lineno))
        self.generic_visit(node)


def _self_uses(fn, logging: bool = False, collecting: bool = True) -> list[tuple[str, int]]:
    """Lightning-only uses of `self` in a method's source ([] when the source is unavailable)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
        _, first_line = inspect.getsourcelines(fn)
    except (OSError, TypeError, SyntaxError):
        return []  # defined in a REPL or exec'd text: the trace-time errors still apply
    func = tree.body[0] if tree.body else None
    if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef) or not func.args.args:
        return []
    visitor = _SelfUse(func.args.args[0].arg, logging, collecting)
    visitor.visit(func)
    return [(what, first_line + line - 1) for what, line in visitor.found]


_SELF_USE_FIX = {
    "self(...)": "call the model the step receives: model(x)",
    "self.forward(...)": "call the model the step receives: model(x)",
    "self.parameters(...)": "optax transformations need no parameter list: return "
                            "optax.adam(lr)",
    "self.named_parameters(...)": "optax transformations need no parameter list; select "
                                  "parameters with optax.masked or TrainModule.trainable",
    "self.manual_backward(...)": "with automatic_optimization = False, write "
                                 "training_step(self, model, batch, opt) and call "
                                 "opt.step('name', loss_fn): it takes the gradient and applies "
                                 "that optimizer's update",
    "<tensor>.backward()": "return the loss; the compiled step takes gradients with jax.grad",
    "self.log(...)": "self.log records traced values while a step is traced, so it works in "
                     "training_step / validation_step / test_step (and helpers they call; "
                     "on_epoch=True aggregates over the epoch), and host values in "
                     "on_train_batch_start / on_train_batch_end (logged with that step's "
                     "metrics); from another hook, send host values with "
                     "self.trainer.log_metrics({...}) (fit.log_metrics in a callback)",
}
_SELF_USE_FIX["self.log_dict(...)"] = _SELF_USE_FIX["self.log(...)"]

#: Hooks where `self.log` records host values, logged with that training step's metrics.
BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")

#: Methods that never run inside a traced step: `self.log` there has no step to record into.
OUTSIDE_STEPS = ("configure_model", "configure_optimizers", "setup", "teardown",
                 "prepare_data")


def _nn_attributes(module: Any) -> list[str]:
    """Instance attributes holding layers (an nnx.Module or a torch.nn.Module)."""
    found = []
    for name, value in vars(module).items():
        if name.startswith("_"):
            continue
        torch_layer = any(c.__module__.startswith("torch.nn") and c.__name__ == "Module"
                          for c in type(value).__mro__)
        if isinstance(value, nnx.Module) or torch_layer:
            found.append(name)
    return found


def check_module(module: Any) -> None:
    """Refuses Lightning habits jaxlight cannot run, before anything is traced.

    Raises:
        PortingError: naming the habit, where it is, the jaxlight form, and the porting guide.
    """
    cls = type(module).__name__
    for name, fix in LIGHTNING_METHODS.items():
        if _overrides(module, name):
            fn = getattr(module, name)
            if name == "forward" and _takes_model(fn):
                continue  # a helper forward(self, model, x) is the jaxlight form already
            raise PortingError(
                f"{cls}.{name}{_signature_text(fn)} is a LightningModule method jaxlight never "
                f"calls: {fix}. See {GUIDE}."
            )
    # Layers on self with no configure_model is Lightning's layout; with one, a module held
    # on self is a backbone configure_model builds on (a pretrained model under LoRA).
    layers = [] if _overrides(module, "configure_model") else _nn_attributes(module)
    if layers:
        first = layers[0]
        raise PortingError(
            f"{cls} holds layers as attributes ({', '.join('self.' + n for n in layers)}), as a "
            "LightningModule does; jaxlight builds the model in configure_model(self, rngs) -> "
            f"nnx.Module and passes it to every step as `model` (so self.{first}(x) becomes "
            f"model.{first}(x) on the module configure_model returns). Keep only "
            f"hyperparameters on the TrainModule. See {GUIDE}."
        )
    for name in STEPS:
        if _overrides(module, name):
            check_step_signature(module, name)
    hooks = [n for n in dir(type(module)) if n.startswith("on_") or n in OUTSIDE_STEPS]
    for name in (*STEPS, *hooks):
        if not _overrides(module, name) or not callable(getattr(module, name, None)):
            continue
        in_step = name in STEPS
        # self.log in a training batch's hooks logs host values with that step's metrics.
        logging = not in_step and name not in BATCH_HOOKS
        for what, line in _self_uses(getattr(module, name), logging=logging,
                                     collecting=in_step):
            fix = _SELF_USE_FIX.get(what, COLLECTING_FIX)
            if not in_step and what in ("self(...)", "self.forward(...)"):
                fix = "outside a step, run the current model as self.model(x)"
            raise PortingError(
                f"{cls}.{name} uses {what} (line {line}), a LightningModule habit: {fix}. "
                f"See {GUIDE}."
            )


def _takes_model(fn) -> bool:
    try:
        return "model" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


#: Lightning `Trainer` arguments `Fit` does not take, and the jaxlight way.
TRAINER_ARGS = {
    "accelerator": "jaxlight runs on the devices JAX sees (JAX_PLATFORMS=cpu|cuda|tpu); "
                   "choose among them with Fit(devices=...)",
    "gpus": "Fit(devices=N)",
    "tpu_cores": "Fit(devices=N)",
    "num_processes": "Fit(devices=N)",
    "auto_select_gpus": "Fit(devices=N)",
    "num_nodes": "several hosts join one job: jaxlight launch --nnodes N, torchrun or SLURM "
                 "(docs/distributed.md)",
    "deterministic": "jaxlight is deterministic for a given Fit(seed=...) on a given device "
                     "layout; on GPUs also set XLA_FLAGS=--xla_gpu_deterministic_ops=true",
    "benchmark": "XLA autotunes its kernels itself; remove it",
    "profiler": "add callbacks.Profiler(...) to callbacks=[...]",
    "detect_anomaly": "add callbacks.NonFiniteGuard(...) (or jax.config.update("
                      "'jax_debug_nans', True))",
    "min_epochs": "not supported: EarlyStopping stops when its monitor stalls; train longer "
                  "with max_epochs",
    "min_steps": "not supported: EarlyStopping stops when its monitor stalls; train longer "
                 "with max_steps",
    "overfit_batches": "limit_train_batches=n, and pass the same batches as validation data",
    "sync_batchnorm": "batch statistics are computed over the global batch under every SPMD "
                      "strategy already; remove it",
    "use_distributed_sampler": "jaxlight.data.ArrayLoader gives each process its share "
                               "itself; remove it",
    "replace_sampler_ddp": "jaxlight.data.ArrayLoader gives each process its share itself; "
                           "remove it",
    "reload_dataloaders_every_n_epochs": "not supported: pass data that reshuffles itself per "
                                         "epoch (jaxlight.data.ArrayLoader, Grain)",
    "limit_test_batches": "pass fewer batches to Fit.test",
    "limit_predict_batches": "pass fewer batches to Fit.predict",
    "plugins": "not supported: precision, clipping and accumulation are callbacks",
    "inference_mode": "evaluation never takes gradients; remove it",
    "barebones": "enable_progress_bar=False, enable_model_summary=False, logger=False",
}


def refuse_fit_kwargs(unknown: dict[str, Any], valid: list[str]) -> None:
    """Refuses keyword arguments `Fit` does not take: Lightning's with the jaxlight form,
    others with a did-you-mean.

    Raises:
        PortingError: for a Lightning `Trainer` argument.
        ConfigurationError: for any other unknown name.
    """
    for name in unknown:
        if name in TRAINER_ARGS:
            raise PortingError(
                f"Fit({name}=...) is a Lightning Trainer argument jaxlight does not take: "
                f"{TRAINER_ARGS[name]}. See {GUIDE}."
            )
    raise unknown_keywords("Fit", unknown, valid)


def unknown_keywords(who: str, unknown, valid: list[str]) -> ConfigurationError:
    """The error for keyword arguments `who` does not take, each with a did-you-mean."""
    names = sorted(unknown)
    hints = "".join(suggest(n, valid) for n in names)
    return ConfigurationError(
        f"{who} got unknown keyword argument(s) {names}.{hints} {who} takes {', '.join(valid)}."
    )
