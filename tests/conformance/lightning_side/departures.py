"""The deliberate departures that need a Lightning number: evaluation under bf16-mixed, and
the loader's batch as the global batch."""

from _common import Reg, batches, problem, tmpdir, trainer, write

prob = problem(seed=7)
val = batches(prob, "val", batch_size=6)
cases = {}

losses = {}
for precision in ("32-true", "bf16-mixed"):
    tr = trainer(tmpdir(), precision=precision)
    losses[precision] = tr.validate(Reg(prob), val, verbose=False)[0]["val_loss"]
cases["bf16_mixed_evaluation"] = {"val_loss": losses}

# one process, DataLoader batch 8: what jaxlight's loader batch 8 means on any number of devices
module = Reg(prob)
tr = trainer(tmpdir(), max_epochs=1)
tr.fit(module, batches(prob, "train", batch_size=8))
cases["global_batch"] = {"weights": module.weights(), "global_step": tr.global_step,
                         "batch_size": 8}
write("departures", cases, prob)
