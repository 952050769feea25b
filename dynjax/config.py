"""Run configuration: one default per key, from a config file plus ``--config.a.b=v`` overrides.

Every key lives in :func:`default_config`; config files under ``configs/`` start from it and change
values. The ConfigDict is locked so a typo fails at once with the list of valid keys, and values are
checked for consistency (heads dividing d_model, mesh against devices, ...) before any work starts.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import math
import traceback
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_collections

from dynjax.balance.schedules import INTERLEAVED, SCHEDULES, SPLIT_BACKWARD
from dynjax.checkpoint.settings import CheckpointSettings
from dynjax.corpus import eos_id, load_tokenizer
from dynjax.dynamism import BUILTIN, Schemes
from dynjax.dynamism.moe.checkpoint import SELECTIONS
from dynjax.errors import ConfigError, at_least
from dynjax.model.attention import Rope
from dynjax.model.facts import ModelFacts, moe_layer_indices
from dynjax.model.gpt import SCAN_MIN_LAYERS, GPTConfig
from dynjax.model.remat import host_offload_available
from dynjax.settings import (
    STATIC_LAYOUTS,
    BalanceSettings,
    DataSettings,
    ModelSettings,
    PipelineSettings,
    RecompileSettings,
    RunSettings,
    TrainSettings,
    microbatches,
    num_stages,
    read_run,
    stage_layers,
)


def default_config(schemes: Schemes = BUILTIN) -> ml_collections.ConfigDict:
    """Every key dynjax reads, with its one default, and a section per scheme of ``schemes``
    (the run's, given explicitly). Config files override these."""
    c = ml_collections.ConfigDict()
    c.seed = 0

    c.train = ml_collections.ConfigDict()
    c.train.steps = 200
    c.train.batch_size = 16
    c.train.learning_rate = 3e-3
    c.train.warmup_steps = 20
    c.train.min_lr_ratio = 0.1  # cosine decays to learning_rate * min_lr_ratio
    c.train.weight_decay = 0.1
    c.train.grad_clip = 1.0  # global gradient-norm bound; 0 = no clipping (nanoGPT)
    # A step whose loss or gradient norm is not finite: "stop" the run (no state after it is
    # saved), or "skip" its update (parameters and optimizer state kept) and go on.
    c.train.nonfinite = "stop"
    c.train.max_skipped = 10  # with nonfinite="skip": stop after this many skipped in a row
    c.train.log_every = 10
    c.train.eval_every = 100
    c.train.eval_batches = 4
    c.train.checkpoint_every = 100
    c.train.keep_checkpoints = 3
    c.train.dtype = "float32"  # compute dtype; parameters and optimizer state stay float32
    # Peak FLOP/s of one device for MFU; 0 = the known dense peak of the device kind and dtype
    # (none on CPU or an unknown device: then no MFU is logged).
    c.train.peak_flops = 0.0
    # Gradient accumulation steps inside one train step, and the microbatches a pipeline
    # schedule moves through its stages (the same split of the batch). 0 = auto: 1 without a
    # pipeline of 2+ stages, else the largest count <= 2 * mesh.stage that splits the batch
    # evenly (more microbatches, smaller bubbles: (S-1)/(M+S-1)); interleaved: <= 2 * the
    # logical stages and a multiple of mesh.stage.
    c.train.microbatches = 0
    # A Hugging Face model directory a fresh run's weights are read from (docs/models.md;
    # `python -m dynjax.hf import` sets it); empty: initialised from seed.
    c.train.init_from = ""

    c.data = ml_collections.ConfigDict()
    c.data.path = ""  # empty: the embedded corpus (this Python's standard library sources)
    c.data.seq_len = 128
    c.data.val_fraction = 0.05
    c.data.max_tokens = 4_000_000  # cap on tokens read from a text corpus (byte-level)
    # A Hugging Face tokenizer.json (or its model directory) tokenizing data.path once into a
    # cached token file (docs/running.md#tokenizers); empty: byte-level tokens.
    c.data.tokenizer = ""
    c.data.eos_token = ""  # the token ending each document; empty: the tokenizer's own
    c.data.token_cache = ""  # where tokenized corpora are kept; empty: ~/.cache/dynjax/tokens
    c.data.prefetch = 2  # batches read ahead on a background thread; 0: read on the loop's

    c.model = ml_collections.ConfigDict()
    c.model.vocab_size = 256
    c.model.num_layers = 4
    c.model.d_model = 128
    c.model.num_heads = 4
    c.model.mlp_dim = 512
    c.model.positions = "rope"  # "rope" | "learned"
    # The block family (docs/models.md): "gpt", GPT-2's pre-norm block (LayerNorm, GELU MLP,
    # biases); "llama", Llama's (RMSNorm, SwiGLU MLP and experts, no biases)
    c.model.family = "gpt"
    # Grouped-query attention's key/value heads, each shared by num_heads / num_kv_heads query
    # heads (Llama 2/3, Mistral, Qwen); 0 = num_heads (multi-head attention)
    c.model.num_kv_heads = 0
    c.model.norm_eps = 1e-6  # epsilon of every norm (Llama 2/3 use 1e-5)
    c.model.rope_base = 10_000.0  # RoPE's base (Llama 3: 500000)
    # RoPE's long-context scaling: "none"; "linear" (every frequency / rope_factor); "llama3"
    # (Llama 3.1: low frequencies / rope_factor, high ones kept, blended in between)
    c.model.rope_scaling = "none"
    c.model.rope_factor = 8.0  # with rope_scaling "linear" or "llama3"
    # "llama3": wavelengths above rope_original_max_len / this are scaled by rope_factor
    c.model.rope_low_freq_factor = 1.0
    # "llama3": wavelengths below rope_original_max_len / this are kept (between: blended)
    c.model.rope_high_freq_factor = 4.0
    c.model.rope_original_max_len = 8192  # the context the model was pre-trained at
    # The fused query/key/value projection has a bias while the others have none (Qwen2)
    c.model.qkv_bias = False
    # Queries and keys RMS-normalised before RoPE: "none"; "head" (per head, Qwen3);
    # "full" (over all heads' features, OLMoE)
    c.model.qk_norm = "none"
    # Each run of at least model.scan_min_layers consecutive layers with identical static
    # options runs as one `jax.lax.scan`: compile seconds about flat in depth and a step as
    # fast as unrolled (`dynjax.model.gpt.run_layers`, benchmarks/scan_compile.py). A
    # split-backward schedule (pipeline.schedule='zb_h1') unrolls its stages' layers whatever
    # this says: a scan's backward is one loop, so nothing of it could wait for W.
    c.model.scan_layers = True
    # Shorter runs are unrolled: below 8 layers a scan compiles slower on CPU and steps no
    # faster (`dynjax.model.gpt.SCAN_MIN_LAYERS`); at least 2.
    c.model.scan_min_layers = SCAN_MIN_LAYERS
    # What each block keeps for its backward (docs/models.md#activation-memory): "none" (every
    # activation); "full" (its input only: the backward recomputes its forward); "save_proj"
    # (its linear projections' outputs: the backward recomputes what lies between them);
    # "offload_proj" (those, in pinned host memory: GPU/TPU only). The Plan holds one per layer.
    # On CPU only a scanned stack (model.scan_layers) shows the saving: XLA:CPU schedules an
    # unrolled block's recomputation beside its forward, so the peak stays that of "none".
    c.model.remat = "none"


    c.mesh = ml_collections.ConfigDict()
    c.mesh.stage = 1
    c.mesh.data = 1
    c.mesh.expert = 1
    c.mesh.tensor = 1  # Megatron-style tensor parallelism of attention and MLP per stage

    c.parallel = ml_collections.ConfigDict()
    # FSDP (ZeRO-3): parameters, gradients and optimizer state split over the 'data' devices of
    # the mesh (of each stage), gathered where used; a no-op with mesh.data = 1.
    c.parallel.fsdp = True

    c.pipeline = ml_collections.ConfigDict()
    # Layers per stage, e.g. "(1,3,2,2)"; "" or "uniform" = even over mesh.stage stages
    # (Megatron-LM); "by_param" = balanced parameter counts (DeepSpeed). No pipeline when
    # mesh.stage = 1 with a named layout ("(4,)" runs the pipeline runtime on one stage).
    c.pipeline.stage_layers = ""
    # "1f1b" | "gpipe" | "interleaved_1f1b" | "zb_h1" (each backward cut into its input-gradient
    # part B and its weight-gradient part W, W deferred into the bubbles; mesh.expert =
    # mesh.tensor = 1)
    c.pipeline.schedule = "1f1b"
    # Chunks of layers per stage (interleaved_1f1b: >= 2, each stage holds non-adjacent
    # chunks; stage_layers then counts mesh.stage x virtual_stages logical stages).
    c.pipeline.virtual_stages = 1
    # A stage's backward recomputes its forward from the stored stage input (one input kept per
    # microbatch in flight); False: the forward keeps what the backward reads instead (every
    # layer's activations per microbatch in flight, no second forward; mesh.expert = mesh.tensor
    # = 1).
    c.pipeline.recompute = True
    c.pipeline.profile_every = 0  # profile per-layer times and stage memory every n steps; 0 = off
    c.pipeline.profile_on_change = True  # profile the first step of every Plan (seed 000 §3.1)

    c.balance = ml_collections.ConfigDict()  # dynamic load balancing (seed 000 §3.3, 003 §D)
    c.balance.enabled = False
    c.balance.every = 50  # decide at every n-th metrics step; 0 = only on `threshold`
    c.balance.threshold = 0.0  # also decide when a new profile's stage imbalance exceeds it
    c.balance.by = "time"  # "time" (profiled layer times) | "param" (parameter counts)
    c.balance.method = "partition"  # "partition" (exact, global) | "diffusion" (neighbours)
    c.balance.amortize_steps = 0  # steps a move's gain is summed over; 0 = the rest of the run
    c.balance.bandwidth_bytes_per_sec = 10e9  # moving a layer's parameters and optimizer state
    c.balance.recompile_seconds = 10.0  # what a move costs besides copying
    c.balance.comm_seconds = 0.0  # one activation hop per microbatch (network-aware, 003 §D.2)
    # Re-pack onto fewer stages when memory allows (seed 000 §3.4); the unused stage sub-meshes
    # are released for good (docs/parallelism.md).
    c.balance.repack = False
    c.balance.repack_every = 50  # decide at every n-th metrics step
    c.balance.repack_target = 0  # stages to pack to; 0 = as few as fit
    c.balance.repack_max_slowdown = 0.0  # accept a predicted step up to (1 + this) x today's
    # What one device of a stage may use (re-pack; rebalance too when known); 0 = the device's
    # own limit, which CPUs do not report.
    c.balance.memory_bytes = 0.0
    c.balance.memory_headroom = 0.1  # with memory_bytes = 0: fraction of the limit left free
    c.balance.release_hook = ""  # "module:function" called with the released devices

    c.checkpoint = ml_collections.ConfigDict()
    c.checkpoint.async_save = True
    # Partial expert checkpoints (MoC-System, seed 004 §3; docs/checkpointing.md):
    # K experts of each MoE layer per save; 0 = all (a full checkpoint)
    c.checkpoint.experts_per_save = 0
    c.checkpoint.pec_content = "WO"  # partial: "W" expert weights, "O" their Adam moments, both
    c.checkpoint.pec_selection = "sequential"  # "sequential" (interleaved) | "load_aware"
    c.checkpoint.plt_limit = 0.0375  # proportion of lost tokens that dynamic K keeps below
    c.checkpoint.dynamic_k = False  # double K after a recovery above plt_limit (§5.3)
    # Two-level checkpoints (seed 004 §5.1-§5.2; docs/checkpointing.md): a host
    # memory snapshot every n steps (0 = off: saves every train.checkpoint_every instead) ...
    c.checkpoint.snapshot_every = 0
    c.checkpoint.snapshot_experts = 0  # ... of K_snapshot experts per MoE layer (0 = all)
    c.checkpoint.persist_every = 0  # steps between persists to storage: a multiple of the above
    c.checkpoint.persist_experts = 0  # K_persist of the snapshot's fresh experts (0 = all of them)
    c.checkpoint.inject_fault_at = 0  # raise a transient fault once before dispatching step n

    c.recompile = ml_collections.ConfigDict()
    c.recompile.delta_launch = 2  # policies read the metrics of step t - delta (seed 001 app. B)
    c.recompile.budget = ml_collections.ConfigDict()
    c.recompile.budget.max_recompiles = 4  # at most this many recompiles ...
    c.recompile.budget.window_steps = 100  # ... within any this many steps
    c.recompile.cache_size = 8  # compiled executables kept in memory (LRU)
    c.recompile.cache_dir = ""  # JAX persistent compilation cache; "" = ~/.cache/dynjax/jax
    # True: each step waits for the policies and a pending compile, so Plans swap in at the same
    # steps on any machine (reproducible runs); each recompile then stalls training
    c.recompile.blocking = False
    for name, section in schemes.sections().items():  # with each scheme's own defaults
        c[name] = section
    c.lock()
    return c


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
    """Load ``get_config()`` from a config file and apply ``a.b=value`` overrides."""
    return load_run(path, overrides)[0]


def load_run(
    path: str | Path, overrides: Sequence[str] = ()
) -> tuple[ml_collections.ConfigDict, Schemes]:
    """`load_config`, and the schemes the config is for: the file's ``SCHEMES`` (e.g.
    ``BUILTIN.with_(MyScheme)``, docs/plugins.md), else the built-in ones."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config: no such config file {str(path)!r}")
    spec = importlib.util.spec_from_file_location(f"dynjax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ConfigError(f"{path}: a config file must define get_config() -> ConfigDict")
        cfg = module.get_config()
    except SyntaxError as err:
        raise ConfigError(
            f"{path}:{err.lineno}: {err.msg} (a Python syntax error in the config file): fix "
            "that line"
        ) from err
    except (ConfigError, KeyboardInterrupt):
        raise
    except Exception as err:  # noqa: BLE001 - the user's file: say where, not a traceback
        lines = [f.lineno for f in traceback.extract_tb(err.__traceback__)
                 if Path(f.filename).resolve() == path.resolve()]
        where = f"{path}:{lines[-1]}" if lines else str(path)
        raise ConfigError(
            f"{where}: running the config file raised {type(err).__name__}: {err}; fix the file"
        ) from err
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like --config.{key}=VALUE")
        set_value(cfg, key, raw)
    return cfg, getattr(module, "SCHEMES", BUILTIN)


def leaves(cfg: ml_collections.ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of ``cfg``, in the config's order."""
    for name, value in cfg.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from leaves(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}", value


def valid_keys(cfg: ml_collections.ConfigDict) -> list[str]:
    """All dotted leaf keys of ``cfg``, sorted."""
    return sorted(key for key, _ in leaves(cfg))


def set_value(cfg: ml_collections.ConfigDict, dotted: str, raw: str) -> None:
    """Set ``cfg.<dotted>`` from the command-line string ``raw``, checking key and type."""
    keys = valid_keys(cfg)
    if dotted not in keys:
        close = difflib.get_close_matches(dotted, keys, n=3)
        section = dotted.split(".")[0] + "."
        siblings = [k for k in keys if k.startswith(section)]
        if close:
            hint = f" Did you mean {', '.join(close)}?"
        elif siblings:
            shown = ", ".join(siblings[:8]) + (", ..." if len(siblings) > 8 else "")
            hint = f" Keys of {section[:-1]}: {shown}."
        else:
            hint = f" Sections: {', '.join(sorted({k.split('.')[0] for k in keys}))}."
        raise ConfigError(
            f"unknown config key {dotted!r}.{hint} Every key: docs/config.md, or "
            "python -m dynjax.config_reference"
        )
    *parents, leaf = dotted.split(".")
    node = cfg
    for p in parents:
        node = node[p]
    old = node[leaf]
    node[leaf] = _parse_like(dotted, raw, old)


def _parse_like(key: str, raw: str, old: object) -> object:
    if isinstance(old, str):
        return raw
    if isinstance(old, float) and raw.strip().lower() in ("nan", "inf", "+inf", "-inf"):
        raise ConfigError(f"config key {key!r} expects a finite number, got {raw!r}")
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        raise ConfigError(f"config key {key!r} expects {type(old).__name__}, got {raw!r}") from None
    if isinstance(old, bool):
        ok = isinstance(value, bool)
    elif isinstance(old, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(old, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = type(value) is type(old)
    if not ok:
        raise ConfigError(f"config key {key!r} expects {type(old).__name__}, got {raw!r}")
    return value


def gpt_config(cfg: ml_collections.ConfigDict, schemes: Schemes = BUILTIN) -> GPTConfig:
    """The model's sizes from a run config: the one place the config is unpacked for it (the
    block parts from the schemes' settings, read and checked: `Schemes.settings`)."""
    run = read_run(cfg)
    run = dataclasses.replace(
        run, schemes=tuple(schemes.settings(cfg, _bare_facts(cfg, run)).items())
    )
    return model_facts(cfg, run, schemes).model


def model_facts(
    cfg: ml_collections.ConfigDict, run: RunSettings, schemes: Schemes = BUILTIN
) -> ModelFacts:
    """What the run's plugins know of the model (with the block parts of the enabled schemes,
    from their settings in ``run``: `check_run`'s) and of its batch: read here, once, so no
    plugin reads the config."""
    facts = _bare_facts(cfg, run)
    parts = schemes.block_parts(run.scheme_settings, facts)
    model = dataclasses.replace(facts.model, block_parts=parts, hooks=schemes.hooks())
    return dataclasses.replace(facts, model=model)


def _bare_facts(cfg: ml_collections.ConfigDict, run: RunSettings) -> ModelFacts:
    """`model_facts` without block parts: what the schemes' checks and parts are given."""
    return ModelFacts(
        model=_bare_model(cfg, run),
        seq_len=run.data.seq_len,
        batch_size=run.train.batch_size,
        microbatches=microbatches(run),
        data_shards=run.mesh.data,
        expert_shards=run.mesh.expert,
        pipeline_stages=num_stages(run),
    )


def _bare_model(cfg: ml_collections.ConfigDict, run: RunSettings) -> GPTConfig:
    m, moe = run.model, cfg.moe
    return GPTConfig(
        vocab_size=m.vocab_size,
        num_layers=m.num_layers,
        d_model=m.d_model,
        num_heads=m.num_heads,
        mlp_dim=m.mlp_dim,
        max_len=run.data.seq_len,
        positions=m.positions,
        family=m.family,
        num_kv_heads=m.num_kv_heads,
        rope=Rope(
            base=m.rope_base,
            scaling=m.rope_scaling,
            factor=m.rope_factor,
            low_freq_factor=m.rope_low_freq_factor,
            high_freq_factor=m.rope_high_freq_factor,
            original_max_len=m.rope_original_max_len,
        ),
        norm_eps=m.norm_eps,
        normalize_topk=moe.normalize_topk,
        shared_expert_dim=moe.shared_expert_dim,
        shared_expert_gate=moe.shared_expert_gate,
        qkv_bias=m.qkv_bias,
        qk_norm=m.qk_norm,
        # A split-backward stage's backward is cut at its layers' equations (model.scan_layers)
        scan_layers=m.scan_layers
        and not (num_stages(run) and run.pipeline.schedule in SPLIT_BACKWARD),
        scan_min_layers=m.scan_min_layers,
        moe_layers=moe_layer_indices(m.num_layers, moe.every),
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        expert_mlp_dim=moe.expert_mlp_dim,
        routing=moe.routing,
        routed_bias=bool(moe.every and moe.bias_balancing.enabled),
    )


def read_config(cfg: ml_collections.ConfigDict, schemes: Schemes = BUILTIN) -> RunSettings:
    """``cfg``'s core sections as their records (`read_run`), its keys and types checked
    against the defaults of ``schemes`` first; its values and their combinations are
    `check_run`'s to check. For what must read a config before it can be checked whole (e.g.
    the elastic launcher shrinking its mesh to the devices left)."""
    _check_types(cfg, default_config(schemes))
    return read_run(cfg)


def validate_config(
    cfg: ml_collections.ConfigDict, num_devices: int, schemes: Schemes = BUILTIN
) -> dict[str, Any]:
    """`check_run`'s schemes' records by name (`Schemes.settings`): what the run's plugins
    get."""
    return check_run(cfg, num_devices, schemes).scheme_settings


def check_run(
    cfg: ml_collections.ConfigDict, num_devices: int, schemes: Schemes = BUILTIN
) -> RunSettings:
    """Read ``cfg`` into its records once (`read_run`, each scheme's section into its
    `Plugin.Settings`) and check values and their combinations, each scheme's settings and
    the enabled schemes' claims; raise ConfigError naming the keys and the fix. What the edge
    reads from here on, instead of the config."""
    run = read_config(cfg, schemes)
    m, t, d, mesh = run.model, run.train, run.data, run.mesh
    positive = {
        "train.steps": t.steps,
        "train.batch_size": t.batch_size,
        "train.log_every": t.log_every,
        "train.eval_every": t.eval_every,
        "train.checkpoint_every": t.checkpoint_every,
        "train.keep_checkpoints": t.keep_checkpoints,
        "data.seq_len": d.seq_len,
        "model.num_layers": m.num_layers,
        "model.d_model": m.d_model,
        "model.num_heads": m.num_heads,
        "model.mlp_dim": m.mlp_dim,
        "model.vocab_size": m.vocab_size,
        "mesh.stage": mesh.stage,
        "mesh.data": mesh.data,
        "mesh.expert": mesh.expert,
        "mesh.tensor": mesh.tensor,
        "train.learning_rate": t.learning_rate,
        "train.eval_batches": t.eval_batches,
        "data.max_tokens": d.max_tokens,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")
    if m.d_model % m.num_heads:
        raise ConfigError(f"model.num_heads={m.num_heads} must divide model.d_model={m.d_model}")
    if m.positions == "rope" and (m.d_model // m.num_heads) % 2:
        raise ConfigError(
            f"model.positions='rope' needs an even head dim; d_model/num_heads = "
            f"{m.d_model // m.num_heads}: change model.d_model or model.num_heads"
        )
    _check_family(m)
    _check_remat(m)
    if m.scan_min_layers < 2:
        raise ConfigError(
            f"model.scan_min_layers={m.scan_min_layers} must be >= 2 (a scan of one layer is "
            "that layer unrolled); to run no scan, set model.scan_layers=False"
        )
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    if d.tokenizer:
        _check_tokenizer(d, m.vocab_size)
    if d.prefetch < 0:
        raise ConfigError(
            f"data.prefetch={d.prefetch} must be >= 0 (batches read ahead on a background "
            "thread; 0 reads each on the training thread)"
        )
    if t.microbatches < 0:
        raise ConfigError(f"train.microbatches={t.microbatches} must be >= 0 (0 = auto)")
    at_least({"train.max_skipped": t.max_skipped}, 1)
    _check_optimizer(t)
    _check_pipeline(run)
    needed = mesh.stage * mesh.data * mesh.expert * mesh.tensor
    if needed > num_devices:
        raise ConfigError(
            f"mesh.stage*mesh.data*mesh.expert*mesh.tensor = {mesh.stage}*{mesh.data}*"
            f"{mesh.expert}*{mesh.tensor} = {needed} devices, but only {num_devices} are "
            "available; shrink the mesh (on CPU, "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} fakes more devices)"
        )
    for key, size in (("model.d_model", m.d_model), ("model.mlp_dim", m.mlp_dim)):
        if size % mesh.tensor:
            raise ConfigError(
                f"mesh.tensor={mesh.tensor} must divide {key}={size}: tensor parallelism "
                "splits attention's and the MLP's matrices evenly over the tensor devices"
            )
    micro = microbatches(run)
    shards = mesh.data * mesh.expert * micro
    if t.batch_size % shards:
        raise ConfigError(
            f"train.batch_size={t.batch_size} must be divisible by mesh.data*mesh.expert*"
            f"train.microbatches = {mesh.data}*{mesh.expert}*{micro} = {shards}"
        )
    facts = _bare_facts(cfg, run)
    settings = schemes.settings(cfg, facts)
    _check_recompile(run.recompile)
    _check_checkpoint(run.checkpoint, facts)
    return dataclasses.replace(run, schemes=tuple(settings.items()))


def _check_family(m: ModelSettings) -> None:
    """The family's keys: grouped-query heads, the norms' epsilon and RoPE's frequencies."""
    kv = m.num_kv_heads or m.num_heads
    if m.num_kv_heads < 0 or m.num_heads % kv:
        raise ConfigError(
            f"model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} "
            "(each key/value head serves a group of query heads; 0 = num_heads)"
        )
    if m.family == "llama" and m.positions != "rope":
        raise ConfigError(
            f"model.family='llama' uses rotary positions, not model.positions={m.positions!r}: "
            "set model.positions='rope' (or model.family='gpt')"
        )
    if m.norm_eps <= 0:
        raise ConfigError(f"model.norm_eps={m.norm_eps} must be > 0")
    if m.family != "llama" and (m.qkv_bias or m.qk_norm != "none"):
        raise ConfigError(
            "model.qkv_bias and model.qk_norm are options of the llama family (Qwen2, Qwen3, "
            f"OLMoE); model.family={m.family!r} has biases and no query/key norm: set "
            "model.family='llama'"
        )
    if m.rope_base <= 1:
        raise ConfigError(f"model.rope_base={m.rope_base} must be > 1 (Llama 2: 1e4, 3: 5e5)")
    if m.rope_scaling == "none":
        return
    if m.positions != "rope":
        raise ConfigError(
            f"model.rope_scaling={m.rope_scaling!r} scales rotary positions: with "
            f"model.positions={m.positions!r} set it to 'none'"
        )
    if m.rope_factor < 1:
        raise ConfigError(
            f"model.rope_factor={m.rope_factor} must be >= 1 (how many times longer a context "
            "the scaled frequencies cover)"
        )
    if m.rope_scaling == "llama3":
        if not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
            raise ConfigError(
                f"model.rope_low_freq_factor={m.rope_low_freq_factor} and "
                f"model.rope_high_freq_factor={m.rope_high_freq_factor} must satisfy 0 < low "
                "< high (Llama 3.1: 1 and 4)"
            )
        at_least({"model.rope_original_max_len": m.rope_original_max_len}, 1)


def _check_remat(m: ModelSettings) -> None:
    """Offloading needs host memory apart from the device's (`host_offload_available`)."""
    if m.remat == "offload_proj" and not host_offload_available():
        raise ConfigError(
            f"model.remat='offload_proj' offloads the projections' outputs to pinned host "
            f"memory, but on the {jax.default_backend()} backend device memory is host memory "
            "(nothing would move): use model.remat='save_proj', which keeps the same tensors "
            "in place, or 'full' to keep fewer"
        )


def _check_optimizer(t: TrainSettings) -> None:
    """AdamW and schedule keys: out of range they do not fail, they train wrongly (a negative
    clip bound flips every update into ascent; a bound of 0 would zero them, so 0 means off)."""
    at_least({"train.weight_decay": t.weight_decay, "train.warmup_steps": t.warmup_steps}, 0)
    at_least({"train.grad_clip": t.grad_clip}, 0, " (a global-norm bound; 0 = no clipping)")
    at_least({"train.peak_flops": t.peak_flops}, 0, " (FLOP/s of one device; 0 = known peak)")
    if not 0 <= t.min_lr_ratio <= 1:
        raise ConfigError(
            f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]: the learning rate decays "
            "to train.learning_rate * train.min_lr_ratio"
        )


def _check_recompile(r: RecompileSettings) -> None:
    budget = r.budget
    at_least({"recompile.delta_launch": r.delta_launch}, 0, " (0 = read metrics at once)")
    at_least({"recompile.budget.max_recompiles": budget.max_recompiles}, 0)
    at_least({"recompile.budget.window_steps": budget.window_steps}, 1)
    at_least({"recompile.cache_size": r.cache_size}, 1, " (executables kept in memory)")


def _check_checkpoint(c: CheckpointSettings, facts: ModelFacts) -> None:
    """Partial expert checkpoint keys (seed 004 §3, §5.3), against the model's MoE layers
    (``facts``)."""
    k = c.experts_per_save
    if c.pec_selection not in SELECTIONS:  # the row policy's choices (`CheckpointSettings`)
        raise ConfigError(
            f"checkpoint.pec_selection={c.pec_selection!r} is not one of {SELECTIONS}"
        )
    if not 0 < c.plt_limit <= 1:
        raise ConfigError(
            f"checkpoint.plt_limit={c.plt_limit} must be in (0, 1]: a proportion of tokens "
            "(MoC-System keeps it at 0.0375)"
        )
    at_least({"checkpoint.experts_per_save": k}, 0, " (0 = every expert: a full checkpoint)")
    _check_two_level(c, facts)
    if not k:
        return
    if not facts.model.moe_layers:
        raise ConfigError(
            f"checkpoint.experts_per_save={k} needs MoE layers (moe.every > 0): set "
            "checkpoint.experts_per_save=0 for a dense model"
        )
    if k > facts.model.num_experts:
        raise ConfigError(
            f"checkpoint.experts_per_save={k} exceeds moe.num_experts={facts.model.num_experts}: "
            "set it to at most the experts of a layer (or 0 for all)"
        )


def _check_two_level(c: CheckpointSettings, facts: ModelFacts) -> None:
    """Snapshot / persist keys (seed 004 §5.1-§5.2)."""
    for key in ("snapshot_every", "snapshot_experts", "persist_every", "persist_experts"):
        at_least({f"checkpoint.{key}": getattr(c, key)}, 0)
    at_least({"checkpoint.inject_fault_at": c.inject_fault_at}, 0, " (0 = no fault)")
    if not c.snapshot_every:
        for key in ("snapshot_experts", "persist_every", "persist_experts"):
            if getattr(c, key):
                raise ConfigError(
                    f"checkpoint.{key}={getattr(c, key)} needs checkpoint.snapshot_every > 0 "
                    "(two-level checkpoints): set snapshot_every, or leave it at 0"
                )
        return
    if c.persist_every <= 0 or c.persist_every % c.snapshot_every:
        raise ConfigError(
            f"checkpoint.persist_every={c.persist_every} must be a positive multiple of "
            f"checkpoint.snapshot_every={c.snapshot_every}: a persist writes a snapshot"
        )
    if c.experts_per_save:
        raise ConfigError(
            f"checkpoint.experts_per_save={c.experts_per_save} is the one-level K: with "
            "checkpoint.snapshot_every > 0 set checkpoint.snapshot_experts and "
            "checkpoint.persist_experts instead (and experts_per_save=0)"
        )
    if c.pec_content != "WO":
        raise ConfigError(
            f"checkpoint.pec_content={c.pec_content!r}: two-level checkpoints persist whole "
            "experts (weights and moments) from a snapshot; set it to 'WO'"
        )
    experts = c.snapshot_experts or c.persist_experts
    if experts and not facts.model.moe_layers:
        raise ConfigError(
            "checkpoint.snapshot_experts / persist_experts need MoE layers (moe.every > 0): set "
            "them to 0 for a dense model"
        )
    for key in ("snapshot_experts", "persist_experts"):
        if getattr(c, key) > facts.model.num_experts:
            raise ConfigError(
                f"checkpoint.{key}={getattr(c, key)} exceeds moe.num_experts="
                f"{facts.model.num_experts}"
            )
    if c.snapshot_experts and c.persist_experts > c.snapshot_experts:
        raise ConfigError(
            f"checkpoint.persist_experts={c.persist_experts} exceeds checkpoint.snapshot_experts"
            f"={c.snapshot_experts}: a persist writes experts its snapshot copied; lower it"
        )


def _check_interleaving(run: RunSettings) -> None:
    """pipeline.virtual_stages against the schedule, the microbatches and re-packing."""
    p, stages = run.pipeline, run.mesh.stage
    interleaved = p.schedule in INTERLEAVED
    if p.virtual_stages < 1 or (p.virtual_stages > 1) != interleaved:
        raise ConfigError(
            f"pipeline.virtual_stages={p.virtual_stages} with pipeline.schedule={p.schedule!r}: "
            "interleaved_1f1b needs virtual_stages >= 2 (chunks per stage), the other "
            "schedules virtual_stages=1"
        )
    if not interleaved:
        return
    if stages < 2:
        raise ConfigError(
            f"pipeline.schedule={p.schedule!r} needs a pipeline: set mesh.stage >= 2"
        )
    m = microbatches(run)
    if m % stages:
        raise ConfigError(
            f"pipeline.schedule={p.schedule!r} runs microbatches in groups of one per stage: "
            f"train.microbatches={m} must be a multiple of mesh.stage={stages}"
        )
    if run.balance.repack:
        raise ConfigError(
            "balance.repack with pipeline.schedule='interleaved_1f1b': an interleaved pipeline "
            "keeps every stage (each holds several chunks); turn one of them off"
        )


def _check_pipeline(run: RunSettings) -> None:
    """Stage assignment, schedule and profiling keys; a bad assignment fails before training."""
    p, layers, stages = run.pipeline, run.model.num_layers, run.mesh.stage
    if stages > layers:
        raise ConfigError(
            f"mesh.stage={stages} exceeds model.num_layers={layers}: every pipeline stage needs "
            "at least one layer; use fewer stages or more layers"
        )
    _check_interleaving(run)
    named = p.stage_layers.strip() in STATIC_LAYOUTS
    counts = () if named else stage_layers(run)
    logical = stages * p.virtual_stages
    if counts and len(counts) != logical:
        per = "" if p.virtual_stages == 1 else f" x pipeline.virtual_stages={p.virtual_stages}"
        raise ConfigError(
            f"pipeline.stage_layers={p.stage_layers!r} gives {len(counts)} stages but "
            f"mesh.stage={stages}{per}: give one layer count per (logical) stage"
        )
    if logical > layers:
        raise ConfigError(
            f"mesh.stage={stages} x pipeline.virtual_stages={p.virtual_stages} exceeds "
            f"model.num_layers={layers}: every chunk needs at least one layer"
        )
    empty = [s for s, n in enumerate(counts) if n < 1]
    if empty:
        raise ConfigError(
            f"pipeline.stage_layers={p.stage_layers!r}: stage(s) {empty} hold no layers; every "
            "stage needs at least one layer"
        )
    if counts and sum(counts) != layers:
        raise ConfigError(
            f"pipeline.stage_layers={p.stage_layers!r} sums to {sum(counts)} layers but "
            f"model.num_layers={layers}: the counts must add up to the number of layers"
        )
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={p.schedule!r} is unknown: use one of {SCHEDULES}")
    if p.profile_every < 0:
        raise ConfigError(f"pipeline.profile_every={p.profile_every} must be >= 0 (0 = off)")
    # Values one stage program keeps for another (a forward's residuals, B's work for W) are
    # placed split over a stage's data devices only (`residuals.residual_shapes`).
    keeping = [key for key, on in (
        ("pipeline.recompute=False", not p.recompute),
        (f"pipeline.schedule={p.schedule!r}", p.schedule in SPLIT_BACKWARD),
    ) if on]
    if keeping and (run.mesh.expert > 1 or run.mesh.tensor > 1):
        raise ConfigError(
            f"{' with '.join(keeping)} keeps what a stage's backward reads between two programs, "
            "split over the stage's data devices only: it needs mesh.expert=1 and "
            f"mesh.tensor=1 (got {run.mesh.expert} and {run.mesh.tensor}); set them to 1 or "
            "use pipeline.recompute=True and pipeline.schedule='1f1b'"
        )
    b = run.balance
    if b.enabled or b.repack:
        _check_balance_costs(b)
    if b.repack:
        _check_repack(run)
    if not b.enabled:
        return
    if num_stages(run) < 2:
        raise ConfigError("balance.enabled needs a pipeline: set mesh.stage >= 2")
    if b.every == 0 and b.threshold == 0:
        raise ConfigError("balance.enabled needs balance.every > 0 or balance.threshold > 0")
    if b.by == "time":
        _need_profiles(p, "balance.by='time' needs profiles")
    nonneg = {
        "balance.every": b.every,
        "balance.threshold": b.threshold,
        "balance.amortize_steps": b.amortize_steps,
        "balance.recompile_seconds": b.recompile_seconds,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{key}={value} must be >= 0")
    if b.bandwidth_bytes_per_sec <= 0:
        raise ConfigError(
            f"balance.bandwidth_bytes_per_sec={b.bandwidth_bytes_per_sec} must be > 0"
        )


def _need_profiles(p: PipelineSettings, why: str) -> None:
    if not (p.profile_on_change or p.profile_every):
        raise ConfigError(
            f"{why}: set pipeline.profile_on_change=True or pipeline.profile_every > 0"
        )


def _check_balance_costs(b: BalanceSettings) -> None:
    """Keys both rebalance and re-pack read: the hop cost and the memory budget of a stage."""
    for key, value in (("comm_seconds", b.comm_seconds), ("memory_bytes", b.memory_bytes)):
        if value < 0:
            raise ConfigError(f"balance.{key}={value} must be >= 0")
    if not 0 <= b.memory_headroom < 1:
        raise ConfigError(f"balance.memory_headroom={b.memory_headroom} must be in [0, 1)")


def _check_repack(run: RunSettings) -> None:
    b = run.balance
    stages = num_stages(run)
    if stages < 2:
        raise ConfigError("balance.repack needs a pipeline to shrink: set mesh.stage >= 2")
    if b.repack_every < 1:
        raise ConfigError(
            f"balance.repack_every={b.repack_every}: re-packing decides every n-th metrics "
            "step; set balance.repack_every >= 1"
        )
    _need_profiles(run.pipeline, "balance.repack needs the profiled stage memory")
    if not 0 <= b.repack_target < stages:
        raise ConfigError(
            f"balance.repack_target={b.repack_target} must be fewer than the {stages} stages "
            "(0 = as few as fit)"
        )
    if b.repack_max_slowdown < 0:
        raise ConfigError(f"balance.repack_max_slowdown={b.repack_max_slowdown} must be >= 0")
    hook = b.release_hook
    if hook and (hook.count(":") != 1 or not all(hook.split(":"))):
        raise ConfigError(
            f"balance.release_hook={hook!r} must look like 'package.module:function'"
        )


def _check_tokenizer(d: DataSettings, vocab_size: int) -> None:
    """A tokenizer that exists, has an end-of-text token and fits the embedding, before any
    corpus is read."""
    if not d.path:
        raise ConfigError(
            f"data.tokenizer={d.tokenizer!r} tokenizes the corpus at data.path, which is empty "
            "(the embedded corpus is byte-level): set data.path to a text, .jsonl or .parquet "
            "corpus"
        )
    tokenizer = load_tokenizer(d.tokenizer)
    eos_id(tokenizer, d.tokenizer, d.eos_token)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ConfigError(
            f"data.tokenizer={d.tokenizer!r} has {tokenizer.get_vocab_size()} tokens but "
            f"model.vocab_size={vocab_size}: raise model.vocab_size to at least "
            f"{tokenizer.get_vocab_size()}"
        )


def _check_types(cfg: ml_collections.ConfigDict, ref: ml_collections.ConfigDict) -> None:
    """Config files may add keys or change types by mistake; compare against the defaults."""
    keys, ref_keys = set(valid_keys(cfg)), set(valid_keys(ref))
    extra = sorted(keys - ref_keys)
    if extra:
        raise ConfigError(f"unknown config keys {extra}. Valid keys: {', '.join(sorted(ref_keys))}")
    for key in sorted(keys):
        value, default = _get(cfg, key), _get(ref, key)
        numeric = (
            isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)
        )
        if type(value) is not type(default) and not numeric:
            raise ConfigError(
                f"config key {key!r} expects {type(default).__name__}, got "
                f"{type(value).__name__} {value!r}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"config key {key!r} must be finite, got {value}")


def _get(cfg: ml_collections.ConfigDict, dotted: str) -> object:
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node
