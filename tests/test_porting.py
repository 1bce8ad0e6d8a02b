"""Lightning habits refused at setup with the jaxlight form and a pointer (issue 15 item 7)."""

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight.module._porting import check_module
from tests.models import Classifier, classification_data

GUIDE = "docs/porting.md"


def test_a_jaxlight_module_passes():
    check_module(Classifier())


def test_batch_idx_signature_is_refused():
    class Lit(Classifier):
        def training_step(self, batch, batch_idx):
            return batch["x"].mean()

    with pytest.raises(jl.PortingError, match=r"training_step\(self, batch, batch_idx\) has "
                       r"Lightning's step signature.*training_step\(self, model, batch\)") as e:
        check_module(Lit())
    assert GUIDE in str(e.value)


def test_dataloader_idx_is_taken_by_evaluation_steps_only():
    class SeveralLoaders(Classifier):  # told its loader's index, as Lightning (issue 25 item 12)
        def validation_step(self, model, batch, dataloader_idx=0):
            return {}

    check_module(SeveralLoaders())

    class Lit(Classifier):
        def training_step(self, model, batch, dataloader_idx=0):
            return 0.0

    with pytest.raises(jl.PortingError, match=r"training_step\(self, model, batch\)"):
        check_module(Lit())


def test_a_step_that_cannot_take_model_and_batch_is_refused():
    class Odd(Classifier):
        def training_step(self, model, batch, extra):
            return 0.0

    with pytest.raises(jl.PortingError, match=r"cannot be called as training_step\(model, "
                       r"batch\)"):
        check_module(Odd())


def test_self_call_in_a_step_is_refused_with_its_line():
    class Lit(Classifier):
        def training_step(self, model, batch):
            logits = self(batch["x"])
            return logits.mean()

    with pytest.raises(jl.PortingError, match=r"training_step uses self\(\.\.\.\) \(line \d+\)"
                       r".*model\(x\)"):
        check_module(Lit())


def test_forward_is_refused_unless_it_takes_the_model():
    class Lit(Classifier):
        def forward(self, x):
            return x

    with pytest.raises(jl.PortingError, match=r"Lit\.forward\(self, x\) is a LightningModule "
                       r"method.*configure_model"):
        check_module(Lit())

    class Helper(Classifier):
        def forward(self, model, x):
            return model(x)

    check_module(Helper())


def test_layers_built_in_init_are_refused():
    class Lit(jl.TrainModule):
        def __init__(self):
            super().__init__()
            self.encoder = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    with pytest.raises(jl.PortingError, match=r"self\.encoder.*configure_model\(self, rngs\)"
                       r".*model\.encoder\(x\)"):
        check_module(Lit())

    class Backbone(Classifier):  # a module held for configure_model to build on is fine
        def __init__(self):
            super().__init__()
            self.backbone = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

    check_module(Backbone())


def test_parameters_in_configure_optimizers_is_refused():
    class Lit(Classifier):
        def configure_optimizers(self):
            return optax.adam(1e-3) if self.parameters() else None

    with pytest.raises(jl.PortingError, match=r"self\.parameters\(\.\.\.\).*optax\.adam\(lr\)"):
        check_module(Lit())


def test_manual_optimization_and_lightning_hooks_are_refused():
    class Manual(Classifier):
        automatic_optimization = False

    # Manual optimization is accepted; a training_step without the optimizers is refused with
    # the form it needs, and Lightning's manual_backward points at opt.step.
    with pytest.raises(jl.PortingError, match=r"training_step\(model, batch, opt\).*"
                       r"opt\.step\('name', loss_fn\)"):
        check_module(Manual())

    class Backward(Classifier):
        automatic_optimization = False

        def training_step(self, model, batch, opt):
            loss = model(batch["x"]).mean()
            self.manual_backward(loss)

    with pytest.raises(jl.PortingError, match=r"manual_backward.*opt\.step\('name', loss_fn\)"):
        check_module(Backward())

    class Clip(Classifier):
        def configure_gradient_clipping(self, optimizer, clip_val=None, algorithm=None):
            pass

    with pytest.raises(jl.PortingError, match=r"gradient_clip_val"):
        check_module(Clip())


def test_self_log_in_a_hook_is_refused_but_not_in_a_step_helper():
    class Lit(Classifier):
        def on_train_epoch_end(self):
            self.log("epoch_metric", 1.0)

    with pytest.raises(jl.PortingError, match=r"on_train_epoch_end uses self\.log\(\.\.\.\) "
                       r"\(line \d+\).*fit\.log_metrics"):
        check_module(Lit())

    class Helper(Classifier):
        def _shared(self, model, batch, stage):
            self.log(f"{stage}_size", batch["x"].shape[0])
            return model(batch["x"]).mean()

        def training_step(self, model, batch):
            return self._shared(model, batch, "train")

    check_module(Helper())


