"""Path rules: stock Flax NNX models (no annotations) shard by parameter name (issue 16 item 1).

A plain `nnx.Linear` MLP and a plain NNX transformer (`nnx.Embed`, `nnx.MultiHeadAttention`,
`nnx.LayerNorm`, `nnx.Linear`) train under TensorParallel(2), FSDP and Hybrid(fsdp x tp) with
`strategies.rules.NNX` and match the single-device run to 1e-5; under TensorParallel(2) their
collectives are those of the same models written with `jaxlight.nn`'s annotated layers.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxlight as jl
from jaxlight import nn, strategies
from jaxlight.analysis._hlo import collectives, summarize
from jaxlight.callbacks import Callback
from jaxlight.strategies.rules import NNX

STEPS = 3
RTOL = 1e-5
VOCAB, WIDTH, HEADS, HIDDEN, LENGTH = 32, 16, 2, 32, 8


# -- the models: stock NNX, and the same maths with jaxlight.nn's annotated layers ------------


class StockMLP(nnx.Module):
    def __init__(self, din, hidden, dout, *, rngs):
        self.linear1 = nnx.Linear(din, hidden, rngs=rngs)
        self.linear2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


class AnnotatedMLP(nnx.Module):
    def __init__(self, din, hidden, dout, *, rngs):
        self.linear1 = nn.Dense(din, hidden, axes=("embed", "mlp"), use_bias=True, rngs=rngs)
        self.linear2 = nn.Dense(hidden, dout, axes=("mlp", "embed"), use_bias=True, rngs=rngs)

    def __call__(self, x):
        return self.linear2(nnx.relu(self.linear1(x)))


def _causal(x):
    return nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))


class StockBlock(nnx.Module):
    def __init__(self, *, rngs):
        self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.linear1 = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
        self.linear2 = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), mask=_causal(x))
        return x + self.linear2(nnx.gelu(self.linear1(self.ln2(x))))


class AnnotatedBlock(nnx.Module):
    def __init__(self, *, rngs):
        norm = dict(scale_init=nnx.with_partitioning(nnx.initializers.ones, ("norm",)),
                    bias_init=nnx.with_partitioning(nnx.initializers.zeros, ("norm",)))
        head_dim = WIDTH // HEADS
        self.ln1 = nnx.LayerNorm(WIDTH, rngs=rngs, **norm)
        self.query, self.key, self.value = (
            nn.Dense(WIDTH, (HEADS, head_dim), axes=("embed", "heads", "kv"), use_bias=True,
                     rngs=rngs) for _ in range(3))
        self.out = nn.Dense((HEADS, head_dim), WIDTH, axes=("heads", "kv", "embed"),
                            use_bias=True, rngs=rngs)
        self.ln2 = nnx.LayerNorm(WIDTH, rngs=rngs, **norm)
        self.linear1 = nn.Dense(WIDTH, HIDDEN, axes=("embed", "mlp"), use_bias=True, rngs=rngs)
        self.linear2 = nn.Dense(HIDDEN, WIDTH, axes=("mlp", "embed"), use_bias=True, rngs=rngs)

    def __call__(self, x):
        h = self.ln1(x)
        attn = nnx.dot_product_attention(self.query(h), self.key(h), self.value(h),
                                         mask=_causal(x))
        x = x + self.out(attn)
        return x + self.linear2(nnx.gelu(self.linear1(self.ln2(x))))


class StockLM(nnx.Module):
    def __init__(self, *, rngs, annotated=False):
        block = AnnotatedBlock if annotated else StockBlock
        self.embed = (nn.Embed(VOCAB, WIDTH, rngs=rngs) if annotated
                      else nnx.Embed(VOCAB, WIDTH, rngs=rngs))
        self.blocks = nnx.List([block(rngs=rngs)])
        self.ln_f = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.head = (nn.Dense(WIDTH, VOCAB, axes=("embed", "vocab"), use_bias=True, rngs=rngs)
                     if annotated else nnx.Linear(WIDTH, VOCAB, rngs=rngs))

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class Classify(jl.TrainModule):
    def __init__(self, annotated=False, dout=8):
        super().__init__()
        self.annotated, self.dout = annotated, dout

    def configure_model(self, rngs):
        return (AnnotatedMLP if self.annotated else StockMLP)(16, 32, self.dout, rngs=rngs)

    def configure_optimizers(self):
        return optax.adam(1e-2)

    def training_step(self, model, batch):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


class LanguageModel(jl.TrainModule):
    def __init__(self, annotated=False):
        super().__init__()
        self.annotated = annotated

    def configure_model(self, rngs):
        return StockLM(rngs=rngs, annotated=self.annotated)

    def configure_optimizers(self):
        return optax.adam(3e-3)

    def training_step(self, model, batch):
        logits = model(batch["tokens"][:, :-1])
        return nn.lm_loss(logits, batch["tokens"][:, 1:])


def mlp_batches(steps=STEPS, n=32):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        x = rng.normal(size=(n, 16)).astype(np.float32)
        out.append({"x": x, "y": x[:, :8].argmax(-1).astype(np.int32)})
    return out


def token_batches(steps=STEPS, n=8):
    rng = np.random.default_rng(0)
    start = rng.integers(0, VOCAB, size=(steps, n, 1))
    return [{"tokens": ((s + 3 * np.arange(LENGTH + 1)) % VOCAB).astype(np.int32)}
            for s in start]


# -- training runs -------------------------------------------------------------------------


class Losses(Callback):
    def __init__(self):
        self.values = {}

    def on_log(self, fit, module, metrics, step):
        if "loss" in metrics:
            self.values[step] = metrics["loss"]


def quiet_fit(strategy, **kw):
    return jl.Fit(strategy=strategy, enable_progress_bar=False, enable_model_summary=False,
                  logger=False, enable_checkpointing=False, **kw)


def train(strategy, module, data):
    losses = Losses()
    fit = quiet_fit(strategy, max_steps=STEPS, log_every_n_steps=1, callbacks=[losses])
    fit.fit(module, data)
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(module.model, nnx.Param)))
    return fit, np.array([losses.values[s] for s in range(1, STEPS + 1)]), params


STRATEGIES = {
    "tp2": lambda: strategies.TensorParallel(2, rules=NNX),
    "fsdp": lambda: strategies.FSDP(rules=NNX),
    "hybrid_fsdp4_tp2": lambda: strategies.Hybrid({"fsdp": 4, "tp": 2}, rules=NNX),
}
MODELS = {"mlp": (Classify, mlp_batches), "transformer": (LanguageModel, token_batches)}


@pytest.fixture(scope="module")
def runs():
    return {}


def run(runs, model, strategy):
    key = (model, strategy)
    if key not in runs:
        make, data = MODELS[model]
        chosen = strategies.SingleDevice() if strategy == "single" else STRATEGIES[strategy]()
        runs[key] = train(chosen, make(), data())
    return runs[key]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("model", list(MODELS))
def test_stock_model_matches_single_device(runs, model, strategy):
    _, ref_losses, ref_params = run(runs, model, "single")
    fit, losses, params = run(runs, model, strategy)
    assert ref_losses[-1] < ref_losses[0], "the reference run must learn"
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL, atol=0)
    flat_ref = dict(jax.tree_util.tree_leaves_with_path(ref_params))
    for path, value in jax.tree_util.tree_leaves_with_path(params):
        ref = flat_ref[path]
        if jax.tree_util.keystr(path).endswith("['attn']['key']['bias']"):
            # Its gradient is zero in exact arithmetic (softmax ignores the per-query constant
            # q·b it adds to every score), so Adam moves it by rounding noise alone.
            continue
        rel = np.linalg.norm(value - ref) / np.linalg.norm(ref)
        assert rel < RTOL, f"{model}/{strategy}: {jax.tree_util.keystr(path)} differs by {rel:.2e}"


@pytest.mark.slow
def test_stock_models_really_shard(runs):
    """The rules place the stock layers as jaxlight.nn would (so the agreement is not vacuous),
    and optimizer slots follow their parameters."""
    def spec(model, strategy, *keys):
        leaf = run(runs, model, strategy)[0].state.params
        for k in keys:
            leaf = leaf[k]
        return tuple(leaf.sharding.spec)

    assert spec("mlp", "tp2", "linear1", "kernel") == (None, "tp")
    assert spec("mlp", "tp2", "linear2", "kernel") == ("tp", None)
    assert spec("mlp", "fsdp", "linear1", "kernel") == ("fsdp", None)
    assert spec("mlp", "hybrid_fsdp4_tp2", "linear2", "kernel") == ("tp", "fsdp")
    query = ("blocks", 0, "attn", "query", "kernel")
    assert spec("transformer", "tp2", *query) == (None, "tp", None)
    assert spec("transformer", "tp2", "blocks", 0, "attn", "out", "kernel") == ("tp", None, None)
    assert spec("transformer", "tp2", "embed", "embedding") == ("tp", None)
    assert spec("transformer", "hybrid_fsdp4_tp2", *query) == ("fsdp", "tp", None)
    assert spec("transformer", "hybrid_fsdp4_tp2", "head", "kernel") == ("fsdp", "tp")
    fit = run(runs, "transformer", "hybrid_fsdp4_tp2")[0]
    mu = fit.state.opt_state[0].mu["blocks"][0]["attn"]["query"]["kernel"]
    assert tuple(mu.sharding.spec) == ("fsdp", "tp", None)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_tensor_parallel_collectives_match_the_annotated_model(runs, model):
    """Same layouts, and the same collective kinds, counts and bytes per step (counted in the
    compiled HLO, as fit.plan does), as the twin built from jaxlight.nn's annotated layers."""
    stock = run(runs, model, "tp2")[0]
    make, data = MODELS[model]
    twin = quiet_fit(strategies.TensorParallel(2), max_steps=1)
    annotated = twin.plan(make(annotated=True), data(1)[0], verbose=False)

    trained = sorted((x.shape, tuple(x.sharding.spec)) for x in jax.tree.leaves(stock.state.params))
    planned = sorted((x.shape, tuple(s.spec)) for x, s in zip(
        jax.tree.leaves(twin.session.spec.abstract_state.params),
        jax.tree.leaves(twin.session.shardings.params),
        strict=True))
    assert trained == planned
    totals = summarize(collectives(stock.compiled_train_step.as_text()))
    assert totals == annotated.collective_totals
    assert totals["all-reduce"]["count"] > 0


