"""The plugin interface: explicit `Schemes`, per-run instances, declared claims, config sections,
Plan parts, resume rules, layer costs, per-layer options with a block hook and its metric, in
both runtimes."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from dynjax.config import default_config, load_run, validate_config
from dynjax.dynamism import BUILTIN, Plugin, layer_costs
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.model.hooks import HookSet
from dynjax.recompile import History, Plan, Proposal
from dynjax.resume import check_resumable, config_changes
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..tiny import tiny_config


def scale_block_output(x, scale):
    """The toy's block hook: scales the block's output and reports its mean |x| per row."""
    return x * scale, {"toy/mean_abs": jnp.mean(jnp.abs(x), axis=(1, 2))}


@dataclasses.dataclass(frozen=True)
class ToySettings:
    """The toy's section as a record: one field per key of `Toy.config`, no defaults."""

    enabled: bool
    width: int
    seed: int
    limit: float


class Toy(Plugin):
    """A scheme defined outside the library: a width per layer, a cost, a resume-fixed key."""

    name = "toy"
    fixed_on_resume = ("toy.seed",)
    hook_sets = (
        HookSet("toy", block=scale_block_output, reductions=(("toy/mean_abs", "rows"),)),
    )
    Settings = ToySettings
    settings: ToySettings

    @classmethod
    def config(cls):
        c = ml_collections.ConfigDict()
        c.enabled = False
        c.width = 2
        c.seed = 0
        c.limit = 0.0  # halve a layer's width once its mean |x| exceeds this; 0 = never
        return c

    @classmethod
    def validate(cls, settings, facts):
        if settings.enabled and settings.width < 1:
            raise ConfigError(f"toy.width={settings.width} must be >= 1")

    def initial_plan(self, plan):
        return plan.with_part("toy", widths=(self.settings.width,) * self.facts.num_layers)

    def layer_costs(self, plan):
        return [w / 2 for w in plan.part("toy")["widths"]]

    def layer_options(self, plan):
        return [w / 2 for w in plan.part("toy")["widths"]]  # the hook's scale of each layer

    def policies(self):
        return [Narrow(self.settings.limit)] if self.settings.limit > 0 else []