def test_backward_call_in_a_step_is_refused():
    class Lit(Classifier):
        def training_step(self, model, batch):
            loss = model(batch["x"]).mean()
            loss.backward()
            return loss

    with pytest.raises(jl.PortingError, match=r"<tensor>\.backward\(\).*jax\.grad"):
        check_module(Lit())


def test_self_call_without_source_fails_with_the_pointer():
    namespace = {"Classifier": Classifier}
    exec("class Lit(Classifier):\n"  # noqa: S102 - a class without source, as in a REPL
         "    def training_step(self, model, batch):\n"
         "        return self(batch['x']).mean()\n", namespace)
    module = namespace["Lit"]()
    check_module(module)  # no source to read: the call itself says it
    with pytest.raises(jl.PortingError, match=r"Lightning's self\(x\).*model\(x\)"):
        module.training_step(None, {"x": 1})


def test_fit_refuses_the_lightning_signature_before_tracing():
    """Before: `'Linear' object is not subscriptable` from inside the trace."""

    class Lit(Classifier):
        def training_step(self, batch, batch_idx):
            return batch["x"].mean()

    data = [{"x": jnp.zeros((8, 16)), "y": jnp.zeros((8,), jnp.int32)}]
    fit = jl.Fit(strategy="single", max_steps=1, enable_progress_bar=False, logger=False)
    with pytest.raises(jl.PortingError, match=r"training_step\(self, model, batch\)"):
        fit.fit(Lit(), data)
    assert fit.compile_counts == {}  # refused at setup: nothing was traced or compiled


def test_lightning_trainer_arguments_are_refused_with_the_jaxlight_form():
    with pytest.raises(jl.PortingError, match=r"Fit\(accelerator=\.\.\.\) is a Lightning Trainer "
                                              r"argument.*Fit\(devices=\.\.\.\).*" + GUIDE):
        jl.Fit(accelerator="gpu", max_steps=1)
    with pytest.raises(jl.PortingError, match=r"Fit\(gpus=\.\.\.\).*Fit\(devices=N\)"):
        jl.Fit(gpus=2, max_steps=1)
    with pytest.raises(jl.ConfigurationError, match=r"unknown keyword argument\(s\) \['max_step'\]"
                                                    r"\. Did you mean 'max_steps'\?"):
        jl.Fit(max_step=1)


def test_a_lightning_logger_argument_joins_the_callbacks():
    from jaxlight import callbacks

    csv = callbacks.CSVLogger()
    fit = jl.Fit(logger=csv, max_steps=1, enable_progress_bar=False)
    assert [cb for cb in fit.callbacks if getattr(cb, "is_logger", False)] == [csv]
    with pytest.raises(jl.ConfigurationError, match=r"Fit\(logger=\.\.\.\) takes True / False.*"
                                                    r"\['str'\]"):
        jl.Fit(logger="wandb", max_steps=1)


def test_self_log_called_outside_a_step_points_to_the_guide():
    with pytest.raises(jl.ConfigurationError, match=r"Classifier\.log\(\.\.\.\) was called outside "
                                                    r"a step.*fit\.log_metrics.*" + GUIDE):
        Classifier().log("x", 1.0)


@pytest.mark.parametrize("call", ["optimizers", "lr_schedulers", "toggle_optimizer",
                                  "untoggle_optimizer", "manual_backward"])
def test_lightning_manual_optimization_calls_name_the_jaxlight_form(call):
    """The first line of Lightning's manual step (`opt_g, opt_d = self.optimizers()`) raised a raw
    AttributeError; porting.md promises the jaxlight form (issue 46 item 4)."""
    class Manual(Classifier):
        def training_step(self, model, batch):
            getattr(self, call)(*(() if call in ("optimizers", "lr_schedulers") else (None,)))
            return super().training_step(model, batch)

    fit = jl.Fit("single", max_steps=1, enable_progress_bar=False, logger=False,
                 enable_model_summary=False)
    with pytest.raises(jl.PortingError, match=rf"self\.{call}\(\.\.\.\), Lightning's manual "
                       r"optimization.*automatic_optimization = False.*opt\.step\('name', "
                       r"loss_fn\).*docs/porting\.md"):
        fit.fit(Manual(), jl.data.ArrayLoader(classification_data(32), 16))
