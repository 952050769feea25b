"""Each scheme's section is read once into its frozen settings record: one field per key, no
default of its own (the section's are the one default per key), a nested record per nested
section."""

import dataclasses
import typing

import ml_collections
import pytest

from dynjax.config import validate_config
from dynjax.dynamism import BUILTIN
from dynjax.dynamism.base import read_settings
from dynjax.experiment import Experiment

from ..tiny import tiny_config
from .test_base import TOY


def check_record(kind, section, where):
    """``kind``'s fields are ``section``'s keys, none with a default, each typed as its key's
    default is."""
    fields = dataclasses.fields(kind)
    assert sorted(f.name for f in fields) == sorted(section.keys()), where
    hints = typing.get_type_hints(kind)
    for f in fields:
        assert f.default is dataclasses.MISSING, f"{where}.{f.name} has a default of its own"
        assert f.default_factory is dataclasses.MISSING, f"{where}.{f.name}"
        hint, default = hints[f.name], section[f.name]
        if dataclasses.is_dataclass(hint):
            check_record(hint, default, f"{where}.{f.name}")
        elif typing.get_origin(hint) is typing.Literal:  # a choice: its default is one
            assert default in typing.get_args(hint), f"{where}.{f.name}"
        else:
            assert isinstance(default, typing.get_origin(hint) or hint), f"{where}.{f.name}"


@pytest.mark.parametrize("plugin", TOY.plugins, ids=lambda p: p.name)
def test_every_record_field_is_a_key_of_its_section_with_its_type_and_no_default(plugin):
    check_record(plugin.Settings, plugin.config(), plugin.name)


def test_the_edge_reads_each_section_once_into_a_frozen_record_the_plugins_get():
    cfg = tiny_config(moe__every=2, moe__capacity__factor=2, pruning__enabled=True)
    settings = validate_config(cfg, num_devices=8)
    assert list(settings) == [p.name for p in BUILTIN.plugins]
    moe = settings["moe"]
    assert moe.capacity.factor == 2.0 and moe.every == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        moe.capacity.factor = 1.0
    exp = Experiment.from_config(cfg)
    assert {p.name: p.settings for p in exp.plugins} == {
        "moe": settings["moe"], "pruning": settings["pruning"]
    }


@dataclasses.dataclass(frozen=True)
class Short:
    enabled: bool
    limit: float


def test_an_int_where_the_record_has_a_float_is_widened():
    """The config accepts an int for a float key (`_check_types`); the record holds a float."""
    read = read_settings(Short, ml_collections.ConfigDict({"enabled": True, "limit": 2}), "short")
    assert read == Short(True, 2.0) and isinstance(read.limit, float)


def test_a_record_that_misses_a_key_of_its_section_is_refused():
    section = ml_collections.ConfigDict({"enabled": True, "limit": 0.5, "width": 2})
    with pytest.raises(TypeError, match=r"Short has the fields \['enabled', 'limit'\].*'width'"):
        read_settings(Short, section, "short")
