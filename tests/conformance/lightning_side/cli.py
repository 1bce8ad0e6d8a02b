"""Group `cli`: LightningCLI itself on Lightning's backbone example, at the digits' scale.

`examples/pytorch/basics/backbone_image_classifier.py` (a `LitClassifier` with an injected
`Backbone`, a DataModule, `LightningCLI`) on 96 training and 32 validation images of the 8x8
digits bundled with jaxlight, initial weights from NumPy. Writes `fixtures/cli.json`:

- the `config.yaml` LightningCLI's `--print_config` writes for a set of flags (subclass mode for
  the backbone, a callback added with `+=`, a seed), and what LightningCLI parses from it;
- what LightningCLI parses from the same values given as flags;
- the final weights and validation loss of a fit driven by that config file, and of one that
  adds `--optimizer Adam --lr_scheduler StepLR` (LightningCLI's generated configure_optimizers);
- the config.yaml of LightningCLI in subclass mode (`model:`/`data:` as `class_path`/
  `init_args`) and what LightningCLI parses from it;
- where SaveConfigCallback writes `config.yaml`, that it refuses to overwrite one, and what the
  file holds.

Run under the reference environment (torch CPU + lightning + jsonargparse), never in the regular
suite: `python tests/conformance/lightning_side/cli.py`.
"""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import sys
import tempfile
import warnings

import lightning
import lightning.pytorch as L
import torch
import yaml
from lightning.pytorch.cli import LightningCLI
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _cli_problem import FLAGS, OPTIMIZER_FLAGS, problem  # noqa: E402

FIXTURES = HERE.parent / "fixtures"
warnings.filterwarnings("ignore")
torch.set_num_threads(1)
PROB = problem()


class Backbone(nn.Module):
    """Lightning's example: two linear layers (here 64 inputs, as the 8x8 digits)."""

    def __init__(self, hidden_dim: int = 128):
        super().__init__()
        self.l1 = nn.Linear(64, hidden_dim)
        self.l2 = nn.Linear(hidden_dim, 10)

    def forward(self, x):
        x = x.view(x.size(0), -1)
        x = torch.relu(self.l1(x))
        return torch.relu(self.l2(x))


class LitClassifier(L.LightningModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 0.0001):
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        if backbone is None:
            backbone = Backbone()
        self.backbone = backbone

    def forward(self, x):
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("valid_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


class MyDataModule(L.LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size

    def _loader(self, split):
        x = torch.tensor(PROB[split]["x"])
        y = torch.tensor(PROB[split]["y"], dtype=torch.long)
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size)

    def train_dataloader(self):
        return self._loader("train")

    def val_dataloader(self):
        return self._loader("val")


QUIET = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
         "--trainer.logger", "false", "--trainer.enable_checkpointing", "false"]


def cli(args):
    return LightningCLI(LitClassifier, MyDataModule, seed_everything_default=1234, run=False,
                        args=args, save_config_callback=None)


def print_config(args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        cli([*args, "--print_config"])
    return out.getvalue()


def subclass_mode() -> dict:
    """LightningCLI in subclass mode (`subclass_mode_model=True, subclass_mode_data=True`, the
    classes chosen with `--model LitClassifier --data MyDataModule`): the config.yaml its
    `--print_config` writes (`model:` and `data:` as `class_path`/`init_args`) for the same
    flags, and what it parses back from that file."""

    def sub_cli(args):
        return LightningCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                            subclass_mode_data=True, seed_everything_default=1234, run=False,
                            args=args, save_config_callback=None)

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        sub_cli(["--model", "LitClassifier", "--data", "MyDataModule", *FLAGS, "--print_config"])
    text = out.getvalue()
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "config.yaml"
        path.write_text(text)
        config = sub_cli(["--config", str(path)]).config
    classes = {"model_class_path": config.model.class_path,
               "data_class_path": config.data.class_path}
    config.model, config.data = config.model.init_args, config.data.init_args
    return {"config_yaml": text, **classes, "parsed": parsed(config)}


def parsed(config) -> dict:
    """What a user can observe of a parse: the values jaxlight shares names with."""
    callbacks = config.trainer.callbacks or []
    return {
        "seed_everything": config.seed_everything,
        "trainer": {k: config.trainer[k] for k in (
            "max_epochs", "max_steps", "limit_val_batches", "check_val_every_n_epoch",
            "log_every_n_steps", "accumulate_grad_batches", "gradient_clip_val")},
        "callbacks": [{"class": cb.class_path.rsplit(".", 1)[1],
                       "init_args": {k: cb.init_args[k] for k in
                                     ("monitor", "patience", "mode", "min_delta")}}
                      for cb in callbacks],
        "model": {"learning_rate": config.model.learning_rate,
                  "backbone": config.model.backbone.class_path.rsplit(".", 1)[1],
                  "hidden_dim": config.model.backbone.init_args.hidden_dim},
        "data": {"batch_size": config.data.batch_size},
    }


def _short(array) -> list:
    """float32 values as the shortest decimals that read back to the same float32 (9
    significant digits always do), to keep the fixture small."""
    return [_short(row) for row in array] if array.ndim > 1 else [float(f"{v:.9g}") for v in array]


