"""docs/porting.md's autoencoder port: the line counts the page states are the real ones.

The docs test (tests/test_docs.py) runs the port; this test diffs it against the Lightning
original shown beside it and checks the sentence that reports the counts.
"""

from __future__ import annotations

import difflib
import pathlib
import re

from tests.test_docs import blocks

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "porting.md"

#: The fence info strings that name the example's blocks.
NAMES = {"lightning-autoencoder", "autoencoder-standins", "autoencoder-port"}


def _example_blocks() -> dict[str, tuple[str, str]]:
    text = PAGE.read_text()
    found = {}
    for match in re.finditer(r"^```(\w+) ([\w-]+)\s*\n", text, re.M):
        if match.group(2) in NAMES:
            found[match.group(2)] = match.start()
    by_line = {line: (lang, body) for lang, body, line, _ in blocks(text)}
    return {name: by_line[text.count("\n", 0, start) + 1] for name, start in found.items()}


def test_the_page_states_the_real_line_counts():
    example = _example_blocks()
    assert set(example) == NAMES
    (lightning_lang, lightning), (port_lang, port) = (example["lightning-autoencoder"],
                                                      example["autoencoder-port"])
    assert (lightning_lang, port_lang) == ("text", "python")  # the original is not run
    original, ported = lightning.splitlines(), port.splitlines()
    diff = list(difflib.unified_diff(original, ported, lineterm="", n=0))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    text = " ".join(PAGE.read_text().split())
    stated = re.search(r"the Lightning original has (\d+) lines, the port (\d+); the diff "
                       r"removes (\d+) lines and adds (\d+); (\d+) lines are the same", text)
    assert stated, "docs/porting.md lost the sentence stating the line counts"
    assert [int(g) for g in stated.groups()] == [len(original), len(ported), removed, added,
                                                 len(original) - removed]
    assert len(original) - removed == len(ported) - added
    standins = re.search(r"as NumPy stand-ins \((\d+) lines\)", text)
    assert standins and int(standins.group(1)) == len(
        example["autoencoder-standins"][1].splitlines())


def test_the_port_keeps_lightnings_names_and_flow():
    example = _example_blocks()
    port = example["autoencoder-port"][1]
    for name in ("class ImageSampler(callbacks.Callback)", "class LitAutoEncoder(TrainModule)",
                 "class MyDataModule(DataModule)", "def on_train_epoch_end(self, fit, module)",
                 "def cli_main()", "fit.fit(model, datamodule=datamodule)",
                 'fit.test(model, ckpt_path="best", datamodule=datamodule)',
                 'fit.predict(model, ckpt_path="best", datamodule=datamodule)'):
        assert name in port, name
    assert "### From the command line" in PAGE.read_text()