def test_plan_shows_the_rule_that_placed_each_parameter():
    class ThreeLayers(nnx.Module):
        def __init__(self, *, rngs):
            self.linear1 = nnx.Linear(16, 32, rngs=rngs)
            self.linear2 = nnx.Linear(32, 16, rngs=rngs)
            self.extra = nnx.Linear(16, 8, rngs=rngs)

        def __call__(self, x):
            return self.extra(self.linear2(nnx.relu(self.linear1(x))))

    class Module(Classify):
        def configure_model(self, rngs):
            return ThreeLayers(rngs=rngs)

    mine = (r"\['linear1'\]\['kernel'\]$", ("embed", "mlp"))
    fit = quiet_fit(strategies.TensorParallel(2, rules=[mine, *NNX]), max_steps=1)
    plan = fit.plan(Module(), mlp_batches(1)[0], verbose=False)
    placed = {p.path: p.rule for p in plan.params}
    first = 1 + [r.pattern.pattern for r in NNX].index(r"\['(linear_?1|fc_?1|dense_?1|lin_?1|"
                                                      r"l1|up|up_proj|gate|gate_proj|w1|w3|wi|"
                                                      r"wi_0|wi_1|c_fc|fc_in)'\]\['bias'\]$")
    assert placed == {"['linear1']['kernel']": "rules[0]",  # the first match wins
                      "['linear1']['bias']": f"rules[{first}]",
                      "['linear2']['kernel']": f"rules[{first + 1}]",
                      "['linear2']['bias']": f"rules[{first + 2}]",
                      "['extra']['kernel']": "none", "['extra']['bias']": "none"}
    assert plan.unmatched == ("['extra']['bias']", "['extra']['kernel']")
    table = plan.table()
    assert "rules[0]: (r\"\\['linear1'\\]\\['kernel'\\]$\", ('embed', 'mlp'))" in table
    assert f"rules[{first + 1}]: (r" in table and "(NNX)" in table
    assert re.search(r"\['linear2'\]\['kernel'\].*P\('tp', None\).*rules\[", table)
    assert "matched no rule and carry no annotation (2): ['extra']['bias'], ['extra']['kernel']" \
        in table
    # Without path rules there is nothing to match: no list (the column still says "none").
    plain = quiet_fit(strategies.DataParallel(), max_steps=1).plan(Module(), mlp_batches(1)[0],
                                                                   verbose=False)
    assert plain.unmatched == () and {p.rule for p in plain.params} == {"none"}
    assert "matched no rule" not in plain.table()


