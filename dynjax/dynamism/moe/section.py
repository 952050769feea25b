"""The `moe` section: its keys with their one default each, and the checks of their values
against each other and the model (`MoEPlugin.config`, `MoEPlugin.validate` delegate here).

Each failed check is a `ConfigError` naming the key and the fix; the plugin reads the checked
record (`dynjax.dynamism.moe.settings`).
"""

from __future__ import annotations

import ml_collections

from dynjax.dynamism.moe.settings import CachingSettings, CapacitySettings, MoESettings
from dynjax.errors import ConfigError, at_least
from dynjax.model.facts import ModelFacts


def config() -> ml_collections.ConfigDict:
    """The section with its defaults (`Plugin.config`)."""
    c = ml_collections.ConfigDict()
    c.num_experts = 8
    c.top_k = 2
    c.every = 0  # an MoE block in every n-th layer (layers n-1, 2n-1, ...); 0 = dense model
    c.expert_mlp_dim = 0  # 0: same as model.mlp_dim
    c.aux_loss_weight = 0.01
    c.z_loss_weight = 0.0
    # "ragged": the kept pairs grouped by expert through one grouped matmul pair per layer
    # (ragged_dot; tiled by hand on CPU), capacities a runtime input (only a new bucketed
    # total recompiles; issue 12 §1); "static": a matmul pair per expert, capacities
    # compiled in (a change recompiles), kept for comparison
    c.dispatch = "ragged"
    # "token_choice": each token its top-k experts; "expert_choice": each expert its top-C
    # tokens of a group, C its capacity (Zhou et al. 2022; no drops, no balance loss)
    c.routing = "token_choice"
    # Token choice's gates: the top-k probabilities renormalised to sum to 1, i.e. a
    # softmax over the top-k logits (Mixtral, Qwen3-MoE); False: the full softmax's
    # probabilities (Qwen1.5/2-MoE, OLMoE). Top-1 gates are the probability either way
    c.normalize_topk = True
    # A dense expert every token passes through beside its routed ones, its output added
    # (DeepSeekMoE, Qwen-MoE's shared experts as one MLP of their summed width); its width,
    # 0 = none. A SwiGLU in the llama family, a GELU MLP in the gpt family
    c.shared_expert_dim = 0
    # Scale the shared expert's output per token by sigmoid(x @ w), w [d_model, 1] trained
    # (Qwen1.5/2-MoE's shared_expert_gate); needs moe.shared_expert_dim > 0
    c.shared_expert_gate = False
    # Auxiliary-loss-free balancing (DeepSeek-V3 §2.1.2): a per-expert bias on the router's
    # probabilities for the top-k selection only, moved after each step by
    # rate * sign(mean load - load); not trained, checkpointed with the model
    c.bias_balancing = ml_collections.ConfigDict()
    c.bias_balancing.enabled = False
    c.bias_balancing.rate = 1e-3
    c.capacity = ml_collections.ConfigDict()
    # the static global factor, and the start of a dynamic run; <= 0: dropless (needs
    # moe.dispatch="ragged": every capacity is the group's tokens, the buffer the worst case)
    c.capacity.factor = 1.25
    c.capacity.policy = "static"  # "static" | "dynamic" (per-expert, seed 001 §4.1)
    c.capacity.target_drop_rate = 0.01
    c.capacity.min_factor = 0.5
    c.capacity.max_factor = 2.0
    c.capacity.window = 20  # steps of observed loads per decision
    c.capacity.headroom = 1.1
    c.capacity.bucket = 0.25  # capacity factors are rounded up to multiples of this
    c.capacity.hysteresis = 0.2  # shrink only when it saves at least this fraction
    c.caching = ml_collections.ConfigDict()  # sample-assignment caching (seed 001 §4.2)
    c.caching.enabled = False
    c.caching.on_threshold = 0.96
    c.caching.off_threshold = 0.90
    c.caching.warmup_steps = 100
    c.caching.window = 10
    c.caching.max_entries = 65536  # samples whose assignments are kept on the host
    # MPipeMoE (seed 002 §III-B): partitions of each MoE layer's dispatch groups per shard,
    # each its own all-to-all -> experts -> all-to-all, overlapped on GPU; must divide
    # train.batch_size / (mesh.data * mesh.expert * microbatches)
    c.chunks = 1
    # Table II: "none" | "S1" | "S2" | "S3" | "S4" (restore T_DI by offload (S1, S3) or
    # re-communication (S2, S4), T_M by offload (S1, S2) or recomputation (S3, S4)) | "auto"
    # (eq. 10 on speeds measured at the start)
    c.memory_reuse = "none"
    c.granularity = ml_collections.ConfigDict()  # Alg. 1: adaptive n per token count B
    c.granularity.enabled = False
    c.granularity.max_chunks = 8  # candidates: the powers of two up to this dividing groups
    c.granularity.trials = 3  # timed steps per candidate n
    c.granularity.warmup = 1  # steps after a change of n or B not timed
    return c


