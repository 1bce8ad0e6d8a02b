"""A byte-level GPT on the Python standard library's source code, which every machine has.

`jaxlight.nn.TransformerLM` (RMSNorm, rotary positions, SwiGLU, causal attention, one `Stacked`
block with logical-axis annotations) learns to continue Python source one byte at a time. The
same module trains unchanged under every strategy; the recipe reports validation bits per byte
and prints a sample from the trained model at the end.

    jaxlight fit gpt                                       # the CPU-sized `tiny` preset
    jaxlight fit gpt --strategy fsdp --max-steps 100
    jaxlight fit gpt --strategy "gpipe(stages=4, microbatches=8)"
    jaxlight fit gpt --mesh-shape data=2,fsdp=2,tp=2 --model.num_layers 8
    jaxlight fit gpt --preset 125m                         # on an accelerator
    jaxlight fit gpt --preset 1b --mesh-shape fsdp=-1      # ~1.07B parameters

Presets (`--preset`): `tiny` (0.23M parameters, seconds per hundred steps on a laptop CPU),
`125m` (GPT-2-small shape with a 256-byte vocabulary: 113M parameters) and `1b` (Llama-style
2048 wide, 16 layers: 1.07B parameters). Sizes are computed by `num_parameters`.

The corpus is deterministic: `*.py` files under `os.path.dirname(os.__file__)` sorted by path,
every file whose CRC-32 of its relative path is 0 modulo `data.val_every` held out for
validation (so the split does not depend on which other files exist), cut into windows of
`seq_len + 1` bytes.

From Python:

    >>> from jaxlight.recipes import gpt
    >>> config = gpt.Config()
    >>> gpt.num_parameters(config.model)
    229952
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import hashlib
import math
import os
import zlib
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from jaxlight import distributed
from jaxlight._errors import ConfigurationError, DataError
from jaxlight._fit._cache import cache_home
from jaxlight.data import ArrayLoader, RecordSource, write_records
from jaxlight.module._module import TrainModule
from jaxlight.nn import TransformerConfig, TransformerLM
from jaxlight.recipes._base import Recipe, RecipeData, option, section

__all__ = ["GPT", "Config", "build", "generate", "generate_bytes", "load_corpus",
           "num_parameters"]

VOCAB_SIZE = 256  # bytes: no tokenizer to download, and every file is valid input
PAD_BYTE = ord("\n")  # left padding of short prompts: a blank line reads naturally as code


@dataclasses.dataclass
class ModelConfig:
    num_layers: int = option(4, "transformer blocks; 4 divides GPipe(stages=2 or 4)")
    embed_dim: int = option(64, "model width; a multiple of 8 so fsdp and tp split it")
    num_heads: int = option(4, "attention heads (head width embed_dim / num_heads = 16)")
    mlp_dim: int = option(192, "SwiGLU hidden width: 3x embed_dim keeps the MLP at 2/3 of a "
                               "block's parameters, as in Llama")
    rope_theta: float = option(10_000.0, "rotary base wavelength")
    tie_embeddings: bool = option(True, "share the byte embedding with the output head")
    remat: bool | Literal["none", "full", "dots"] = option(
        False, "recompute in the backward pass instead of storing: true/'full' (whole blocks, "
               "least memory), 'dots' (keep the weight matmuls' outputs), false/'none'")
    dtype: Literal["float32", "bfloat16"] = option(
        "float32", "compute dtype; for bf16 training prefer --precision bf16-mixed")
    attention: Literal["auto", "xla", "cudnn"] = option(
        "auto", "attention kernel: 'auto' uses cuDNN flash attention on a CUDA GPU in bf16, "
                "XLA elsewhere")


@dataclasses.dataclass
class DataConfig:
    seq_len: int = option(64, "bytes of context per example (two lines of code): short, so "
                              "that the tiny preset trains on a CPU")
    batch_size: int = option(32, "global batch in sequences; a multiple of 8 devices")
    corpus: str | None = option(None, "directory of *.py files; None: the standard library "
                                      "(os.path.dirname(os.__file__))")
    recursive: bool = option(False, "include subpackages (31 MB instead of 4.7 MB on 3.11)")
    max_train_bytes: int | None = option(None, "truncate the training bytes (quick runs)")
    val_every: int = option(20, "hold out 1 file in val_every for validation (about 5%)")
    val_windows: int = option(256, "validation windows, evenly spaced over the held-out bytes")
    loader: Literal["grain", "memory"] = option(
        "grain", "'grain': training windows written once as ArrayRecord files and read back "
                 "through a grain pipeline (shuffled, sharded per process, resumable); 'memory': "
                 "one in-memory array behind an ArrayLoader")
    records_dir: str | None = option(
        None, "where the grain loader's record files live; None: $XDG_CACHE_HOME/jaxlight/gpt/"
              "<digest of the corpus files and settings> (written on first use, then reused)")
    workers: int = option(0, "grain worker processes reading batches (0: read in the training "
                             "process, in grain's background threads)")


@dataclasses.dataclass
class OptimConfig:
    lr: float = option(3e-3, "peak AdamW learning rate; small models take large rates")
    warmup_steps: int = option(50, "linear warm-up steps")
    min_lr_ratio: float = option(0.1, "cosine decay ends at lr * min_lr_ratio")
    weight_decay: float = option(0.1, "AdamW weight decay (as in GPT-2/3 training)")
    b2: float = option(0.95, "Adam beta2; 0.95 is steadier than 0.999 for transformers")


@dataclasses.dataclass
class SampleConfig:
    prompt: str = option("def ", "text the sample at the end continues")
    max_new_tokens: int = option(200, "bytes to generate (0: no sample)")
    temperature: float = option(0.8, "sampling temperature; 0 decodes greedily")
    seed: int = option(0, "sampling seed")


@dataclasses.dataclass
class Config:
    """Every setting of the gpt recipe (`jaxlight fit gpt --help` lists them)."""

    model: ModelConfig = section(ModelConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    sample: SampleConfig = section(SampleConfig)


def transformer_config(model: ModelConfig):
    """The `jaxlight.nn.TransformerConfig` of a recipe model config."""
    return TransformerConfig(
        vocab_size=VOCAB_SIZE, embed_dim=model.embed_dim, num_layers=model.num_layers,
        num_heads=model.num_heads, mlp_dim=model.mlp_dim, rope_theta=model.rope_theta,
        tie_embeddings=model.tie_embeddings, remat=model.remat, attention=model.attention,
        dtype=None if model.dtype == "float32" else jnp.dtype(model.dtype),
    )


def num_parameters(model: ModelConfig) -> int:
    """Parameters of the model (computed from its abstract shapes, no memory used)."""
    return _num_parameters(dataclasses.astuple(model))


@functools.lru_cache(maxsize=32)
def _num_parameters(fields: tuple) -> int:
    # Cached: building the abstract model is host work that must not repeat per step.
    config = transformer_config(ModelConfig(*fields))
    abstract = nnx.eval_shape(lambda: TransformerLM(config, rngs=nnx.Rngs(0)))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


class GPT(TrainModule):
    """A byte-level causal language model on `{"tokens": uint8[batch, seq_len + 1]}` batches.

    Args:
        num_layers, embed_dim, num_heads, mlp_dim, rope_theta, tie_embeddings, remat, dtype,
            attention: the `jaxlight.nn.TransformerConfig` (vocabulary: 256 bytes).
        lr, warmup_steps, min_lr_ratio, weight_decay, b2: AdamW with warm-up and cosine decay.
        decay_steps: length of the cosine decay (the fit's max_steps); None keeps the peak rate.
    """

    def __init__(self, num_layers: int = 4, embed_dim: int = 128, num_heads: int = 4,
                 mlp_dim: int = 384, rope_theta: float = 10_000.0, tie_embeddings: bool = True,
                 remat: bool | str = False, dtype: str = "float32", lr: float = 3e-3,
                 warmup_steps: int = 50, min_lr_ratio: float = 0.1, weight_decay: float = 0.1,
                 b2: float = 0.95, decay_steps: int | None = None, attention: str = "auto"):
        super().__init__()
        self.model_config = ModelConfig(num_layers, embed_dim, num_heads, mlp_dim, rope_theta,
                                        tie_embeddings, remat, dtype, attention)
        self.lr, self.warmup_steps, self.min_lr_ratio = lr, warmup_steps, min_lr_ratio
        self.weight_decay, self.b2, self.decay_steps = weight_decay, b2, decay_steps

    def configure_model(self, rngs: nnx.Rngs) -> nnx.Module:
        return TransformerLM(transformer_config(self.model_config), rngs=rngs)

    def configure_optimizers(self) -> optax.GradientTransformation:
        warmup = max(self.warmup_steps, 1)
        if self.decay_steps and self.decay_steps > warmup:
            lr = optax.warmup_cosine_decay_schedule(
                0.0, self.lr, warmup, self.decay_steps, end_value=self.lr * self.min_lr_ratio)
        else:
            lr = optax.linear_schedule(0.0, self.lr, warmup)
        # No decay on norm scales: they are gains, not weights (stacked ones are 2-d, hence
        # the path test rather than nanoGPT's ndim test).
        mask = lambda params: jax.tree_util.tree_map_with_path(
            lambda path, p: p.ndim > 1 and "norm" not in jax.tree_util.keystr(path), params)
        return optax.adamw(lr, b1=0.9, b2=self.b2, weight_decay=self.weight_decay, mask=mask)

    def _loss(self, model, batch):
        tokens = batch["tokens"].astype(jnp.int32)
        logits = model(tokens[:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
        return losses.mean()

    def training_step(self, model, batch):
        loss = self._loss(model, batch)
        return loss, {"bits_per_byte": loss / math.log(2)}

    def validation_step(self, model, batch):
        loss = self._loss(model, batch)
        return {"loss": loss, "bits_per_byte": loss / math.log(2)}

    def tokens_per_batch(self, batch) -> int:
        n, length = np.shape(batch["tokens"])
        return n * (length - 1)

    def flops_per_batch(self, batch) -> float:
        """6·N·T for the weights plus 12·layers·seq·width·T for attention (PaLM, appendix B)."""
        c = self.model_config
        tokens = self.tokens_per_batch(batch)
        seq = np.shape(batch["tokens"])[1] - 1
        dense = num_parameters(c) - (VOCAB_SIZE * c.embed_dim if c.tie_embeddings else 0)
        return 6.0 * dense * tokens + 12.0 * c.num_layers * seq * c.embed_dim * tokens


# -- data ------------------------------------------------------------------------------------------


def corpus_files(config: DataConfig) -> tuple[list[str], list[str]]:
    """(train files, validation files), deterministic for a given directory."""
    root = config.corpus or os.path.dirname(os.__file__)
    pattern = os.path.join(root, "**", "*.py") if config.recursive else os.path.join(root, "*.py")
    files = sorted(f for f in glob.glob(pattern, recursive=config.recursive)
                   if "site-packages" not in f)
    if not files:
        raise DataError(f"gpt recipe: no *.py files in {root!r}; set --data.corpus to a "
                        "directory of Python sources.")
    train, val = [], []
    for f in files:
        rel = os.path.relpath(f, root)
        (val if zlib.crc32(rel.encode()) % config.val_every == 0 else train).append(f)
    if not val:  # a tiny custom corpus: hold out its last file
        val.append(train.pop())
    return train, val


def _read(files: list[str], limit: int | None = None) -> np.ndarray:
    chunks, total = [], 0
    for f in files:
        with open(f, "rb") as fh:
            data = fh.read()
        chunks.append(data + b"\n\n")
        total += len(data) + 2
        if limit is not None and total >= limit:
            break
    out = np.frombuffer(b"".join(chunks), np.uint8)
    return out[:limit] if limit is not None else out


def train_windows(config: DataConfig) -> np.ndarray:
    """uint8[n, seq_len+1]: the training bytes cut into non-overlapping windows (every byte is a
    target once per pass)."""
    width = config.seq_len + 1
    train = _read(corpus_files(config)[0], config.max_train_bytes)
    n = len(train) // width
    return np.ascontiguousarray(train[: n * width].reshape(n, width))


def val_windows(config: DataConfig) -> np.ndarray:
    """uint8[m, seq_len+1]: `val_windows` windows evenly spaced over the held-out bytes."""
    width = config.seq_len + 1
    val = _read(corpus_files(config)[1])
    m = len(val) // width
    windows = val[: m * width].reshape(m, width)
    if config.val_windows and m > config.val_windows:
        windows = windows[np.linspace(0, m - 1, config.val_windows).astype(np.int64)]
    return np.ascontiguousarray(windows)


def load_corpus(config: DataConfig) -> dict[str, np.ndarray]:
    """`{"train": uint8[n, seq_len+1], "val": uint8[m, seq_len+1]}` windows of source bytes."""
    return {"train": train_windows(config), "val": val_windows(config)}


def records_path(config: DataConfig) -> str:
    """The ArrayRecord file holding the training windows of `config` (see `DataConfig.loader`).

    Its default directory is named by a digest of what decides its contents (the training files'
    paths, sizes and modification times, `seq_len`, `max_train_bytes`), so a changed corpus or
    setting gets new records and an unchanged one reuses them.
    """
    if config.records_dir is not None:
        return os.path.join(os.path.abspath(config.records_dir), "train.array_record")
    train_files, _ = corpus_files(config)
    digest = hashlib.sha256(repr((
        RECORDS_VERSION, config.seq_len, config.max_train_bytes,
        [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in train_files],
    )).encode()).hexdigest()[:16]
    return os.path.join(cache_home(), "gpt", digest, "train.array_record")


#: Bumped when the record layout changes, so old cached records are not read.
RECORDS_VERSION = 1


def write_train_records(config: DataConfig) -> RecordSource:
    """The training windows as records on disk (written once; every process writes its own copy
    atomically, so processes on one disk or on many never read a half-written file)."""
    path = records_path(config)
    if not os.path.exists(path + ".json"):  # the layout, renamed last, marks a whole set
        windows = train_windows(config)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        write_records(tmp, {"tokens": windows})
        os.replace(tmp, path)
        os.replace(tmp + ".json", path + ".json")
    return RecordSource(path)


def _grain():
    try:
        import grain  # an extra of jaxlight (`jaxlight[grain]`); this recipe's loader needs it
    except ImportError as e:
        raise ConfigurationError(
            "gpt recipe: --data.loader grain needs grain (and its ArrayRecord files): pip install "
            "'jaxlight[grain]', or pass --data.loader memory.") from e
    return grain


def train_pipeline(config: DataConfig, source: RecordSource):
    """The grain pipeline of the training windows: this process's share, shuffled, reshuffled every
    pass, batched, endless (the run is bounded by `max_steps`).

    Indices are shuffled and batched first and each batch's records are read from disk in one call
    (`RecordSource.read_batch`), which keeps up with small models where one read per record would
    not. The pipeline's iterator state (an index) goes into jaxlight's checkpoints, so a resumed run
    continues with the next batch.
    """
    grain = _grain()
    processes = distributed.process_count()
    if config.batch_size % processes:
        raise ConfigurationError(
            f"gpt recipe: --data.batch-size {config.batch_size} does not split over {processes} "
            f"processes; use a multiple of {processes}.")
    shard = grain.sharding.ShardByJaxProcess(drop_remainder=True)
    pipeline = (grain.MapDataset.range(len(source))[shard.shard_index::shard.shard_count]
                .shuffle(seed=0).repeat(None)
                .batch(config.batch_size // processes, drop_remainder=True)
                .map(source.read_batch))
    if config.workers:
        pipeline = pipeline.to_iter_dataset().mp_prefetch(
            grain.MultiprocessingOptions(num_workers=config.workers))
    return pipeline


# -- sampling --------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("graphdef", "window", "max_new_tokens"))
def _decode(graphdef, state, context, key, temperature, *, window: int, max_new_tokens: int):
    buf = jnp.concatenate([context, jnp.zeros((max_new_tokens,), jnp.int32)])

    def step(i, carry):
        buf, key, state = carry
        # The weights ride in the loop carry and the model is merged inside the body: NNX
        # refuses variables holding tracers of an outer trace level.
        model = nnx.merge(graphdef, state)
        ctx = jax.lax.dynamic_slice(buf, (i,), (window,))
        logits = model(ctx[None])[0, -1].astype(jnp.float32)
        key, sub = jax.random.split(key)
        sampled = jax.random.categorical(sub, logits / jnp.maximum(temperature, 1e-6))
        token = jnp.where(temperature > 0, sampled, jnp.argmax(logits)).astype(jnp.int32)
        return buf.at[window + i].set(token), key, state

    buf, _, _ = jax.lax.fori_loop(0, max_new_tokens, step, (buf, key, state))
    return buf[window:]


def generate(model: nnx.Module, prompt: str | bytes, max_new_tokens: int = 200, *,
             temperature: float = 0.8, seed: int = 0, window: int = 64) -> str:
    """`generate_bytes` decoded as UTF-8 (a byte model may split a character: replaced)."""
    return generate_bytes(model, prompt, max_new_tokens, temperature=temperature, seed=seed,
                          window=window).decode("utf-8", errors="replace")


def generate_bytes(model: nnx.Module, prompt: str | bytes, max_new_tokens: int = 200, *,
                   temperature: float = 0.8, seed: int = 0, window: int = 64) -> bytes:
    """Continues `prompt` byte by byte with one jitted loop (a sliding `window` of context).

    Each new byte runs the model over the last `window` bytes, the length it was trained on, so
    rotary positions never leave the trained range. `temperature=0` decodes greedily.

    Example:
        >>> from jaxlight.nn import TransformerConfig, TransformerLM
        >>> from flax import nnx
        >>> lm = TransformerLM(TransformerConfig(vocab_size=256, embed_dim=16, num_layers=1,
        ...                                      num_heads=2), rngs=nnx.Rngs(0))
        >>> len(generate_bytes(lm, "x = ", 5, temperature=0.0, window=8))
        5
    """
    data = prompt.encode() if isinstance(prompt, str) else bytes(prompt)
    data = data[-window:]
    context = np.full((window,), PAD_BYTE, np.int32)
    if data:
        context[window - len(data):] = np.frombuffer(data, np.uint8)
    graphdef, state = nnx.split(model)
    out = _decode(graphdef, state, jnp.asarray(context), jax.random.key(seed),
                  jnp.float32(temperature), window=window, max_new_tokens=max_new_tokens)
    if jax.process_count() > 1:
        out = multihost_utils.process_allgather(out, tiled=True)
    return bytes(np.asarray(out).astype(np.uint8).tolist())


# -- the recipe ------------------------------------------------------------------------------------


def make_module(config: Config, max_steps: int | None = None) -> GPT:
    m, o = config.model, config.optim
    return GPT(num_layers=m.num_layers, embed_dim=m.embed_dim, num_heads=m.num_heads,
               mlp_dim=m.mlp_dim, rope_theta=m.rope_theta, tie_embeddings=m.tie_embeddings,
               remat=m.remat, dtype=m.dtype, lr=o.lr, warmup_steps=o.warmup_steps,
               min_lr_ratio=o.min_lr_ratio, weight_decay=o.weight_decay, b2=o.b2,
               decay_steps=max_steps, attention=m.attention)


def build(config: Config | None = None, max_steps: int | None = None) -> tuple[GPT, RecipeData]:
    """The language model and its loaders (train shuffled per epoch, validation in order)."""
    config = config or Config()
    d = config.data
    batch = d.batch_size
    if d.loader == "grain":
        if max_steps is None:
            raise ConfigurationError(
                "gpt recipe: the grain loader streams the training windows endlessly (reshuffled "
                "every pass), so the run needs --max-steps; or pass --data.loader memory to count "
                "epochs with --max-epochs.")
        _grain()  # before writing records: ArrayRecord comes with grain
        source = write_train_records(d)
        train, train_bytes = train_pipeline(d, source), len(source) * (d.seq_len + 1)
        val = val_windows(d)
    else:
        corpus = load_corpus(d)
        train = ArrayLoader({"tokens": corpus["train"]}, batch, shuffle=True, seed=0)
        train_bytes, val = corpus["train"].size, corpus["val"]
    # The validation windows (256 by default) stay in memory: a small, ordered set.
    data = RecipeData(
        train=train,
        val=ArrayLoader({"tokens": val}, min(batch, len(val)), shuffle=False,
                        drop_remainder=False),
        extras={"train_bytes": train_bytes, "val_bytes": val.size},
    )
    return make_module(config, max_steps), data


def after_fit(fit, module: GPT, data: RecipeData, config: Config) -> dict:
    """A sample from the trained model (process 0 prints it)."""
    s = config.sample
    if s.max_new_tokens <= 0:
        return {}
    text = generate(module.model, s.prompt, s.max_new_tokens, temperature=s.temperature,
                    seed=s.seed, window=config.data.seq_len)
    return {"sample": s.prompt + text}


def _preset(model: dict, data: dict, optim: dict, fit: dict) -> dict:
    return {"config": {"model": model, "data": data, "optim": optim}, "fit": fit}


PRESETS = {
    "tiny": _preset({}, {}, {}, {}),
    # GPT-2 small's shape (12 x 768, 12 heads) with a SwiGLU of 3072 and a byte vocabulary:
    # 113M parameters (GPT-2's 124M include a 38M-parameter embedding of 50,257 tokens).
    "125m": _preset(
        {"num_layers": 12, "embed_dim": 768, "num_heads": 12, "mlp_dim": 3072},
        {"seq_len": 1024, "batch_size": 64, "recursive": True},
        {"lr": 6e-4, "warmup_steps": 500},
        {"max_steps": 5000, "precision": "bf16-mixed", "log_every_n_steps": 50,
         "val_check_interval": 500},
    ),
    # Llama-style 2048 x 16 layers, 16 heads of 128, SwiGLU 8192: 1.07B parameters.
    "1b": _preset(
        {"num_layers": 16, "embed_dim": 2048, "num_heads": 16, "mlp_dim": 8192, "remat": True},
        {"seq_len": 2048, "batch_size": 32, "recursive": True},
        {"lr": 3e-4, "warmup_steps": 1000},
        {"max_steps": 10000, "precision": "bf16-mixed", "log_every_n_steps": 50,
         "val_check_interval": 1000},
    ),
}

RECIPE = Recipe(
    name="gpt",
    summary="byte-level transformer LM on the Python standard library; reports bits per byte",
    config=Config,
    build=build,
    # Validation every val_check_interval steps counted across epochs (Lightning's
    # check_val_every_n_epoch=None): the interval may be longer than an epoch.
    fit_defaults={"max_steps": 300, "log_every_n_steps": 25, "val_check_interval": 100,
                  "check_val_every_n_epoch": None},
    presets=PRESETS,
    after_fit=after_fit,
)
