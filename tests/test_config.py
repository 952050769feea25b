"""Bad configs fail at once with messages that name the key and the fix."""

import pytest

from dynjax.config import ConfigError, load_config, set_value, validate_config
from dynjax.train import main, parse_args

from .tiny import tiny_config


def test_unknown_key_names_the_key_and_lists_valid_ones():
    with pytest.raises(ConfigError) as err:
        set_value(tiny_config(), "train.stpes", "5")
    msg = str(err.value)
    assert "'train.stpes'" in msg and "Did you mean train.steps" in msg and "model.d_model" in msg


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match="'train.steps' expects int, got '1.5'"):
        set_value(tiny_config(), "train.steps", "1.5")
    with pytest.raises(ConfigError, match="'train.learning_rate' expects float"):
        set_value(tiny_config(), "train.learning_rate", "fast")
    c = tiny_config()
    set_value(c, "train.learning_rate", "1")  # an int where a float is expected is fine
    assert c.train.learning_rate == 1.0


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model__num_heads": 3}, r"model.num_heads=3 must divide model.d_model=32"),
        (
            {"mesh__data": 4, "mesh__expert": 4, "moe__every": 1},
            r"16 devices, but only 8 are available.*xla_force_host_platform_device_count=16",
        ),
        (
            {"moe__every": 1, "moe__num_experts": 6, "mesh__expert": 4},
            r"moe.num_experts=6 must be divisible by mesh.expert=4",
        ),
        ({"train__batch_size": 6, "mesh__data": 4}, r"train.batch_size=6 must be divisible"),
        ({"mesh__expert": 2}, r"mesh.expert=2 needs MoE layers"),
        ({"train__dtype": "float16"}, r"train.dtype='float16' is not one of"),
        ({"moe__every": 1, "moe__capacity__policy": "adaptive"}, r"moe.capacity.policy='adaptive'"),
        ({"train__steps": 0}, r"train.steps must be > 0"),
    ],
)
def test_inconsistent_values_name_the_conflict(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(**overrides), num_devices=8)


def test_config_file_adding_a_key_is_rejected(tmp_path):
    path = tmp_path / "bad.py"
    path.write_text(
        "from dynjax.config import default_config\n"
        "def get_config():\n"
        "    c = default_config()\n"
        "    c.unlock()\n"
        "    c.train.stepz = 3\n"
        "    return c\n"
    )
    with pytest.raises(ConfigError, match=r"unknown config keys \['train.stepz'\]"):
        validate_config(load_config(path), num_devices=1)


def test_cli_reports_config_errors_and_exits_2(capsys):
    assert main(["--config", "configs/quickstart.py", "--config.model.d_modle=64"]) == 2
    assert "unknown config key 'model.d_modle'" in capsys.readouterr().err
    assert main(["--config", "configs/missing.py"]) == 2


def test_cli_override_forms():
    config, overrides, workdir = parse_args(
        ["--config", "c.py", "--config.train.steps=5", "--config.seed", "3", "--workdir", "w"]
    )
    assert (config, overrides, workdir) == ("c.py", ["train.steps=5", "seed=3"], "w")
