"""One mesh-shape grammar in Python (`strategies.Hybrid`), on the command line (`--mesh_shape`)
and in YAML config files (real lists and mappings, not only quoted strings)."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import yaml

from jaxlight import ConfigurationError, strategies
from jaxlight._cli import build_strategy, main, run
from jaxlight._cli._lightning_form import parse_recipe

QUIET = ["--enable-progress-bar", "false", "--enable-model-summary", "false", "--logger", "none"]

#: (the value as a user writes it, the mesh it builds on 8 devices)
SHAPES = [
    ([[4, 2], ["fsdp", "tp"]], {"fsdp": 4, "tp": 2}),
    ({"data": 2, "fsdp": -1}, {"data": 2, "fsdp": 4}),
    ([[2, 2, 2], ["data", "fsdp", "model"]], {"data": 2, "fsdp": 2, "tp": 2}),  # model -> tp
    ({"data": 4, "tensor": 2}, {"data": 4, "tp": 2}),
]


def _parsed(argv):
    """The one parser's reading of `jaxlight fit digits ARGV`."""
    return parse_recipe("fit", "digits", argv)[1]


def _mesh(strategy) -> dict[str, int]:
    strategy.setup(None)
    return dict(strategy.mesh.shape)


@pytest.mark.parametrize(("shape", "mesh"), SHAPES)
def test_same_shapes_through_python_flag_and_yaml(tmp_path, shape, mesh):
    # Python.
    assert _mesh(strategies.Hybrid(shape)) == mesh
    # --mesh-shape, as JSON text and in YAML flow style.
    assert _mesh(build_strategy("auto", json.dumps(shape))) == mesh
    flow = yaml.safe_dump(shape, default_flow_style=True).strip()
    assert _mesh(build_strategy("hybrid", flow)) == mesh
    # A YAML config file holding a real list or mapping (block and flow style).
    for style in (False, True):
        path = tmp_path / f"run{style}.yaml"
        path.write_text(yaml.safe_dump({"mesh_shape": shape}, default_flow_style=style))
        cfg = _parsed(["--config", str(path)])
        assert _mesh(build_strategy(cfg.trainer.strategy, cfg.mesh_shape)) == mesh


@pytest.mark.slow
def test_yaml_list_form_mesh_shape_trains(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text('mesh_shape: [[4, 2], ["fsdp", "tp"]]\nmax_steps: 3\n'
                    "model:\n  width: 32\n  hidden: 32\n")
    result = run("fit", "digits", ["--config", str(path), *QUIET])
    assert isinstance(result.fit.strategy, strategies.Hybrid)
    assert dict(result.fit.strategy.mesh.shape) == {"fsdp": 4, "tp": 2}
    assert result.metrics["global_step"] == 3
    assert 0.0 <= result.metrics["val_accuracy"] <= 1.0
    # --print-config writes the mesh back as the file gave it, and it reads in again.
    printed = tmp_path / "printed.yaml"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["fit", "digits", "--config", str(path), "--print-config"]) == 0
    printed.write_text(out.getvalue())
    assert yaml.safe_load(out.getvalue())["mesh_shape"] == [[4, 2], ["fsdp", "tp"]]
    cfg = _parsed(["--config", str(printed)])
    assert _mesh(build_strategy(cfg.trainer.strategy, cfg.mesh_shape)) == {"fsdp": 4, "tp": 2}


@pytest.mark.parametrize(("value", "message"), [
    ([[4, 2], ["fsdp", "modle"]], "unknown mesh axis 'modle'"),
    ([[4, 2], ["fsdp"]], "has 2 sizes but 1 axis names"),
    ({"data": -1, "fsdp": -1}, "at most one axis may be -1"),
])
def test_bad_yaml_mesh_shape_names_the_file_and_the_forms(tmp_path, capsys, value, message):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"mesh_shape": value}))
    assert main(["fit", "digits", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "jaxlight: error: mesh_shape: " in err
    assert message in err and "accepted forms of a mesh shape:" in err
    with pytest.raises(ConfigurationError, match=message):
        strategies.Hybrid(value)