def validate(moe: MoESettings, facts: ModelFacts) -> None:
    """Raise `ConfigError` for a value the run cannot honour (`Plugin.validate`)."""
    expert = facts.expert_shards
    if moe.every < 0:
        raise ConfigError(f"moe.every={moe.every} must be >= 0 (0 = no MoE layers)")
    if moe.every:
        if not facts.model.moe_layers:
            raise ConfigError(
                f"moe.every={moe.every} > model.num_layers={facts.num_layers}: no layer "
                "would be MoE"
            )
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ConfigError(
                f"moe.top_k={moe.top_k} must be in [1, moe.num_experts={moe.num_experts}]"
            )
        if moe.num_experts % expert:
            raise ConfigError(
                f"moe.num_experts={moe.num_experts} must be divisible by "
                f"mesh.expert={expert}"
            )
        if moe.capacity.factor <= 0 and moe.dispatch != "ragged":
            raise ConfigError(
                f"moe.capacity.factor={moe.capacity.factor} (dropless) needs "
                "moe.dispatch='ragged': set it, or a factor > 0"
            )
        if moe.capacity.factor <= 0 and moe.capacity.policy == "dynamic":
            raise ConfigError(
                f"moe.capacity.factor={moe.capacity.factor} (dropless) leaves nothing for "
                "moe.capacity.policy='dynamic' to size: set a factor > 0 or policy='static'"
            )
        _check_routing(moe)
        _check_chunks(moe, facts)
        _check_moe(moe)
    elif expert != 1:
        raise ConfigError(
            f"mesh.expert={expert} needs MoE layers: set moe.every > 0 or mesh.expert=1"
        )
    else:
        moe_policies = {
            "moe.capacity.policy='dynamic'": moe.capacity.policy == "dynamic",
            "moe.caching.enabled=True": moe.caching.enabled,
            "moe.bias_balancing.enabled=True": moe.bias_balancing.enabled,
            "moe.granularity.enabled=True": moe.granularity.enabled,
            f"moe.chunks={moe.chunks}": moe.chunks != 1,
            f"moe.memory_reuse={moe.memory_reuse!r}": moe.memory_reuse != "none",
            f"moe.shared_expert_dim={moe.shared_expert_dim}": moe.shared_expert_dim != 0,
            "moe.shared_expert_gate=True": moe.shared_expert_gate,
            "moe.normalize_topk=False": not moe.normalize_topk,
        }
        asked = [key for key, on in moe_policies.items() if on]
        if asked:  # it would be ignored: the run would not be what the config says
            raise ConfigError(
                f"{', '.join(asked)} needs MoE layers: set moe.every > 0, or turn it off"
            )


def local_groups(facts: ModelFacts) -> int:
    """Dispatch groups (sequences) per expert-parallel shard in one microbatch: what
    ``moe.chunks`` partitions."""
    return facts.batch_size // (facts.batch_shards * facts.microbatches)



def _check_routing(moe: MoESettings) -> None:
    """``moe.routing`` and ``moe.bias_balancing``, and what expert choice cannot combine with."""
    if moe.bias_balancing.enabled and moe.bias_balancing.rate <= 0:
        raise ConfigError(
            f"moe.bias_balancing.rate={moe.bias_balancing.rate} must be > 0 (DeepSeek-V3 uses "
            "1e-3), or set moe.bias_balancing.enabled=False"
        )
    at_least({"moe.shared_expert_dim": moe.shared_expert_dim}, 0, " (0 = no shared expert)")
    if moe.shared_expert_gate and not moe.shared_expert_dim:
        raise ConfigError(
            "moe.shared_expert_gate=True gates the shared expert, but moe.shared_expert_dim=0 "
            "adds none: set moe.shared_expert_dim > 0 or moe.shared_expert_gate=False"
        )
    if moe.routing != "expert_choice":
        return
    if not moe.normalize_topk:
        raise ConfigError(
            "moe.normalize_topk=False shapes token choice's top-k gates; moe.routing="
            "'expert_choice' weights each token by its probability and has none: set "
            "moe.normalize_topk=True or moe.routing='token_choice'"
        )
    clashes = {
        "moe.bias_balancing.enabled=True": moe.bias_balancing.enabled,
        "moe.capacity.policy='dynamic'": moe.capacity.policy == "dynamic",
        "moe.caching.enabled=True": moe.caching.enabled,
        f"moe.capacity.factor={moe.capacity.factor} (dropless)": moe.capacity.factor <= 0,
    }
    asked = [key for key, on in clashes.items() if on]
    if asked:  # every expert takes exactly its capacity: nothing to balance, size or cache
        raise ConfigError(
            f"moe.routing='expert_choice' balances by construction (each expert takes its "
            f"capacity's tokens) and does not combine with {', '.join(asked)}: turn it off "
            "(a factor > 0), or set moe.routing='token_choice'"
        )


