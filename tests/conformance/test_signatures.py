"""The defaults of the arguments jaxlight shares with Lightning (fixtures/signatures.json, from
lightning_side/signatures.py): equal to Lightning's, or listed below with the reason; a new
shared argument with another default fails here until it is listed (or made equal)."""

from __future__ import annotations

import re

from tests.conformance import _coverage
from tests.conformance._cases import departure

#: Shared arguments whose default differs from Lightning's, and why (porting.md's section
#: "Differences the coverage cases pin" lists them).
DIFFERENT_DEFAULTS = {
    "Fit(callbacks)": "() for None: the same empty list",
    "Fit(default_root_dir)": "'jaxlight_logs' for None (Lightning: the working directory)",
    "Fit(devices)": "None for 'auto': every device, as 'auto'",
    "Fit(enable_model_summary)": "True for None: both show the summary",
    "Fit(enable_progress_bar)": "True for None: both show the bar",
    "Fit(gradient_clip_algorithm)": "'norm' for None: Lightning's None means 'norm'",
    "Fit(log_every_n_steps)": "50 for None: Lightning's None means 50",
    "Fit(logger)": "True for None: both add a default logger",
    "Fit(max_steps)": "None for -1: no limit either way",
    "Fit(num_sanity_val_steps)": "2 for None: Lightning's None means 2",
    "TrainModule.log(logger)": "True for None: Lightning's None means True",
    "TrainModule.log_dict(logger)": "True for None: Lightning's None means True",
    "CSVLogger(name)": "'csv' for 'lightning_logs': another run directory name",
    "TensorBoardLogger(name)": "'tensorboard' for 'lightning_logs': another run directory name",
    "WandbLogger(save_dir)": "None for '.': the Fit's default_root_dir",
    "CSVLogger(save_dir)": "None for required: the Fit's default_root_dir",
    "TensorBoardLogger(save_dir)": "None for required: the Fit's default_root_dir",
    "WeightAveraging.should_update(step_idx)": "required for None: jaxlight calls it with the "
                                               "traced step index only (no epoch-end call)",
    "ModelSummary(max_depth)": "-1 for 1: jaxlight's table of parameter arrays",
    "RichModelSummary(max_depth)": "-1 for 1: jaxlight's table of parameter arrays",
    "RichProgressBar(theme)": "None for Lightning's default theme: the same theme",
    "TQDMProgressBar(leave)": "True for False: the bar stays after training",
}


def _normal(text):
    """One spelling for equal defaults: enums by value, torch's device by name, functions by
    name (`<Interval.step: 'step'>` -> 'step', `device(type='cpu')` -> 'cpu')."""
    if text is None:
        return None
    text = re.sub(r"<\w+\.\w+: ('[^']*')>", r"\1", text)
    text = re.sub(r"device\(type=('[^']*')\)", r"\1", text)
    return re.sub(r"<function (\w+) at 0x[0-9a-f]+>", r"<function \1>", text)


@departure("every shared argument has Lightning's default except the listed ones, each with its "
           "reason (CSVLogger and TensorBoardLogger name their run directory 'csv' / "
           "'tensorboard', not 'lightning_logs'; ModelSummary's max_depth is -1; "
           "TQDMProgressBar's leave is True; WandbLogger's save_dir is the Fit's root)",
           section="Differences the coverage cases pin")
def test_defaults():
    differ = {unit: (info["lightning_default"], info["jaxlight_default"])
              for unit, info in _coverage.shared_units().items()
              if _normal(info["lightning_default"]) != _normal(info["jaxlight_default"])}
    unlisted = {u: d for u, d in differ.items() if u not in DIFFERENT_DEFAULTS}
    assert not unlisted, f"defaults that differ from Lightning's (Lightning, jaxlight): {unlisted}"
    now_equal = sorted(set(DIFFERENT_DEFAULTS) - set(differ))
    assert not now_equal, f"these defaults now equal Lightning's: drop them from the list: " \
        f"{now_equal}"
