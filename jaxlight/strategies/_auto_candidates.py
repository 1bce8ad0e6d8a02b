"""Auto's candidate layouts: every `data × fsdp × tp × pipe` factorization of the devices the
model allows (and `data × context` for long sequences, `data × fsdp × expert` for a model with
mixture-of-experts layers), and the screen that refuses or sizes each one without compiling."""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxlight._errors import JaxlightError
from jaxlight.nn._mpmd import stage_index
from jaxlight.sharding._layout import axes_of
from jaxlight.strategies._base import Strategy
from jaxlight.strategies._mpmd import MpmdGPipe
from jaxlight.strategies._paths import place
from jaxlight.strategies._rules import DEFAULT_RULES
from jaxlight.strategies._sharded import FSDP, Hybrid
from jaxlight.strategies._spmd import DataParallel, SingleDevice


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass
class Candidate:
    """One layout Auto considered, and what it learned about it.

    Attributes:
        layout: `"data=4,fsdp=2"`-style mesh (plus `reshard` for FSDP's per-layer variant).
        strategy: the strategy that implements it.
        status: `chosen`, `fits`, `too big`, `args exceed budget`, `not compiled`, or
            `refused` (its layout cannot hold the model or the batch; see `reason`).
        reason: why it was skipped or refused ("" otherwise).
        argument_bytes: parameters, optimizer state and batch per device (exact, before
            compiling; equals `memory_analysis().argument_size_in_bytes`).
        bytes_per_device: compiled arguments + outputs + temporaries - aliased (None: not
            compiled).
        collective_bytes: ring traffic of the step's collectives per device (None: not
            compiled).
        flops: FLOPs per device and step (None: not compiled).
        predicted_s: the roofline's step time (None: not compiled).
        fits: bytes_per_device within the usable budget (None: not compiled).
        compile_s: seconds its compile took.
        memory: `compiled.memory_analysis()` per device (`argument`, `output`, `temp`,
            `alias`), when compiled.
    """

    layout: str
    strategy: Strategy
    status: str = "pending"
    reason: str = ""
    argument_bytes: int | None = None
    bytes_per_device: int | None = None
    collective_bytes: float | None = None
    flops: float | None = None
    bytes_accessed: float | None = None
    predicted_s: float | None = None
    fits: bool | None = None
    compile_s: float = 0.0
    memory: dict[str, int] | None = None

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("strategy")
        return out


#: Context parallelism is a candidate from this many tokens per sequence (see `long_sequence`).
LONG_SEQUENCE = 2048


def long_sequence(abstract_batch) -> tuple[int, int]:
    """`(batch, length)` of the batch's token sequences when they are long, else `(0, 0)`.

    Sequences are integer leaves of shape `(batch, length)`; they are long when `length` is at
    least `LONG_SEQUENCE`, or at least 256 with 64 or more tokens per sequence for each
    sequence in the batch (`length >= 64 · batch`): then activations grow with the sequence,
    not the batch (a small batch cannot spread them over the devices), and splitting the
    sequence over a `context` axis is what shrinks them.
    """
    found = (0, 0)
    for leaf in jax.tree.leaves(abstract_batch) if abstract_batch is not None else ():
        shape, dtype = getattr(leaf, "shape", ()), getattr(leaf, "dtype", None)
        if len(shape) == 2 and dtype is not None and jax.numpy.issubdtype(dtype,
                                                                          jax.numpy.integer):
            batch, length = int(shape[0]), int(shape[1])
            if length >= LONG_SEQUENCE or (length >= 256 and length >= 64 * batch):
                found = max(found, (batch, length), key=lambda x: x[1])
    return found


def context_candidates(user_rules, num_devices: int, batch: int) -> list[Candidate]:
    """`data × context` layouts (context ≥ 2) whose data degree divides the batch."""
    out = []
    for context in divisors(num_devices)[1:]:
        data = num_devices // context
        if batch % data:
            continue
        mesh = {a: s for a, s in (("data", data), ("context", context)) if s > 1}
        text = ",".join(f"{a}={s}" for a, s in mesh.items())
        out.append(Candidate(text, Hybrid(mesh, rules=user_rules or None)))
    return out