class Narrow:
    """The toy's policy: halve the width of each layer whose newest mean |x| exceeds ``limit``."""

    name = "toy_narrow"

    def __init__(self, limit):
        self.limit = limit

    def propose(self, history, plan):
        [rows] = history.values("toy/mean_abs", 1) or [None]
        if rows is None:
            return None
        widths = plan.part("toy")["widths"]
        means = np.asarray(rows).mean(axis=1)  # [layers, rows in batch order] -> [layers]
        pairs = zip(widths, means, strict=True)
        new = tuple(w // 2 if m > self.limit and w > 1 else w for w, m in pairs)
        return None if new == widths else Proposal(plan.with_part("toy", widths=new), f"{new}")


TOY = BUILTIN.with_(Toy)  # the schemes a run with the toy is given


def test_a_plugin_passed_to_the_run_gets_a_config_section_and_its_checks():
    assert "toy" not in default_config()  # nothing registers itself: only runs given it have it
    cfg = default_config(TOY)
    assert cfg.toy.enabled is False and cfg.toy.width == 2
    cfg.toy.enabled, cfg.toy.width = True, 0
    with pytest.raises(ConfigError, match="toy.width=0"):
        validate_config(cfg, num_devices=1, schemes=TOY)


def test_a_config_file_names_its_schemes_for_the_command_line(tmp_path):
    path = tmp_path / "toy_config.py"
    path.write_text(
        "from tests.dynamism.test_base import TOY as SCHEMES\n"
        "from tests.tiny import tiny_config\n\n\n"
        "def get_config():\n"
        "    return tiny_config(SCHEMES)\n"
    )
    cfg, schemes = load_run(path, ["toy.enabled=True", "toy.width=3"])
    assert [p.name for p in schemes.plugins][-1] == "toy" and cfg.toy.width == 3
    validate_config(cfg, num_devices=1, schemes=schemes)
    assert load_run(tmp_path / "toy_config.py")[1] is not BUILTIN
    with pytest.raises(ConfigError, match="unknown config keys"):
        validate_config(cfg, num_devices=1)  # the built-in schemes have no toy section


def test_its_plan_part_and_costs_come_from_the_config():
    cfg = tiny_config(TOY, toy__enabled=True, toy__width=3, moe__every=2)
    exp = Experiment.from_config(cfg, TOY)
    plan = exp.initial_plan()
    assert plan.part("toy") == {"widths": (3, 3)}
    assert Plan.from_dict(plan.to_dict()) == plan
    # Layer 1 is MoE at factor 1.25: the costs of the two plugins multiply.
    assert layer_costs(exp.plugins, plan) == pytest.approx([1.5, 1.5 * 1.25])


def test_its_policy_proposes_from_its_hooks_metric():
    cfg = tiny_config(TOY, toy__enabled=True, toy__width=4, toy__limit=1.0)
    exp = Experiment.from_config(cfg, TOY)
    [toy] = [p for p in exp.plugins if isinstance(p, Toy)]
    [policy] = toy.policies()
    plan = exp.initial_plan()
    assert policy.propose(History(), plan) is None
    seen = History.of([(3, {"toy/mean_abs": np.array([[0.5, 0.7], [2.0, 3.0]])})])
    assert policy.propose(seen, plan).plan.part("toy") == {"widths": (4, 2)}


def test_each_run_gets_its_own_plugin_instances():
    cfg = tiny_config(TOY, toy__enabled=True)
    one, two = (Experiment.from_config(cfg, TOY) for _ in range(2))
    [toy_one], [toy_two] = ([p for p in e.plugins if isinstance(p, Toy)] for e in (one, two))
    assert toy_one is not toy_two and toy_one.facts == two.facts
    off = Experiment.from_config(tiny_config(TOY), TOY)
    assert not any(isinstance(p, Toy) for p in off.plugins)


class Greedy(Plugin):
    """A scheme that changes which tokens every block computes, as mixture of depths does on
    its routed layers: the registry refuses the two together by their claims."""

    name = "greedy"

    def claims(self):
        return {"token_set": range(self.facts.num_layers)}


def test_schemes_whose_claims_clash_are_refused_naming_both_sections():
    schemes = BUILTIN.with_(Greedy)
    alone = tiny_config(schemes, greedy__enabled=True, model__num_layers=4)
    validate_config(alone, num_devices=1, schemes=schemes)
    both = tiny_config(schemes, greedy__enabled=True, mod__enabled=True, model__num_layers=4)
    with pytest.raises(ConfigError, match=r"mod\.enabled=True with greedy\.enabled=True"):
        validate_config(both, num_devices=1, schemes=schemes)


def test_resume_keeps_or_refreshes_its_part_and_refuses_its_fixed_keys():
    cfg = tiny_config(TOY, toy__enabled=True)
    exp = Experiment.from_config(cfg, TOY)
    saved = exp.initial_plan().with_part("toy", widths=(5, 7))
    assert exp.resumed_plan(saved, {"train.steps": (1, 2)}).part("toy") == {"widths": (5, 7)}
    refreshed = exp.resumed_plan(saved, {"toy.width": (3, 2)})
    assert refreshed.part("toy") == {"widths": (2, 2)}
    changes = config_changes(cfg.to_dict(), tiny_config(TOY, toy__enabled=True, toy__seed=4), TOY)
    with pytest.raises(ConfigError, match=r"toy.seed: 0 -> 4"):
        check_resumable(changes, "workdir", TOY)


@pytest.mark.slow
def test_a_run_with_a_plugin_writes_its_layer_costs(tmp_path):
    cfg = tiny_config(moe__every=2, train__steps=4, train__log_every=2)
    train(cfg, tmp_path, progress=False)
    lines = read_jsonl(tmp_path / "layer_costs.jsonl")
    assert [r["step"] for r in lines] == [2, 4]
    assert lines[0]["layer_cost"] == pytest.approx([1.0, 1.25])  # the MoE layer at factor 1.25


def one_step(cfg, plan_change=lambda plan: plan, schemes=TOY):
    exp = Experiment.from_config(cfg, schemes)
    plan = plan_change(exp.initial_plan())
    runtime = exp.runtime(plan)
    executable = exp.lower_train_step(plan).compile()
    metrics = runtime.host_metrics(0, jax.device_get(
        runtime.step(executable, exp.order.batch(0), None)))
    return exp, plan, metrics


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [{}, {"mesh__stage": 2}], ids=["single", "pipeline"])
def test_layer_options_reach_the_block_hook_and_its_metric_comes_back(pipeline):
    base = dict(model__num_layers=4, train__batch_size=8, **pipeline)
    _, _, plain = one_step(tiny_config(TOY, **base))
    _, _, same = one_step(tiny_config(TOY, toy__enabled=True, **base))  # scale 1: the same model
    np.testing.assert_allclose(same["loss"], plain["loss"], rtol=1e-6)
    assert same["toy/mean_abs"].shape == (4, 8)  # [layers, rows in batch order]
    assert "toy/mean_abs" not in plain
    assert same["layer_grad_norm"].shape == (4,) and np.all(same["layer_grad_norm"] > 0)
    _, _, scaled = one_step(
        tiny_config(TOY, toy__enabled=True, **base),
        lambda plan: plan.with_part("toy", widths=(8, 2, 2, 2)),  # layer 0's output x 4
    )
    # The hook reports its input: layer 0's is unchanged, every later one carries the x 4.
    np.testing.assert_allclose(scaled["toy/mean_abs"][0], same["toy/mean_abs"][0], rtol=1e-5)
    assert np.all(scaled["toy/mean_abs"][1:] > 2 * same["toy/mean_abs"][1:])


