"""The run config's core sections as frozen records, read once at the edge (issue 31).

Each core section of `dynjax.config.default_config` (``train``, ``data``, ``model``, ...) is one
frozen dataclass here, one field per key (a nested record for a nested section, as
``recompile.budget``), typed like its default; each key's one default and meaning stay the
config's. `read_run` reads a config into `RunSettings` with the schemes' own `read_settings`
(a ``Literal`` field's choice is checked there); `dynjax.config.check_run` checks the values and
their combinations on the records and adds the schemes' checked records. From there on the edge
(`dynjax.experiment`, `dynjax.train`, the launchers) reads the records' attributes, and the
layers below get records or plain values, never the config: the ConfigDict stays only for what
is written (config.json, the checkpoint's saved config) and for overrides.

A module of its own, not part of `dynjax.config`: the records and what is derived from them
alone (the pipeline's stages, the resolved microbatches) are imported by code that never loads
or checks a config (the launchers, benchmarks), and config.py keeps to loading and checking.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import ml_collections

from dynjax.balance import SCHEDULES, by_param, uniform
from dynjax.checkpoint.settings import CheckpointSettings
from dynjax.dynamism.base import read_settings
from dynjax.errors import ConfigError
from dynjax.model.attention import QK_NORMS, ROPE_SCALINGS
from dynjax.model.gpt import FAMILIES
from dynjax.model.remat import REMAT
from dynjax.optim import OptimizerSettings

DTYPES = ("float32", "bfloat16")  # train.dtype
NONFINITE = ("stop", "skip")  # train.nonfinite
STATIC_LAYOUTS = ("", "uniform", "by_param")  # named pipeline.stage_layers (seed 000 §5)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """``train``: the loop, the optimizer and the logging, evaluation and saving intervals."""

    steps: int
    batch_size: int
    learning_rate: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    grad_clip: float
    nonfinite: Literal[NONFINITE]
    max_skipped: int
    log_every: int
    eval_every: int
    eval_batches: int
    checkpoint_every: int
    keep_checkpoints: int
    dtype: Literal[DTYPES]
    peak_flops: float
    microbatches: int
    init_from: str


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """``data``: the corpus and how it is cut and read."""

    path: str
    seq_len: int
    val_fraction: float
    max_tokens: int
    tokenizer: str
    eos_token: str
    token_cache: str
    prefetch: int


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """``model``: the dense model's sizes (a scheme's blocks are its section's)."""

    vocab_size: int
    num_layers: int
    d_model: int
    num_heads: int
    mlp_dim: int
    positions: Literal["rope", "learned"]
    family: Literal[FAMILIES]
    num_kv_heads: int
    norm_eps: float
    rope_base: float
    rope_scaling: Literal[ROPE_SCALINGS]
    rope_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    rope_original_max_len: int
    qkv_bias: bool
    qk_norm: Literal[QK_NORMS]
    scan_layers: bool
    scan_min_layers: int
    remat: Literal[REMAT]


@dataclasses.dataclass(frozen=True)
class MeshSettings:
    """``mesh``: devices per axis."""

    stage: int
    data: int
    expert: int
    tensor: int


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """``parallel``: how the state is split over a stage's devices."""

    fsdp: bool


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """``pipeline``: the stage assignment, schedule and profiling."""

    stage_layers: str
    schedule: Literal[SCHEDULES]
    virtual_stages: int
    recompute: bool
    profile_every: int
    profile_on_change: bool


@dataclasses.dataclass(frozen=True)
class BalanceSettings:
    """``balance``: dynamic load balancing and re-packing (seed 000 §3.3-§3.4)."""

    enabled: bool
    every: int
    threshold: float
    by: Literal["time", "param"]
    method: Literal["partition", "diffusion"]
    amortize_steps: int
    bandwidth_bytes_per_sec: float
    recompile_seconds: float
    comm_seconds: float
    repack: bool
    repack_every: int
    repack_target: int
    repack_max_slowdown: float
    memory_bytes: float
    memory_headroom: float
    release_hook: str


@dataclasses.dataclass(frozen=True)
class BudgetSettings:
    """``recompile.budget``: at most so many recompiles within any so many steps."""

    max_recompiles: int
    window_steps: int


