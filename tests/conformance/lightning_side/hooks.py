"""Hook order for fit / validate / test / predict / resume: Lightning's own
`tests_pytorch/models/test_hooks.py`, every case that maps (see `test_hooks.py` beside the
fixtures for the mapping), on the conformance problem."""

import os

from _common import HookedReg, L, Recorder, Reg, batches, problem, tmpdir, trainer, write

prob = problem()
train, val = batches(prob, "train"), batches(prob, "val")
cases = {}


def hooked(**trainer_kw):
    calls = []
    module = HookedReg(prob, calls=calls)
    tr = trainer(tmpdir(), callbacks=[Recorder(calls), *trainer_kw.pop("callbacks", [])],
                 **trainer_kw)
    return calls, module, tr


# test_trainer_model_hook_system_fit (devices=1; sanity check off: see fit_sanity_check)
calls, module, tr = hooked(max_epochs=1, limit_train_batches=2, limit_val_batches=2)
tr.fit(module, train, val)
cases["fit_one_epoch"] = {"calls": calls}

calls, module, tr = hooked(max_epochs=2, limit_train_batches=2, limit_val_batches=2)
tr.fit(module, train, val)
cases["fit_two_epochs"] = {"calls": calls}

# the same with Lightning's default sanity check (2 validation batches before training)
calls, module, tr = hooked(max_epochs=1, limit_train_batches=2, limit_val_batches=2,
                           num_sanity_val_steps=2)
tr.fit(module, train, val)
cases["fit_sanity_check"] = {"calls": calls}

calls, module, tr = hooked(max_epochs=1, limit_train_batches=2)
tr.fit(module, train)
cases["fit_no_val"] = {"calls": calls}

# limit_val_batches=0 turns validation off: no sanity check, no validation hook
calls, module, tr = hooked(max_epochs=1, limit_train_batches=2, limit_val_batches=0,
                           num_sanity_val_steps=2)
tr.fit(module, train, val)
cases["fit_limit_val_batches_0"] = {"calls": calls}

# a ModelCheckpoint saving at every epoch's end: on_save_checkpoint after on_train_epoch_end
ckdir = tmpdir()
calls, module, tr = hooked(max_epochs=2, limit_train_batches=2, limit_val_batches=2,
                           callbacks=[L.callbacks.ModelCheckpoint(ckdir, save_top_k=-1)])
tr.fit(module, train, val)
cases["fit_checkpoint_every_epoch"] = {"calls": calls}

# test_trainer_model_hook_system_fit_no_val_and_resume_max_epochs
ckdir = tmpdir()
tr = trainer(tmpdir(), max_epochs=1, limit_train_batches=2, limit_val_batches=0,
             callbacks=[L.callbacks.ModelCheckpoint(ckdir, save_top_k=-1)])
tr.fit(Reg(prob), train)
first = tr.checkpoint_callback.best_model_path
calls, module, tr = hooked(max_epochs=2, limit_train_batches=2, limit_val_batches=0,
                           callbacks=[L.callbacks.ModelCheckpoint(ckdir, save_top_k=-1)])
tr.fit(module, train, ckpt_path=first)
cases["resume_max_epochs"] = {"calls": calls, "first_checkpoint": os.path.basename(first),
                              "global_step": tr.global_step}

# test_trainer_model_hook_system_fit_no_val_and_resume_max_steps
ckdir = tmpdir()
tr = trainer(tmpdir(), max_steps=1, limit_val_batches=0,
             callbacks=[L.callbacks.ModelCheckpoint(ckdir, save_top_k=-1)])
tr.fit(Reg(prob), train)
first = tr.checkpoint_callback.best_model_path
calls, module, tr = hooked(max_steps=3, limit_val_batches=0,
                           callbacks=[L.callbacks.ModelCheckpoint(ckdir, save_top_k=-1)])
tr.fit(module, train, ckpt_path=first)
cases["resume_max_steps"] = {"calls": calls, "first_checkpoint": os.path.basename(first),
                             "global_step": tr.global_step}

# test_trainer_model_hook_system_eval: validate / test, with 2 batches and with 0
for verb, limit in (("validate", "limit_val_batches"), ("test", "limit_test_batches")):
    for n in (2, 0):
        calls, module, tr = hooked(**{limit: n})
        getattr(tr, verb)(module, val, verbose=False)
        cases[f"{verb}_{n}_batches"] = {"calls": calls}

# test_trainer_model_hook_system_predict
calls, module, tr = hooked(limit_predict_batches=2)
tr.predict(module, val)
cases["predict_2_batches"] = {"calls": calls}

# test_on_before_zero_grad_called: one optimizer step per batch up to max_steps (max_epochs=2)
for max_steps in (1, 3, 10):
    calls, module, tr = hooked(max_steps=max_steps, max_epochs=2)
    tr.fit(module, train)
    cases[f"optimizer_steps_max_steps_{max_steps}"] = {
        "global_step": tr.global_step,
        "train_batches": sum(c.startswith("on_train_batch_end") for c in calls)}


# test_trainer_datamodule_hook_system
class HookedDataModule(L.LightningDataModule):
    def __init__(self, called):
        super().__init__()
        self.called = called

    def prepare_data(self):
        self.called.append("prepare_data")

    def setup(self, stage):
        self.called.append(f"setup:{getattr(stage, 'value', stage)}")

    def teardown(self, stage):
        self.called.append(f"teardown:{getattr(stage, 'value', stage)}")

    def state_dict(self):
        self.called.append("state_dict")
        return {}

    def train_dataloader(self):
        self.called.append("train_dataloader")
        return train

    def val_dataloader(self):
        self.called.append("val_dataloader")
        return val

    def test_dataloader(self):
        self.called.append("test_dataloader")
        return val

    def predict_dataloader(self):
        self.called.append("predict_dataloader")
        return val


for verb in ("fit", "validate", "test", "predict"):
    called = []
    tr = trainer(tmpdir(), max_epochs=1, limit_train_batches=2, limit_val_batches=2,
                 limit_test_batches=2, limit_predict_batches=2)
    kw = {} if verb in ("fit", "predict") else {"verbose": False}
    getattr(tr, verb)(Reg(prob), datamodule=HookedDataModule(called), **kw)
    cases[f"datamodule_{verb}"] = {"calls": called}

# with the sanity check the validation loader is asked for first
called = []
tr = trainer(tmpdir(), max_epochs=1, limit_train_batches=2, limit_val_batches=2,
             num_sanity_val_steps=2)
tr.fit(Reg(prob), datamodule=HookedDataModule(called))
cases["datamodule_fit_sanity_check"] = {"calls": called}

# test_train_eval_mode_restored / load_from_checkpoint: the module's mode after each call
ckdir = tmpdir()
module = Reg(prob)
tr = trainer(tmpdir(), max_epochs=1, limit_train_batches=2,
             callbacks=[L.callbacks.ModelCheckpoint(ckdir)])
tr.fit(module, train, val)
after_fit = module.training
tr.validate(module, val, verbose=False)
after_validate = module.training
tr.test(module, val, verbose=False)
after_test = module.training
tr.predict(module, val)
cases["training_mode_after_each_stage"] = {
    "fit": after_fit, "validate": after_validate, "test": after_test,
    "predict": module.training}
loaded = Reg.load_from_checkpoint(tr.checkpoint_callback.best_model_path, prob=prob)
cases["load_from_checkpoint_mode"] = {"training": loaded.training}

write("hooks", cases, prob)