def expert_candidates(user_rules, num_devices: int, experts: int) -> list[Candidate]:
    """`data × fsdp × expert` layouts (expert ≥ 2, dividing the `experts` per layer): the
    experts split over `expert`, tokens sent to them by all-to-all (`jaxlight.nn.MoE`)."""
    out = []
    for expert in divisors(num_devices)[1:]:
        if experts % expert:
            continue
        for data in divisors(num_devices // expert):
            fsdp = num_devices // (expert * data)
            mesh = {a: s for a, s in (("data", data), ("fsdp", fsdp), ("expert", expert))
                    if s > 1}
            text = ",".join(f"{a}={s}" for a, s in mesh.items())
            out.append(Candidate(text, Hybrid(mesh, rules=user_rules or None)))
    return out


def enumerate_candidates(user_rules: list, layouts: tuple[str, ...] | None, abstract_state,
                         logical_axes, num_devices: int, abstract_batch=None
                         ) -> list[Candidate]:
    """Every layout of `num_devices` the model's annotations allow, least sharded first.

    `user_rules` are Auto's own rules (before the defaults); `layouts`, when given, keeps only
    these sorted '+'-joined mesh-axes sets (`"fsdp+tp"`). With long token sequences in
    `abstract_batch` (`long_sequence`), `data × context` layouts join them; with MoE layers
    (parameters on the `expert` logical axis), `data × fsdp × expert` layouts.
    """
    rules = user_rules + DEFAULT_RULES
    # Logical names from annotations and from path rules (rules=strategies.rules.NNX).
    names = {n for p in place(rules, abstract_state, logical_axes).arrays
             if p.collection == "params" and p.logical for n in p.logical if n is not None}
    first = {}
    for name, target in rules:
        if isinstance(name, str):
            first.setdefault(name, axes_of(target))
    tp_ok = any("tp" in first.get(n, ()) for n in names)
    layers = stacked_layers(abstract_state.params, logical_axes.params)
    out: list[Candidate] = []
    n = num_devices
    for tp in divisors(n) if tp_ok else [1]:
        for pipe in divisors(n // tp) if layers else [1]:
            if layers and layers % pipe:
                continue
            for data in divisors(n // (tp * pipe)):
                fsdp = n // (tp * pipe * data)
                mesh = {a: s for a, s in (("data", data), ("pipe", pipe), ("fsdp", fsdp),
                                          ("tp", tp)) if s > 1}
                # (A jaxlight.nn.Stages model runs GPipe's schedule only: no repeats=2.)
                out.extend(layouts_of_mesh(mesh, user_rules or None,
                                           0 if _has_stages(abstract_state.params) else layers))
    # A jaxlight.nn.Stages(packed=False): the pipeline with a program per device, each holding
    # its own stages exactly (the layouts above hold it whole, or padded rows under a pipe);
    # it uses `pipe` of the devices, which need not divide their number.
    own = 1 + max((s for path, _ in jax.tree_util.tree_leaves_with_path(abstract_state.params)
                   if (s := stage_index(path)) is not None), default=-1)
    # Each with the schedules a program per device runs (priced by the roofline of its own
    # dispatch order, `MpmdProgram.roofline_seconds`): 1F1B holds fewer activations, ZB-H1
    # has a smaller bubble, interleaved 1F1B (two or more stages per device) both.
    for pipe in divisors(own):
        if 1 < pipe <= n:
            out.append(Candidate(f"pipe={pipe} mpmd", MpmdGPipe(pipe)))
            schedules = ["1f1b", "zb-h1"] + (["interleaved-1f1b"] if own >= 2 * pipe else [])
            out.extend(Candidate(f"pipe={pipe} mpmd {schedule}",
                                 MpmdGPipe(pipe, schedule=schedule)) for schedule in schedules)
    batch, length = long_sequence(abstract_batch)
    if length:
        out.extend(context_candidates(user_rules, n, batch))
    experts = expert_count(abstract_state.params, logical_axes.params)
    if experts:
        out.extend(expert_candidates(user_rules, n, experts))
    if layouts is not None:
        out = [c for c in out if "+".join(sorted(axes_key(c.layout))) in layouts]
    # Least sharded first: data parallelism communicates least when it fits; then more
    # fsdp (gathers added), then tensor parallelism (activation all-reduces), then pipes.
    def rank(c: Candidate):
        mesh = {a: (n if s == -1 else s) for a, s in c.strategy.mesh_shape.items()}
        return (n // mesh.get("data", 1), mesh.get("tp", 1), mesh.get("pipe", 1),
                mesh.get("context", 1), mesh.get("expert", 1), "reshard" in c.layout,
                "repeats" in c.layout)
    return sorted(out, key=rank)


def layouts_of_mesh(mesh: dict[str, int], rules, layers: int = 0) -> list[Candidate]:
    """The candidates of one mesh (FSDP alone has two: gather once, or per layer).

    A mesh with a `pipe` axis also gets the interleaved schedule with 2 chunks of layers per
    stage (`repeats=2`: a smaller bubble for twice the permutes and a per-step relayout of the
    stack) where `layers` splits into pipe × 2 chunks.
    """
    text = ",".join(f"{a}={s}" for a, s in mesh.items()) or "single"
    if not mesh:
        return [Candidate("single", SingleDevice())]
    if list(mesh) == ["data"]:
        return [Candidate(text, DataParallel(devices=None))]
    if list(mesh) == ["fsdp"]:
        return [Candidate(text, FSDP(rules=rules)),
                Candidate(text + " reshard", FSDP(rules=rules, reshard_after_forward=True))]
    out = [Candidate(text, Hybrid(mesh, rules=rules))]
    pipe = mesh.get("pipe", 1)
    if pipe > 1 and layers and layers % (2 * pipe) == 0:
        out.append(Candidate(text + " repeats=2", Hybrid(mesh, rules=rules, repeats=2)))
    return out


def screen(c: Candidate, devices, abstract_state, logical_axes, abstract_batch,
           usable: int) -> None:
    """Refuses what cannot hold the model or batch; exact argument bytes, no compile."""
    s = c.strategy
    try:
        s.setup(devices)
        shardings = s.state_shardings(abstract_state, logical_axes)
        state_bytes = s.bytes_per_device(abstract_state, shardings)
        batch_bytes = 0
        if abstract_batch is not None:
            s.check_batch(abstract_batch)
            batch_bytes = s.bytes_per_device(abstract_batch, s.batch_shardings(abstract_batch))
    except JaxlightError as err:
        c.status, c.reason = "refused", first_sentence(str(err))
        return
    c.argument_bytes = state_bytes + batch_bytes
    if c.argument_bytes > usable:
        c.status = "args exceed budget"


def first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    cut = line.find(". ")
    return line if cut < 0 else line[:cut + 1]


def axes_key(layout: str) -> list[str]:
    return [part.split("=")[0] for part in layout.split(" ")[0].split(",") if "=" in part]


def _has_stages(params) -> bool:
    return any("packed_" in jax.tree_util.keystr(path)
               for path, _ in jax.tree_util.tree_leaves_with_path(params))


def stacked_layers(params, logical) -> int:
    """The layer count of the model's `Stacked` blocks (their `layers` axis), 0 if none."""
    return axis_size(params, logical, "layers")


def expert_count(params, logical) -> int:
    """Experts per layer of the model's MoE layers (their `expert` axis), 0 if none."""
    return axis_size(params, logical, "expert")


def axis_size(params, logical, name: str) -> int:
    """The gcd of the sizes of the dimensions named `name` (a logical axis), 0 if none."""
    sizes = set()
    flat_axes = jax.tree.leaves(logical, is_leaf=lambda x: x is None or isinstance(x, tuple))
    for leaf, names in zip(jax.tree.leaves(params), flat_axes, strict=True):
        if isinstance(names, tuple) and name in names:
            sizes.add(leaf.shape[names.index(name)])
    return math.gcd(*sizes) if sizes else 0