def train(args) -> dict:
    run = cli(args)
    net = run.model.backbone
    with torch.no_grad():
        for name in ("l1", "l2"):
            layer = getattr(net, name)
            layer.weight.copy_(torch.tensor(PROB["init"][name]["kernel"]).T)
            layer.bias.copy_(torch.tensor(PROB["init"][name]["bias"]))
    run.trainer.fit(run.model, run.datamodule)
    return {
        "global_step": run.trainer.global_step,
        "valid_loss": float(run.trainer.callback_metrics["valid_loss"]),
        "weights": {name: {"kernel": _short(getattr(net, name).weight.detach().numpy().T),
                           "bias": _short(getattr(net, name).bias.detach().numpy())}
                    for name in ("l1", "l2")},
    }


#: The save_config case: one step, a CSV logger under a fixed run directory name.
SAVE_ARGS = ["--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
             "--trainer.enable_model_summary", "false", "--trainer.num_sanity_val_steps", "0",
             "--trainer.enable_checkpointing", "false", "--trainer.logger", "CSVLogger",
             "--trainer.logger.name", "run", "--model.learning_rate", "0.02"]


def save_config() -> dict:
    """LightningCLI's SaveConfigCallback on `fit`: the files it writes (relative to the
    logger's save_dir), that a fit into the same run directory is refused unless
    `save_config_kwargs={"overwrite": True}`, and what the saved file holds."""

    def fit(save_dir, *extra, **kwargs):
        LightningCLI(LitClassifier, MyDataModule, seed_everything_default=1234,
                     args=["fit", *SAVE_ARGS, "--trainer.logger.save_dir", save_dir, *extra],
                     **kwargs)

    def written(root):
        return sorted(str(p.relative_to(root)) for p in pathlib.Path(root).rglob("config.yaml"))

    with tempfile.TemporaryDirectory() as tmp:
        fit(tmp)
        fit(tmp)  # a new version: a new run directory
        after_two = written(tmp)
        try:
            fit(tmp, "--trainer.logger.version", "0")
            refused = None
        except RuntimeError as err:
            refused = str(err).split(" Aborting")[0].replace(tmp, "<save_dir>")
        fit(tmp, "--trainer.logger.version", "0", save_config_kwargs={"overwrite": True})
        saved = yaml.safe_load((pathlib.Path(tmp) / "run" / "version_0" / "config.yaml")
                               .read_text())
    with tempfile.TemporaryDirectory() as tmp:  # no logger: default_root_dir is the log dir
        quiet = ["--trainer.logger", "false", "--trainer.default_root_dir", tmp]
        fit(tmp, *quiet)
        no_logger = written(tmp)
        try:
            fit(tmp, *quiet)
            no_logger_second_refused = False
        except RuntimeError:
            no_logger_second_refused = True
    return {"after_two_fits": after_two, "refused": refused,
            "no_logger_written": no_logger, "no_logger_second_refused": no_logger_second_refused,
            "overwritten_sections": sorted(saved),
            "saved": {"max_steps": saved["trainer"]["max_steps"],
                      "learning_rate": saved["model"]["learning_rate"],
                      "seed_everything": saved["seed_everything"]}}


#: LightningCLI's environment variables, enabled without touching the script.
ENV = {"JSONARGPARSE_DEFAULT_ENV": "true", "PL_FIT__TRAINER__MAX_EPOCHS": "7",
       "PL_FIT__MODEL__LEARNING_RATE": "0.5", "PL_TRAINER__MAX_STEPS": "5"}


def default_env() -> dict:
    """`jaxlight fit`'s environment: which of ENV a LightningCLI script's `fit` reads."""
    import os

    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            LightningCLI(LitClassifier, MyDataModule, seed_everything_default=1234,
                         args=["fit", "--print_config"], save_config_callback=None)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    printed = yaml.safe_load(out.getvalue())
    return {"env": ENV, "max_epochs": printed["trainer"]["max_epochs"],
            "max_steps": printed["trainer"]["max_steps"],
            "learning_rate": printed["model"]["learning_rate"]}


def main() -> None:
    cases = {}
    text = print_config(FLAGS)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "config.yaml"
        path.write_text(text)
        from_file = cli(["--config", str(path)]).config
        cases["print_config_reads_back"] = {"config_yaml": text, "parsed": parsed(from_file)}
        cases["flags_parse"] = {"flags": FLAGS, "parsed": parsed(cli(FLAGS).config)}
        cases["config_trains"] = train(["--config", str(path), *QUIET])
        cases["optimizer_flags_train"] = train(["--config", str(path), *QUIET,
                                                *OPTIMIZER_FLAGS])
    cases["subclass_mode_config"] = subclass_mode()
    cases["save_config"] = save_config()
    cases["default_env"] = default_env()
    FIXTURES.mkdir(exist_ok=True)
    out = {"torch": torch.__version__, "lightning": lightning.__version__,
           "script": "tests/conformance/lightning_side/cli.py", "cases": cases}
    (FIXTURES / "cli.json").write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {FIXTURES / 'cli.json'}: {sorted(cases)}")


if __name__ == "__main__":
    main()