def _check_chunks(moe: MoESettings, facts: ModelFacts) -> None:
    """``moe.chunks``, ``moe.memory_reuse`` and ``moe.granularity`` (seed 002 §III)."""
    groups = local_groups(facts)
    if moe.chunks < 1 or groups % moe.chunks:
        raise ConfigError(
            f"moe.chunks={moe.chunks} must be >= 1 and divide the {groups} dispatch groups "
            "(sequences) per expert-parallel shard, train.batch_size / (mesh.data * mesh.expert "
            "* microbatches): choose a divisor of it"
        )
    g = moe.granularity
    if g.enabled:
        at_least(
            {"moe.granularity.max_chunks": g.max_chunks, "moe.granularity.trials": g.trials}, 1
        )
        at_least({"moe.granularity.warmup": g.warmup}, 0)


def _check_moe(moe: MoESettings) -> None:
    """The capacity policy's name, the MoE block's loss weights and the keys of the policies that
    are on: everything `DynamicCapacity`, `CachingPolicy` and `AssignmentCache` would reject,
    named by key."""
    at_least(
        {
            "moe.expert_mlp_dim": moe.expert_mlp_dim,
            "moe.aux_loss_weight": moe.aux_loss_weight,
            "moe.z_loss_weight": moe.z_loss_weight,
        },
        0,
    )
    if moe.capacity.policy == "dynamic":
        _check_dynamic_capacity(moe.capacity)
    if moe.caching.enabled:
        _check_caching(moe.caching, moe.num_experts)


def _check_dynamic_capacity(c: CapacitySettings) -> None:
    if not 0 <= c.target_drop_rate < 1:
        raise ConfigError(
            f"moe.capacity.target_drop_rate={c.target_drop_rate} must be in [0, 1): the "
            "fraction of routed tokens an expert may drop"
        )
    if c.min_factor <= 0:
        raise ConfigError(f"moe.capacity.min_factor={c.min_factor} must be > 0")
    if c.min_factor > c.max_factor:
        raise ConfigError(
            f"moe.capacity.min_factor={c.min_factor} exceeds moe.capacity.max_factor="
            f"{c.max_factor}: lower min_factor or raise max_factor"
        )
    if c.bucket <= 0:
        raise ConfigError(f"moe.capacity.bucket={c.bucket} must be > 0 (factors round up to it)")
    at_least({"moe.capacity.window": c.window}, 1, " (steps of loads per decision)")
    at_least({"moe.capacity.headroom": c.headroom}, 1, " (a multiplier on the need; 1 = none)")
    at_least({"moe.capacity.hysteresis": c.hysteresis}, 0, " (0 = none)")


def _check_caching(c: CachingSettings, num_experts: int) -> None:
    if not 0 <= c.off_threshold <= c.on_threshold <= 1:
        raise ConfigError(
            f"moe.caching needs 0 <= off_threshold <= on_threshold <= 1, got off_threshold="
            f"{c.off_threshold}, on_threshold={c.on_threshold}: caching switches on at a "
            "routing stability >= on_threshold and off below off_threshold"
        )
    at_least({"moe.caching.warmup_steps": c.warmup_steps}, 0)
    at_least({"moe.caching.window": c.window, "moe.caching.max_entries": c.max_entries}, 1)
    if num_experts > 32767:
        raise ConfigError(
            f"moe.caching.enabled stores expert ids as int16: moe.num_experts={num_experts} "
            "must be <= 32767, or set moe.caching.enabled=False"
        )
