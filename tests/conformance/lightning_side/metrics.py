"""Logged names and values: self.log's on_step / on_epoch / prog_bar / batch_size, epoch means
weighted by batch size, several validation loaders (/dataloader_idx_N), what validate and test
return. 8 training batches of 4; validation batches of 5, 5 and 2."""

from _common import Batches, Reg, batches, floats, problem, tmpdir, torch, trainer, write

prob = problem(seed=3)
train, val = batches(prob, "train"), batches(prob, "val", batch_size=5)
val2 = Batches(val.items[:2])
cases = {}


class Logs(Reg):
    def __init__(self, train_kw=None, val_kw=None):
        super().__init__(prob, log_train=False)
        self.train_kw, self.val_kw = train_kw, val_kw

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        if self.train_kw is not None:
            self.log("train_loss", loss, **self.train_kw)
        return loss

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        loss = self.loss(batch)
        self.log("val_loss", loss, **(self.val_kw or {}))
        self.log("val_abs", torch.abs(self.layer(batch["x"]) - batch["y"]).mean(), prog_bar=True)


def run(name, module, val_data=val, **kw):
    tr = trainer(tmpdir(), max_epochs=2, **kw)
    tr.fit(module, train, val_data)
    cases[name] = {"logged": floats(tr.logged_metrics), "callback": floats(tr.callback_metrics),
                   "prog_bar": sorted(tr.progress_bar_metrics)}
    return tr, module


run("train_default", Logs({}))
run("train_on_step_and_epoch", Logs({"on_step": True, "on_epoch": True}))
run("train_on_epoch_only", Logs({"on_step": False, "on_epoch": True}))
run("train_prog_bar", Logs({"on_step": True, "on_epoch": True, "prog_bar": True}))
run("val_weighted_by_batch_size", Logs())
run("val_batch_size_argument", Logs(val_kw={"batch_size": 2}))
run("val_on_step", Logs(val_kw={"on_step": True, "on_epoch": True}))
run("val_two_loaders", Logs(), val_data=[val, val2])

tr, module = run("validate_and_test_return", Logs())
cases["validate_and_test_return"]["validate"] = [floats(d) for d in
                                                 tr.validate(module, val, verbose=False)]
cases["validate_and_test_return"]["test"] = [floats(d) for d in tr.test(module, val,
                                                                        verbose=False)]
write("metrics", cases, prob)
