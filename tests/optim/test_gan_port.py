"""docs/porting.md's GAN port: the line counts the page states are the real ones.

The docs test (tests/test_docs.py) runs the port and its comparison with plain JAX; this test
diffs it against the Lightning original shown beside it and checks the sentence with the counts.
"""

from __future__ import annotations

import difflib
import pathlib
import re

from tests.test_docs import blocks

PAGE = pathlib.Path(__file__).resolve().parent.parent.parent / "docs" / "porting.md"


def _named_blocks() -> dict[str, tuple[str, str]]:
    text = PAGE.read_text()
    by_line = {line: (lang, body) for lang, body, line, _ in blocks(text)}
    return {m.group(2): by_line[text.count("\n", 0, m.start()) + 1]
            for m in re.finditer(r"^```(\w+) (gan-port|lightning-gan)\s*\n", text, re.M)}


def test_the_page_states_the_real_line_counts_of_the_gan_port():
    found = _named_blocks()
    (lightning_lang, lightning), (port_lang, port) = found["lightning-gan"], found["gan-port"]
    assert (lightning_lang, port_lang) == ("text", "python")
    original, ported = lightning.splitlines(), port.splitlines()
    diff = list(difflib.unified_diff(original, ported, lineterm="", n=0))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    text = " ".join(PAGE.read_text().split())
    section = text[text.index("A whole example: Lightning's GAN"):]
    stated = re.search(r"the Lightning original has (\d+) lines, the port (\d+); the diff "
                       r"removes (\d+) lines and adds (\d+); (\d+) lines are the same", section)
    assert stated, "docs/porting.md lost the sentence stating the GAN port's line counts"
    assert [int(g) for g in stated.groups()] == [len(original), len(ported), removed, added,
                                                 len(original) - removed]


def test_the_gan_port_keeps_lightnings_flow():
    port = _named_blocks()["gan-port"][1]
    assert port.index('opt.step("generator"') < port.index('opt.step("discriminator"')
    for name in ("class GAN(TrainModule)", "self.automatic_optimization = False",
                 "def training_step(self, model, batch, opt)", "self.save_hyperparameters()",
                 'self.log_dict({"d_loss": d_loss, "g_loss": g_loss})'):
        assert name in port