def _setup_warnings(strategy, module) -> list[str]:
    fit = quiet_fit(strategy, max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.session.setup(module)
    return [str(w.message) for w in caught if issubclass(w.category, jl.JaxlightWarning)]


def test_a_rule_matching_nothing_warns():
    typo = (r"\['linaer1'\]\['kernel'\]", ("embed", "mlp"))
    wrong_rank = (r"\['linear2'\]\['kernel'\]", ("mlp", "embed", None))
    shadowed = (r".*linear1", ("mlp", "embed"))
    fine = (r"\['linear1'\]", ("embed", "mlp"))
    got = _setup_warnings(strategies.FSDP(rules=[typo, wrong_rank, fine, shadowed]), Classify())
    assert len(got) == 3, got
    assert got[0] == ("FSDP: path rule rules[0] (r\"\\['linaer1'\\]\\['kernel'\\]\", ('embed', "
                      "'mlp')) matched no parameter path (paths look like ['linear1']['bias'], "
                      "['linear1']['kernel'], ['linear2']['bias'], ['linear2']['kernel']); the "
                      "pattern is searched in each jax.tree_util.keystr path with re.search.")
    assert "rules[1]" in got[1] and "names 3 axes" in got[1] and "shape (32, 8)" in got[1]
    assert "rules[3]" in got[2] and "placed first by path rule rules[2]" in got[2]
    # A ready-made set warns once, and only when none of its rules matched.
    assert _setup_warnings(strategies.FSDP(rules=NNX), Classify()) == []
    class Odd(Classify):
        def configure_model(self, rngs):
            return nnx.Sequential(nnx.Linear(16, 8, rngs=rngs))

    (whole,) = _setup_warnings(strategies.FSDP(rules=NNX), Odd())
    assert whole.startswith("FSDP: the ready-made rules NNX matched none of the model's 2 ")


def test_an_indivisible_path_names_path_dimension_and_axis_sizes():
    # Ten classes: linear2's output dimension ('embed' -> fsdp) does not split 8 ways.
    fit = quiet_fit(strategies.FSDP(rules=NNX), max_steps=1)
    with pytest.raises(jl.ShardingError) as err:
        fit.fit(Classify(dout=10), mlp_batches(1))
    message = str(err.value)
    assert message.startswith(
        "parameter .params['linear2']['kernel']: dimension of size 10 (logical axis 'embed', "
        "from path rule rules[")
    assert "is not divisible by mesh axes ('fsdp',) of total size 8 (fsdp=8; dimension 1 of " \
        "shape (32, 10))" in message
    assert "(from NNX)" in message and "give this path its own rule in front" in message
    assert "train" not in fit.compile_counts


def test_annotations_win_unless_told_otherwise():
    replicate = [(r"\['linear1'\]\['kernel'\]", (None, None))]
    for override, expected in ((False, (None, "tp")), (True, (None, None))):
        fit = quiet_fit(strategies.TensorParallel(2, rules=replicate,
                                                  override_annotations=override), max_steps=1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jl.JaxlightWarning)  # the unused rule (False)
            fit.session.setup(Classify(annotated=True))
        assert tuple(fit.session.shardings.params["linear1"]["kernel"].spec) == expected
        mu = fit.session.shardings.opt_state[0].mu["linear1"]["kernel"]
        assert tuple(mu.spec) == expected


def test_explicitly_replicated_paths_skip_the_fsdp_fallback():
    rules = [(r"\['linear1'\]\['kernel'\]", (None, None))]
    fit = quiet_fit(strategies.FSDP(rules=rules, min_shard_size=16), max_steps=1)
    fit.session.setup(Classify())
    params = fit.session.shardings.params
    assert params["linear1"]["kernel"].is_fully_replicated
    assert tuple(params["linear2"]["kernel"].spec) == ("fsdp", None)  # fallback


def test_bad_rules_are_refused():
    with pytest.raises(jl.ConfigurationError, match=r"does not compile: .*Escape"):
        strategies.FSDP(rules=[("['kernel'", (None, "fsdp"))])
    with pytest.raises(jl.ConfigurationError, match=r"must map to a tuple with one logical axis"
                                                    r" name, mesh axis or None per dimension"):
        strategies.FSDP(rules=[(r".*kernel", "fsdp")])
    with pytest.raises(jl.ConfigurationError, match=r"names 'mpl', which is neither a logical "
                                                    r"axis.*Did you mean 'mlp'"):
        strategies.TensorParallel(2, rules=[(r".*kernel", ("embed", "mpl"))])
    with pytest.raises(jl.ConfigurationError, match=r"write a regular expression such as "
                                                    r"\(r'\.\*kernel', \(None, 'tp'\)\)"):
        strategies.TensorParallel(2, rules=[("kernel", (None, "tp"))])
    with pytest.raises(jl.ConfigurationError, match=r"not a mesh axis.*Did you mean 'tp'"):
        strategies.FSDP(rules={"mlp": "tpp"})


def test_mesh_axes_and_aliases_work_as_names():
    rules = [(r"\['linear1'\]\['kernel'\]", (None, "model")), ("mlp", "model")]
    strategy = strategies.TensorParallel(2, rules=rules)
    assert strategy.user_rules[0].axes == (None, "tp") and strategy.user_rules[1] == ("mlp", "tp")
    fit = quiet_fit(strategy, max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jl.JaxlightWarning)  # 'mlp' names no parameter here
        fit.session.setup(Classify())
    assert tuple(fit.session.shardings.params["linear1"]["kernel"].spec) == (None, "tp")
    assert strategy.describe()["rules"][0] == [r"\['linear1'\]\['kernel'\]", [None, "tp"]]


def test_auto_considers_tensor_parallelism_from_path_rules():
    from jaxlight.state._state import model_spec
    from jaxlight.step._step import build_optimizer

    module = Classify()
    spec = model_spec(module, build_optimizer(module, [])[0], 0)

    def layouts(auto):
        return {c.layout for c in auto.candidates(spec.abstract_state, spec.logical_axes, 8)}

    without = layouts(strategies.Auto())
    assert not any("tp" in layout for layout in without)
    assert layouts(strategies.Auto(rules=NNX)) - without == {
        "data=4,tp=2", "data=2,tp=4", "tp=8", "fsdp=4,tp=2", "fsdp=2,tp=4", "data=2,fsdp=2,tp=2"}


def test_ready_made_sets_by_name_also_from_the_command_line():
    from jaxlight._cli._build import build_strategy

    assert strategies.TensorParallel(2, rules="nnx").user_rules == NNX
    mixed = strategies.FSDP(rules=[(r"\['x'\]", (None,)), "NNX_MLP"]).user_rules
    assert mixed[1:] == strategies.rules.NNX_MLP and len(mixed) == 5
    built = build_strategy("tp(size=2, rules='NNX')")
    assert isinstance(built, strategies.TensorParallel) and built.user_rules == NNX
    with pytest.raises(jl.ConfigurationError, match=r"rules='NXX' names no ready-made rule set; "
                                                    r"the sets .* are \['NNX', .*Did you mean "
                                                    r"'NNX'\?"):
        strategies.Hybrid({"fsdp": 4, "tp": 2}, rules="NXX")
