"""Session: the device side of a Fit — spec, shardings, optimizer, state, compiled steps.

One `Session` per `Fit`. `setup(module)` fixes the module's abstract spec, the optimizer and
the state's shardings (once per module); every step kind is compiled at most once through it
(`compile_train_step`, `compile_predict_step`; `compile_eval_step` once per batch shape),
counted in `compile_counts` and timed in `compile_times`. It also holds the current `TrainState`.
The plan (`jaxlight._fit._plan`), `ModelSummary` and checkpoint restore read it through these
public names.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlight import strategies as _strategies
from jaxlight._errors import ConfigurationError
from jaxlight.callbacks._base import StepTransform
from jaxlight.metrics import _eval_totals, _metrics
from jaxlight.module._module import TrainModule
from jaxlight.optim import build_optimizer, build_train_step  # named & manual optimizers too
from jaxlight.schedules._configure import ScheduleUpdate
from jaxlight.sharding import _batch
from jaxlight.state._state import TrainState, make_init_fn, model_spec, split_model
from jaxlight.step import _guards
from jaxlight.step._step import build_eval_step, build_params_transform, build_predict_step


def abstract_global_batch(batch: Any) -> Any:
    """The global batch's shapes, from this process's share (equal shares per process)."""
    n = jax.process_count()

    def one(x):
        x = np.asarray(x)
        return jax.ShapeDtypeStruct((x.shape[0] * n, *x.shape[1:]) if x.ndim else (), x.dtype)

    return jax.tree.map(one, batch)


class Session:
    """Owns what a module needs on the devices under one strategy and one callback list.

    Args:
        strategy: the resolved `jaxlight.strategies.Strategy`.
        callbacks: the Fit's callbacks (their step pieces shape the optimizer and the step).
        seed: seeds parameter initialization.
        devices: the devices `Fit(devices=...)` selected (None: all), given to the strategy's
            `setup`.
    """

    def __init__(self, strategy, callbacks, seed: int, devices=None):
        self.devices = devices
        #: The strategy in use; under `strategies.Auto`, the chosen one once it has chosen.
        self.strategy = strategy
        #: The `strategies.Auto` choosing the layout (None: a fixed strategy). Once it has
        #: chosen, `strategy` is the chosen one and `auto.choice` the candidate table.
        self.auto = strategy if isinstance(strategy, _strategies.Auto) else None
        self.callbacks = callbacks
        self.seed = seed
        #: The module set up last (None before the first `setup`).
        self.module: TrainModule | None = None
        #: The current train state (device arrays in the strategy's layout), or None.
        self.state: TrainState | None = None
        #: Compiles per step kind ("init", "train", "eval:validation_step", ...).
        self.compile_counts: dict[str, int] = {}
        #: Seconds spent compiling per step kind ("init" includes running the initializer).
        self.compile_times: dict[str, float] = {}
        self._spec = None
        self._spec_module: TrainModule | None = None
        self._shardings: TrainState | None = None
        self._tx = None
        self.schedule: ScheduleUpdate | None = None
        self._params_transform = None
        self._compiled: dict[Any, Any] = {}
        #: What `self.log` in the training step reports (filled when the step is traced).
        self.log_spec = _metrics.LogSpec()
        self._eval_specs: dict[str, _eval_totals.EvalSpec] = {}
        #: Loaders each evaluation method last ran over (several: names get /dataloader_idx_N).
        self.eval_loaders: dict[str, int] = {}
        self._current: tuple[TrainState, nnx.Module] | None = None

    # -- set-up ------------------------------------------------------------------------------

    def setup(self, module: TrainModule, stage: str = "fit") -> None:
        """Builds the mesh (once), then the spec, optimizer and shardings for `module`.

        A different module than the last one rebuilds them and forgets the compiled steps.
        Under `strategies.Auto`, `fit` and `plan` (`stage`) may leave the layout to
        `choose_layout` with their first batch.
        """
        self.module = module
        if self.strategy.mesh is None:
            self.strategy.setup(self.devices)
        # An attribute a compiled step read changed between stages: compile them again.
        if self._spec is None or self._spec_module is not module or _guards.changed_reads(module):
            tx, scheduler = build_optimizer(module, self.callbacks)
            self._tx = tx
            #: The lr_scheduler of configure_optimizers' dict, run between steps (or None).
            self.schedule = (None if scheduler is None
                             else ScheduleUpdate(scheduler, self.compile_state_update))
            self._params_transform = build_params_transform(self.callbacks)
            self._spec = model_spec(module, tx, self.seed, self._params_transform)
            self._spec_module = module
            self._compiled = {}
            _guards.forget_reads(module)  # what earlier compiled steps read no longer matters
            self.log_spec = _metrics.LogSpec()
            self._eval_specs = {}
            self.eval_loaders = {}
            self._shardings = None
            if self.auto is not None:
                self.strategy = self.auto  # a new model: choose again
            # fit and plan can wait for a batch to measure with (unless auto's shortcut holds)
            self.choose_layout(None, defer=stage in ("fit", "plan"))

    def rebuild(self, module: TrainModule) -> None:
        """Sets `module` up again from `configure_optimizers` (a callback changed what it
        returns before the first step: `LearningRateFinder` setting the module's rate)."""
        self._spec_module = None
        self.setup(module, "fit")

    def choose_layout(self, abstract_batch: Any, defer: bool = False) -> None:
        """Fixes the state's shardings; `strategies.Auto` first picks the layout, compiling
        candidate train steps for `abstract_batch` (None: from state bytes alone)."""
        if self._shardings is not None:
            return
        if self.auto is not None:
            def make_step(strategy):
                return build_train_step(self.module, self._spec.graphdef, self._tx,
                                        self.callbacks, strategy, frozen=self._spec.frozen)

            chosen = self.auto.choose(self._spec.abstract_state, self._spec.logical_axes,
                                      abstract_batch, make_step, defer=defer)
            if chosen is None:
                return  # decided with the first batch
            self.strategy = chosen
            self.compile_counts["auto"] = self.auto.choice.compiles
            self.compile_times["auto"] = self.auto.choice.seconds
        # (state_shardings also warns about rules that place nothing)
        self._shardings = self.strategy.state_shardings(
            self._spec.abstract_state, self._spec.logical_axes
        )

    @property
    def spec(self):
        """The module's abstract spec (`jaxlight.state._state.ModelSpec`): graphdefs, abstract
        state,
        logical axes, frozen mask."""
        return self._spec

    @property
    def shardings(self) -> TrainState | None:
        """The train state's shardings (a `TrainState` of shardings)."""
        return self._shardings

    @property
    def optimizer(self):
        """The optax transformation the step applies (callbacks' pieces included)."""
        return self._tx

    def check_schedule_data(self, val_data) -> None:
        """Refuses a fit without validation data when the lr_scheduler monitors a metric."""
        schedule = self.schedule
        if schedule is not None and schedule.scheduler.monitor and val_data is None:
            raise ConfigurationError(
                f"{type(self.module).__name__}.configure_optimizers' lr_scheduler monitors "
                f"{schedule.scheduler.monitor!r}, a validation metric, but Fit.fit got no "
                "val_data. Pass val_data, or use a schedule that reads no metric."
            )

    # -- compile bookkeeping -----------------------------------------------------------------

    @contextlib.contextmanager
    def compiling(self, kind: str):
        """Counts one compile of `kind` and adds its wall time to `compile_times`."""
        self.compile_counts[kind] = self.compile_counts.get(kind, 0) + 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self.compile_times[kind] = (self.compile_times.get(kind, 0.0)
                                        + time.perf_counter() - start)

    # -- state -------------------------------------------------------------------------------

    def init_state(self) -> TrainState:
        """Creates a fresh train state, each array directly in its target sharding."""
        init = make_init_fn(self.module, self._tx, self.seed, self._params_transform)
        with self.compiling("init"):
            return self.strategy.init_state(init, self._spec.abstract_state, self._shardings)

    def evaluation_state(self, state: TrainState) -> TrainState:
        """`state` as validation during fit and the final model read it: each callback's
        `evaluation_state` in order (the averaged parameters of `WeightAveraging`)."""
        for cb in self.callbacks:
            if type(cb).evaluation_state is not StepTransform.evaluation_state:
                state = cb.evaluation_state(state)
        return state

    def state_from_model(self, model: nnx.Module) -> TrainState:
        """Places an existing model's variables into this strategy's layout (no optimizer)."""
        _, params, rest = split_model(model, self.module.trainable)
        state = TrainState(step=np.zeros((), np.int32), params=params, opt_state=None, rest=rest)
        return self.strategy.from_canonical(state, self.state_shardings(state))

    def state_shardings(self, state: TrainState) -> TrainState:
        """The shardings of `state`, which may lack the optimizer (evaluation from a model)."""
        if state.opt_state is None:
            return self._shardings.replace(opt_state=None)
        return self._shardings

    def canonical_abstract(self, state: TrainState) -> TrainState:
        """Shapes of `state` as the model sees them (without DDP's device axis)."""
        shapes = jax.eval_shape(self.strategy.to_canonical, state)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), shapes)

    def model(self, state: TrainState) -> nnx.Module:
        """The `nnx.Module` holding `state`'s parameters (in their device layout)."""
        canonical = self.strategy.to_canonical(state)
        return nnx.merge(self._spec.graphdef, canonical.params, canonical.rest)

    def live_model(self, fresh: bool) -> nnx.Module | None:
        """`module.model` while a stage runs: the current state's model, built on first access
        per state. Before the state exists, the state the stage would create anyway is created
        now (`fresh`, a fit: always; evaluation: unless the module has an assigned model, which
        `module.model` then returns); None before the layout is known (`strategies.Auto`)."""
        if (self.state is None and self._shardings is not None
                and (fresh or self.module.assigned_model is None)):
            self.state = self.init_state()
        state = self.state
        if state is None:
            return None
        if self._current is None or self._current[0] is not state:
            self._current = (state, self.model(state))
        return self._current[1]

    @property
    def progress_bar_metrics(self) -> set[str]:
        """Names logged with `prog_bar=True` by the traced steps (training and evaluation);
        an evaluation over several loaders shows each name as `<name>/dataloader_idx_N`, as
        its metrics are named (Lightning's progress bar too)."""
        return self._step_names_with("prog_bar")

    @property
    def logger_hidden(self) -> set[str]:
        """Names logged with `logger=False` by the traced steps, as `progress_bar_metrics`
        names them: kept from the loggers and `logged_metrics`."""
        return self._step_names_with("hidden")

    def _step_names_with(self, attr: str) -> set[str]:
        names = set(getattr(self.log_spec, attr))
        for key, spec in self._eval_specs.items():
            method, idx = (key, None) if isinstance(key, str) else key
            n = self.eval_loaders.get(method, 1)
            if n <= 1:
                names.update(getattr(spec, attr))
            else:
                names.update(f"{name}/dataloader_idx_{i}" for name in getattr(spec, attr)
                             for i in (range(n) if idx is None else (idx,)))
        return names

    # -- compiled steps ----------------------------------------------------------------------

    @property
    def compiled_train_step(self) -> Any | None:
        """The compiled training step, once built (None before)."""
        entry = self._compiled.get("train")
        return None if entry is None else entry[0]

    @property
    def train_batch_shardings(self) -> Any | None:
        """The batch shardings the compiled training step takes, once built (None before)."""
        entry = self._compiled.get("train")
        return None if entry is None else entry[1]

    def compile_train_step(self, abstract_batch: Any, *, keep: bool = True,
                           kind: str = "train"):
        """The compiled training step and the batch shardings for `abstract_batch`.

        Compiled once and kept; `keep=False` (the plan) compiles afresh and keeps nothing, so
        that a later fit compiles for its own batches. `kind="train_partial"` is the one more
        step kind for a loader's last partial batch (counted apart in `compile_counts`).
        """
        if keep and kind in self._compiled:
            return self._compiled[kind]
        step = build_train_step(self.module, self._spec.graphdef, self._tx, self.callbacks,
                                self.strategy, frozen=self._spec.frozen, log_spec=self.log_spec)
        batch_sh = self.strategy.batch_shardings(abstract_batch)
        _batch.check_batch_layout(batch_sh, abstract_batch, "training batch")
        with self.compiling(kind):
            compiled = self.strategy.compile(
                step,
                (self._spec.abstract_state, abstract_batch),
                in_shardings=(self._shardings, batch_sh),
                out_shardings=(self._shardings, self.strategy.replicated()),
                donate_argnums=(0,),
            )
        if keep:
            self._compiled[kind] = (compiled, batch_sh)
        return compiled, batch_sh

    def compile_state_update(self, fn, extra_abstract: tuple):
        """Compiles `fn(state, *extra) -> state` between steps (the state donated, the extra
        scalars replicated); the scheduler's updates at validation and epoch ends."""
        rep = self.strategy.replicated()
        with self.compiling("schedule"):
            return self.strategy.compile(
                fn, (self._spec.abstract_state, *extra_abstract),
                in_shardings=(self._shardings, *(rep for _ in extra_abstract)),
                out_shardings=self._shardings, donate_argnums=(0,))

    def eval_spec(self, method: str, prefix: str,
                  dataloader_idx: int | None = None) -> _eval_totals.EvalSpec:
        """What `method` reports (filled when it is traced); kept with its compiled steps."""
        key = method if dataloader_idx is None else (method, dataloader_idx)
        if key not in self._eval_specs:
            self._eval_specs[key] = _eval_totals.EvalSpec(prefix)
        return self._eval_specs[key]

    def compile_eval_step(self, method: str, prefix: str, abstract_batch: Any, state: TrainState,
                          sharded: bool, local_batch: Any = None,
                          dataloader_idx: int | None = None):
        """`(compiled, batch_sh, zero_totals)` for `method` over whole batches of this shape.

        One compile per distinct global batch shape and layout (usually two: the full batches
        and a short last one). `sharded=False` gives the batch whole to every device (a batch
        the data-parallel degree does not divide). `local_batch` (this process's share) is
        checked for agreement between processes before a sharded compile.
        """
        key = ("eval", method, state.opt_state is None, sharded,
               tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(abstract_batch)),
               jax.tree.structure(abstract_batch), dataloader_idx)
        if key not in self._compiled:
            self._compiled[key] = self._compile_eval_uncached(
                method, self.eval_spec(method, prefix, dataloader_idx), abstract_batch, state,
                sharded, local_batch, dataloader_idx)
        return self._compiled[key]

    def _compile_eval_uncached(self, method: str, spec, abstract_batch: Any, state: TrainState,
                               sharded: bool, local_batch: Any,
                               dataloader_idx: int | None = None):
        strategy = self.strategy
        if sharded:
            if local_batch is not None:
                _batch.check_batch_agreement(local_batch, f"{method} batch")
            strategy.check_batch(abstract_batch, what=f"{method} batch")
            batch_sh = strategy.batch_shardings(abstract_batch)
            _batch.check_batch_layout(batch_sh, abstract_batch, f"{method} batch")
        else:
            batch_sh = strategy.replicated_like(abstract_batch)
        eval_step, batch_totals = build_eval_step(self.module, self._spec.eval_graphdef, method,
                                                  strategy, spec, sharded=sharded,
                                                  dataloader_idx=dataloader_idx)
        abstract_state = self.canonical_abstract(state)
        with strategy.trace_context():
            abstract_totals = jax.eval_shape(batch_totals, abstract_state, abstract_batch)
        rep = strategy.replicated()
        with self.compiling(f"eval:{method}"):
            compiled = strategy.compile(
                eval_step,
                (abstract_state, abstract_batch, abstract_totals,
                 jax.ShapeDtypeStruct((), jnp.bool_)),
                in_shardings=(self.state_shardings(state), batch_sh, rep, rep),
                out_shardings=rep,  # small totals, not donated: the loop can wait on them
            )
        zeros = jax.device_put(
            jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract_totals),
            strategy.replicated_like(abstract_totals),
        )
        return compiled, batch_sh, zeros

    def compile_predict_step(self, abstract_batch: Any, state: TrainState, sharded: bool,
                             local_batch: Any = None):
        """`(compiled, batch_sh)` for `predict_step` over whole batches of this shape.

        Sharded like a training batch, or (`sharded=False`) given whole to every device, with
        the output replicated. The caller keeps it for one `Fit.predict` call.
        """
        strategy = self.strategy
        if sharded:
            if local_batch is not None:
                _batch.check_batch_agreement(local_batch, "predict batch")
            batch_sh = strategy.batch_shardings(abstract_batch)
            _batch.check_batch_layout(batch_sh, abstract_batch, "predict batch")
        else:
            batch_sh = strategy.replicated_like(abstract_batch)
        predict_step = build_predict_step(self.module, self._spec.eval_graphdef,
                                          sharded=sharded)
        with self.compiling("predict"):
            return strategy.compile(
                predict_step, (self.canonical_abstract(state), abstract_batch),
                in_shardings=(self.state_shardings(state), batch_sh),
                out_shardings=None if sharded else strategy.replicated()), batch_sh
