"""BackboneFinetuning beside an epoch scheduler, compared with PyTorch Lightning 2.6.6.

The Lightning side (torch on CPU, run once; its numbers are below): the same network
(Linear(4, 3) -> tanh -> Linear(3, 2), the weights and data drawn here with NumPy), Adam(5e-3)
over the trainable parameters, `StepLR(step_size=1, gamma=0.5)` stepped every epoch,
`BackboneFinetuning(unfreeze_backbone_at_epoch=u)`, 3 epochs of 2 batches of 16, and
`LearningRateMonitor` into a CSVLogger. Lightning's `finetune_function` reads the head's rate
after the scheduler lowered it (`optimizer.param_groups[0]["lr"]`), so the backbone's rate is
5e-4, 1e-3, then 1.25e-3 (aligned to the head's); jaxlight read the unscheduled rate, and the
scheduler then scaled the backbone's too: 5e-4 every epoch.
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import callbacks

rng = np.random.default_rng(0)
X = rng.normal(size=(32, 4)).astype(np.float32)
Y = rng.normal(size=(32, 2)).astype(np.float32)
BACKBONE = (rng.normal(size=(4, 3)) * 0.5).astype(np.float32)
HEAD = (rng.normal(size=(3, 2)) * 0.5).astype(np.float32)

#: Lightning's rates ("lr-Adam/pg1", "lr-Adam/pg2"; before the backbone joins, "lr-Adam" and 0)
#: at jaxlight's logged steps (Lightning's CSV counts from 0) and final kernels, by
#: (unfreeze_backbone_at_epoch, the scheduler's interval).
LIGHTNING = {
    (0, "epoch"): {"rates": {1: (5e-3, 5e-4), 3: (2.5e-3, 1e-3), 5: (1.25e-3, 1.25e-3)},
        "backbone": [[0.5418009757995605, -0.027610700577497482, -0.13913610577583313],
                     [0.819286584854126, -0.6456068158149719, -0.28903138637542725],
                     [-0.2357068955898285, 0.2939411997795105, -0.3366571068763733],
                     [-0.3039853870868683, -0.797391414642334, 0.36007240414619446]],
        "head": [[0.3858264088630676, -0.22225309908390045],
                 [0.0883139967918396, -0.6311742067337036],
                 [-0.21932989358901978, 0.6748366951942444]]},
    (1, "epoch"): {"rates": {1: (5e-3, 0.0), 3: (2.5e-3, 2.5e-4), 5: (1.25e-3, 5e-4)},
        "backbone": [[0.5431557893753052, -0.025728300213813782, -0.14109939336776733],
                     [0.8209086060523987, -0.6425197720527649, -0.29175031185150146],
                     [-0.23628680408000946, 0.29350340366363525, -0.33311590552330017],
                     [-0.3061617910861969, -0.8011525869369507, 0.36340129375457764]],
        "head": [[0.3858236074447632, -0.22224509716033936],
                 [0.0882909968495369, -0.6311699748039246],
                 [-0.21931549906730652, 0.6748272180557251]]},
    # StepLR stepped every optimizer step (interval "step"): the backbone joins at epoch 1 at
    # a tenth of the head's rate then (1.25e-3), and both halve every step.
    (1, "step"): {
        "rates": {1: (5e-3, 0.0), 2: (2.5e-3, 0.0), 3: (1.25e-3, 1.25e-4),
                  4: (6.25e-4, 6.25e-5), 5: (3.125e-4, 2.5e-4), 6: (1.5625e-4, 1.25e-4)},
        "backbone": [[0.5433825850486755, -0.0254014004021883, -0.1414521038532257],
                     [0.8213130235671997, -0.6417711973190308, -0.29239919781684875],
                     [-0.2363567054271698, 0.29335230588912964, -0.3322831094264984],
                     [-0.3065679967403412, -0.8020414113998413, 0.3641974925994873]],
        "head": [[0.3933227062225342, -0.228951096534729],
                 [0.08736409991979599, -0.6373980045318604],
                 [-0.22640490531921387, 0.6804494261741638]]},
}


class Net(nnx.Module):
    def __init__(self, rngs):
        self.backbone = nnx.Linear(4, 3, rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)
        self.backbone.kernel[...] = BACKBONE
        self.head.kernel[...] = HEAD
        self.backbone.bias[...] = np.zeros(3, np.float32)
        self.head.bias[...] = np.zeros(2, np.float32)

    def __call__(self, x):
        return self.head(nnx.tanh(self.backbone(x)))


class Module(jl.TrainModule):
    def __init__(self, interval):
        super().__init__()
        self.interval = interval

    def configure_model(self, rngs):
        return Net(rngs)

    def configure_optimizers(self):
        # torch's StepLR(step_size=1, gamma=0.5), stepped every epoch or every step.
        return {"optimizer": optax.adam(5e-3),
                "lr_scheduler": {"scheduler": optax.exponential_decay(1.0, 1, 0.5,
                                                                      staircase=True),
                                 "interval": self.interval}}

    def training_step(self, model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).mean()


class Rates(callbacks.Callback):
    """Every logged metric whose name starts with "lr", by step."""

    def __init__(self):
        self.rows = {}

    def on_log(self, fit, module, metrics, step):
        row = {k: v for k, v in metrics.items() if k.startswith("lr")}
        if row:
            self.rows[step] = row


@pytest.mark.parametrize(("unfreeze", "interval"), sorted(LIGHTNING))
def test_backbone_rates_follow_the_scheduler_as_in_lightning(unfreeze, interval):
    """A step schedule also checks that every parameter's scheduler count advances while it is
    frozen: the backbone's restarted from 0 when it joined."""
    want = LIGHTNING[unfreeze, interval]
    rates = Rates()
    fit = jl.Fit("single", max_epochs=3, enable_progress_bar=False, logger=False,
                 enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
                 enable_checkpointing=False,
                 callbacks=[callbacks.BackboneFinetuning(unfreeze),
                            callbacks.LearningRateMonitor(), rates])
    module = Module(interval)
    fit.fit(module, jl.data.DataLoader({"x": X, "y": Y}, 16))
    got = [(rates.rows[s]["lr-Adam/pg1"], rates.rows[s]["lr-Adam/pg2"]) for s in want["rates"]]
    np.testing.assert_allclose(got, list(want["rates"].values()), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(module.model.backbone.kernel[...]), want["backbone"],
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(module.model.head.kernel[...]), want["head"],
                               rtol=1e-5, atol=1e-6)
