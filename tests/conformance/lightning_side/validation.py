"""Which steps validate: max_epochs / max_steps / limit_*_batches / val_check_interval (int and
float) / check_val_every_n_epoch / num_sanity_val_steps / fast_dev_run. 8 training batches an
epoch, 3 validation batches."""

from _common import L, Reg, batches, problem, tmpdir, trainer, write

prob = problem(seed=2)
train, val = batches(prob, "train"), batches(prob, "val")
cases = {}


class Validations(L.Callback):
    """(global_step, epoch, validation batches) of every validation outside the sanity check;
    how many sanity checks ran."""

    def __init__(self):
        self.runs, self.batches, self.sanity = [], 0, 0

    def on_sanity_check_start(self, trainer, module):
        self.sanity += 1

    def on_validation_batch_end(self, trainer, module, *args):
        self.batches += 1

    def on_validation_end(self, trainer, module):
        if not trainer.sanity_checking:
            self.runs.append([trainer.global_step, trainer.current_epoch, self.batches])
        self.batches = 0


def run(name, **kw):
    seen = Validations()
    tr = trainer(tmpdir(), callbacks=[seen], **kw)
    tr.fit(Reg(prob), train, val)
    cases[name] = {"validations": seen.runs, "global_step": tr.global_step,
                   "sanity_checks": seen.sanity, "trainer": kw}


run("max_epochs_3", max_epochs=3)
run("check_val_every_n_epoch_2", max_epochs=4, check_val_every_n_epoch=2)
run("val_check_interval_int_3", max_epochs=2, val_check_interval=3)
run("val_check_interval_float_0_5", max_epochs=2, val_check_interval=0.5)
run("val_check_interval_float_0_25", max_epochs=1, val_check_interval=0.25)
run("val_check_interval_5_across_epochs", max_epochs=2, val_check_interval=5,
    check_val_every_n_epoch=None)
run("limit_train_batches_int_4", max_epochs=2, limit_train_batches=4)
run("limit_train_batches_float_0_5", max_epochs=2, limit_train_batches=0.5)
run("limit_val_batches_int_2", max_epochs=1, limit_val_batches=2)
run("limit_val_batches_float_0_5", max_epochs=1, limit_val_batches=0.5)
run("max_steps_5_mid_epoch", max_steps=5)
run("max_steps_12_max_epochs_5", max_steps=12, max_epochs=5)
run("max_epochs_2_max_steps_100", max_epochs=2, max_steps=100)
run("num_sanity_val_steps_2", max_epochs=1, num_sanity_val_steps=2)
run("num_sanity_val_steps_0", max_epochs=1, num_sanity_val_steps=0)
run("fast_dev_run", fast_dev_run=True)
run("fast_dev_run_3", fast_dev_run=3)

write("validation", cases, prob)