@dataclasses.dataclass(frozen=True)
class RecompileSettings:
    """``recompile``: the Monitor's delay, the budget and the compile caches."""

    delta_launch: int
    budget: BudgetSettings
    cache_size: int
    cache_dir: str
    blocking: bool


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The whole run config as records: ``seed``, a record per core section, and each
    scheme's `Plugin.Settings` record by name (``schemes``, in `Schemes` order; empty until
    `dynjax.config.check_run` has read and checked them)."""

    seed: int
    train: TrainSettings
    data: DataSettings
    model: ModelSettings
    mesh: MeshSettings
    parallel: ParallelSettings
    pipeline: PipelineSettings
    balance: BalanceSettings
    checkpoint: CheckpointSettings
    recompile: RecompileSettings
    schemes: tuple[tuple[str, Any], ...] = ()

    @property
    def scheme_settings(self) -> dict[str, Any]:
        """Each scheme's checked record by name: what `Schemes.build` takes."""
        return dict(self.schemes)


def core_sections() -> dict[str, type]:
    """Each core section's name and record type, in `RunSettings` order."""
    hints = typing.get_type_hints(RunSettings)
    return {
        f.name: hints[f.name]
        for f in dataclasses.fields(RunSettings)
        if dataclasses.is_dataclass(hints[f.name])
    }


def read_run(
    cfg: ml_collections.ConfigDict, schemes: Mapping[str, Any] | None = None
) -> RunSettings:
    """``cfg``'s core sections as records (each through `read_settings`: a choice outside its
    ``Literal`` is refused naming the key), with the schemes' records ``schemes`` (by name)
    if given. Keys and types are `dynjax.config.read_config`'s to check (a section with a key
    its record lacks is a TypeError here), values `dynjax.config.check_run`'s."""
    sections = {
        name: read_settings(kind, cfg[name], name) for name, kind in core_sections().items()
    }
    return RunSettings(seed=cfg.seed, **sections, schemes=tuple((schemes or {}).items()))


def num_stages(run: RunSettings) -> int:
    """Logical pipeline stages the run has (mesh.stage x pipeline.virtual_stages): 0 without a
    pipeline."""
    raw = run.pipeline.stage_layers.strip()
    if raw in STATIC_LAYOUTS:
        return 0 if run.mesh.stage == 1 else run.mesh.stage * run.pipeline.virtual_stages
    return len(stage_layers(run))


def stage_layers(run: RunSettings, layer_params: Sequence[int] | None = None) -> tuple[int, ...]:
    """Layers per logical pipeline stage from ``pipeline.stage_layers`` (mesh.stage x
    pipeline.virtual_stages of them); () when there is no pipeline.

    ``"uniform"`` (or ``""``) splits the layers evenly (Megatron-LM); ``"by_param"`` balances
    ``layer_params``, each layer's parameter count (DeepSpeed ``partition_method='parameters'``).
    """
    raw = run.pipeline.stage_layers.strip()
    if raw in STATIC_LAYOUTS:
        if run.mesh.stage == 1:
            return ()
        stages = run.mesh.stage * run.pipeline.virtual_stages
        if raw == "by_param":
            if layer_params is None:
                raise ValueError("pipeline.stage_layers='by_param' needs the layer_params")
            return by_param(layer_params, stages)
        return uniform(run.model.num_layers, stages)
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = None
    value = (value,) if isinstance(value, int) else value
    if not (
        isinstance(value, tuple)
        and value
        and all(isinstance(n, int) and not isinstance(n, bool) for n in value)
    ):
        raise ConfigError(
            f"pipeline.stage_layers={raw!r} must be a tuple of layer counts like '(1,3,2,2)', "
            "'uniform' (or '') or 'by_param'"
        )
    return value


def microbatches(run: RunSettings) -> int:
    """``train.microbatches``, with 0 resolved: 1 without a pipeline of two or more stages,
    else the largest count up to twice the (logical) stages that splits the batch evenly over
    the devices of a stage (interleaved: a multiple of mesh.stage, its groups)."""
    if run.train.microbatches:
        return run.train.microbatches
    stages = num_stages(run)
    if stages < 2:
        return 1
    per_shard = run.train.batch_size // (run.mesh.data * run.mesh.expert)
    group = run.mesh.stage if run.pipeline.virtual_stages > 1 else 1
    fits = [
        m for m in range(group, min(2 * stages, per_shard) + 1, group) if per_shard % m == 0
    ]
    return max(fits, default=1)  # no fit: check_run names the batch size to change


def optimizer_settings(train: TrainSettings) -> OptimizerSettings:
    """The optimizer's keys of ``train.*`` (`dynjax.optim.make_optimizer`)."""
    return OptimizerSettings(
        learning_rate=train.learning_rate,
        warmup_steps=train.warmup_steps,
        steps=train.steps,
        min_lr_ratio=train.min_lr_ratio,
        weight_decay=train.weight_decay,
        grad_clip=train.grad_clip,
    )