def test_a_changed_layer_option_recompiles_only_its_stage():
    exp = Experiment.from_config(
        tiny_config(TOY, toy__enabled=True, model__num_layers=4, mesh__stage=2), TOY
    )
    plan = exp.initial_plan()
    exp.lower_train_step(plan).compile()
    changed = plan.with_part("toy", widths=(2, 2, 2, 4))  # layer 3, on stage 1
    lowered = exp.lower_train_step(changed)
    assert {stage for _, stage in lowered.lowered} == {1}
    assert exp.pipeline_spec(changed).stages[0] == exp.pipeline_spec(plan).stages[0]


class TallyState(nnx.Module):
    def __init__(self, cfg, settings, rngs):
        self.seen = nnx.Variable(jnp.zeros((), jnp.float32))


def add_seen(state, metrics, record):
    return {"tally/seen": state["tally/seen"] + metrics["tally/mean_abs"]}


def mean_abs(x, record):
    return x, {"tally/mean_abs": jnp.mean(jnp.abs(x))}


class Tally(Plugin):
    """A scheme with state of its own outside the optimizer: layers 1 and 3 keep a running sum
    of their block's mean |output| (a block part's variable), moved by a state rule."""

    name = "tally"
    hook_sets = (
        HookSet(
            "tally", block=mean_abs, part=TallyState, state_rule=add_seen, rule_state=("seen",)
        ),
    )

    @classmethod
    def block_parts(cls, settings, facts):
        return [(1, "tally", None), (3, "tally", None)]

    def layer_options(self, plan):
        return [i in (1, 3) or None for i in range(self.facts.num_layers)]


TALLY = BUILTIN.with_(Tally)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [{}, {"mesh__stage": 2}], ids=["single", "pipeline"])
def test_a_state_rule_moves_its_layers_state_from_their_step_metrics(pipeline):
    """Not MoE: the rule of layers 1 and 3 (one per stage on the pipeline) adds each layer's
    own metric of the step to its variable, after the optimizer (which leaves it at 0)."""
    cfg = tiny_config(
        TALLY, tally__enabled=True, model__num_layers=4, train__batch_size=8, **pipeline
    )
    exp = Experiment.from_config(cfg, TALLY)
    plan = exp.initial_plan()
    runtime = exp.runtime(plan)
    executable = exp.lower_train_step(plan).compile()
    metrics = runtime.host_metrics(0, jax.device_get(
        runtime.step(executable, exp.order.batch(0), None)))
    layers = jax.device_get(runtime.checkpoint_state()["params"])["layers"]
    seen = np.array([layers[i]["tally"]["seen"] for i in (1, 3)])
    assert "tally" not in layers[0] and metrics["tally/mean_abs"].shape == (2,)
    assert np.all(seen > 0)
    np.testing.assert_array_equal(seen, metrics["tally/mean_abs"])
