"""The core sections are read once into frozen records (issue 31): one field per key, typed as
its default, a bad type or choice refused naming the key, and what the run reads."""

import dataclasses
import typing

import jax
import ml_collections
import pytest

from dynjax.config import check_run, default_config, leaves, validate_config
from dynjax.dynamism import BUILTIN
from dynjax.errors import ConfigError
from dynjax.experiment import Experiment
from dynjax.settings import RunSettings, core_sections, read_run

from .tiny import tiny_config

SECTIONS = core_sections()


def check_record(kind, section, where):
    """``kind``'s fields are ``section``'s keys, none with a default, each typed exactly as
    its key's default (a bool is no int here) or a choice its default is one of."""
    fields = dataclasses.fields(kind)
    assert sorted(f.name for f in fields) == sorted(section.keys()), where
    hints = typing.get_type_hints(kind)
    for f in fields:
        assert f.default is dataclasses.MISSING, f"{where}.{f.name} has a default of its own"
        hint, default = hints[f.name], section[f.name]
        if dataclasses.is_dataclass(hint):
            check_record(hint, default, f"{where}.{f.name}")
        elif typing.get_origin(hint) is typing.Literal:
            assert default in typing.get_args(hint), f"{where}.{f.name}"
        else:
            assert type(default) is hint, f"{where}.{f.name}: {hint} against {default!r}"


def test_the_run_record_has_a_field_per_core_section_and_the_seed():
    """A section added to `default_config` (not a scheme's) without its record fails here."""
    cfg = default_config()
    core = {k for k in cfg.keys() if k not in BUILTIN.sections()}
    assert {f.name for f in dataclasses.fields(RunSettings)} == core | {"schemes"}
    assert set(SECTIONS) == core - {"seed"}


@pytest.mark.parametrize("name", list(SECTIONS))
def test_every_core_record_has_a_field_per_key_typed_as_its_default(name):
    check_record(SECTIONS[name], default_config()[name], name)


def _record_value(run, dotted):
    node = run
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def test_the_records_hold_the_config_values_with_ints_widened_to_floats():
    cfg = tiny_config(train__grad_clip=2, balance__memory_bytes=3,
                      recompile__budget__window_steps=7)
    run = read_run(cfg)
    core = [(k, v) for k, v in leaves(cfg) if k.split(".")[0] not in BUILTIN.sections()]
    for key, value in core:
        assert _record_value(run, key) == value, key
    assert run.train.grad_clip == 2.0 and type(run.train.grad_clip) is float
    assert type(run.balance.memory_bytes) is float and run.recompile.budget.window_steps == 7


def test_records_are_frozen_and_hashable_and_equal_configs_give_equal_records():
    one, two = (check_run(tiny_config(moe__every=2), 8) for _ in range(2))
    assert one == two and hash(one) == hash(two)
    assert one != check_run(tiny_config(moe__every=2, train__steps=13), 8)
    for name in SECTIONS:
        section = getattr(one, name)
        hash(section)
        key = dataclasses.fields(section)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(section, key, getattr(section, key))
    with pytest.raises(dataclasses.FrozenInstanceError):
        one.seed = 1


def test_check_run_returns_the_schemes_records_validate_config_does():
    cfg = tiny_config(moe__every=2, pruning__enabled=True)
    run = check_run(cfg, 8)
    assert run.scheme_settings == validate_config(cfg, 8)
    assert [name for name, _ in run.schemes] == [p.name for p in BUILTIN.plugins]
    assert read_run(cfg).schemes == ()  # read, not checked: no scheme's record yet


def _with(cfg, dotted, value):
    """``cfg`` with ``dotted`` set to ``value`` whatever its type (as a config file may)."""
    tree = cfg.to_dict()
    node = tree
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
    return ml_collections.ConfigDict(tree)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("mesh.data", "2", "config key 'mesh.data' expects int, got str '2'"),
        ("train.steps", True, "config key 'train.steps' expects int, got bool True"),
        ("model.scan_layers", 1, "config key 'model.scan_layers' expects bool, got int 1"),
        ("recompile.budget.window_steps", 1.5,
         "config key 'recompile.budget.window_steps' expects int, got float 1.5"),
        ("balance.threshold", float("nan"), "config key 'balance.threshold' must be finite"),
    ],
)
def test_a_wrong_type_in_a_core_section_is_refused_naming_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        check_run(_with(tiny_config(), key, value), 8)


def _choices():
    """Every core key whose record field is a choice (``Literal``), and the one checked by
    hand (the row policy's)."""
    out = ["checkpoint.pec_selection"]
    for name, kind in SECTIONS.items():
        for field, hint in typing.get_type_hints(kind).items():
            if typing.get_origin(hint) is typing.Literal:
                out.append(f"{name}.{field}")
    return out


@pytest.mark.parametrize("key", _choices())
def test_a_bad_choice_in_a_core_section_is_refused_naming_the_key(key):
    """Whether or not what reads it is on: ``balance.by`` with balance off included."""
    assert len(_choices()) >= 8  # dtype, nonfinite, positions, schedule, by, method, pec_*
    with pytest.raises(ConfigError, match=rf"^{key}='bogus' is not one of \("):
        check_run(_with(tiny_config(), key, "bogus"), 8)


def test_the_experiment_reads_the_checked_records():
    cfg = tiny_config(train__dtype="bfloat16", mesh__data=2)
    exp = Experiment.from_config(cfg)
    assert exp.settings == check_run(cfg, jax.device_count())
    assert exp.initial_plan().dtype == "bfloat16" and exp.mesh.shape["data"] == 2
