"""Bad configs fail at once with messages that name the key and the fix."""

import pytest

from dynjax import config as config_lib
from dynjax import train as train_module
from dynjax.config import load_config, set_value, validate_config
from dynjax.errors import ConfigError
from dynjax.settings import num_stages, read_run
from dynjax.train import main, parse_args

from .tiny import tiny_config


def test_unknown_key_names_the_key_the_closest_ones_and_the_reference():
    """A short message (issue 32 §7: it listed all ~150 keys on one line): the closest keys,
    else the section's, else the sections, and where every key is documented."""
    messages, far, nowhere = {}, "train.qqqqqqqqqqqq", "qqqqqqqqqqqq.wwwwwwww"
    for key in ("train.stpes", far, nowhere):
        with pytest.raises(ConfigError) as err:
            set_value(tiny_config(), key, "5")
        messages[key] = msg = str(err.value)
        assert f"'{key}'" in msg and "docs/config.md" in msg and len(msg) < 400, msg
    assert "Did you mean train.steps" in messages["train.stpes"]
    assert "Keys of train: " in messages[far] and "model." not in messages[far]
    assert "Sections: " in messages[nowhere] and "train" in messages[nowhere]


def test_wrong_type_is_rejected():
    with pytest.raises(ConfigError, match="'train.steps' expects int, got '1.5'"):
        set_value(tiny_config(), "train.steps", "1.5")
    with pytest.raises(ConfigError, match="'train.learning_rate' expects float"):
        set_value(tiny_config(), "train.learning_rate", "fast")
    for raw in ("nan", "inf", "-inf"):
        with pytest.raises(ConfigError, match="'train.learning_rate' expects a finite number"):
            set_value(tiny_config(), "train.learning_rate", raw)
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
        ({"moe__capacity__policy": "dynamic"}, r"policy='dynamic' needs MoE layers"),
        ({"moe__caching__enabled": True}, r"moe.caching.enabled=True needs MoE layers"),
    ],
)
def test_inconsistent_values_name_the_conflict(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(**overrides), num_devices=8)


MOE = {"moe__every": 2}
DYNAMIC = {**MOE, "moe__capacity__policy": "dynamic"}
CACHING = {**MOE, "moe__caching__enabled": True}
PIPELINE = {"mesh__stage": 2}


@pytest.mark.parametrize(
    "overrides, message",
    [
        # Optimizer keys: out of range they do not fail, they train wrongly.
        ({"train__grad_clip": -1.0}, r"train.grad_clip=-1.0 must be >= 0 .*0 = no clipping"),
        ({"train__weight_decay": -0.1}, r"train.weight_decay=-0.1 must be >= 0"),
        ({"train__warmup_steps": -1}, r"train.warmup_steps=-1 must be >= 0"),
        ({"train__learning_rate": 0.0}, r"train.learning_rate must be > 0"),
        ({"train__min_lr_ratio": 1.5}, r"train.min_lr_ratio=1.5 must be in \[0, 1\]"),
        ({"train__min_lr_ratio": -0.1}, r"train.min_lr_ratio=-0.1 must be in \[0, 1\]"),
        ({"train__eval_batches": 0}, r"train.eval_batches must be > 0"),
        ({"data__max_tokens": 0}, r"data.max_tokens must be > 0"),
        ({**MOE, "moe__aux_loss_weight": -0.01}, r"moe.aux_loss_weight=-0.01 must be >= 0"),
        ({**MOE, "moe__z_loss_weight": -1.0}, r"moe.z_loss_weight=-1.0 must be >= 0"),
        ({**MOE, "moe__expert_mlp_dim": -1}, r"moe.expert_mlp_dim=-1 must be >= 0"),
        # What DynamicCapacity would reject.
        (
            {**DYNAMIC, "moe__capacity__min_factor": 2.5},
            r"moe.capacity.min_factor=2.5 exceeds moe.capacity.max_factor=2.0: lower",
        ),
        ({**DYNAMIC, "moe__capacity__min_factor": 0.0}, r"moe.capacity.min_factor=0.0 must be > 0"),
        (
            {**DYNAMIC, "moe__capacity__target_drop_rate": 1.0},
            r"moe.capacity.target_drop_rate=1.0 must be in \[0, 1\)",
        ),
        ({**DYNAMIC, "moe__capacity__window": 0}, r"moe.capacity.window=0 must be >= 1"),
        ({**DYNAMIC, "moe__capacity__headroom": 0.9}, r"moe.capacity.headroom=0.9 must be >= 1"),
        ({**DYNAMIC, "moe__capacity__bucket": 0.0}, r"moe.capacity.bucket=0.0 must be > 0"),
        (
            {**DYNAMIC, "moe__capacity__hysteresis": -0.1},
            r"moe.capacity.hysteresis=-0.1 must be >= 0",
        ),
        # What CachingPolicy and AssignmentCache would reject.
        (
            {**CACHING, "moe__caching__off_threshold": 0.97},
            r"moe.caching needs 0 <= off_threshold <= on_threshold <= 1, got off_threshold=0.97",
        ),
        ({**CACHING, "moe__caching__on_threshold": 1.5}, r"on_threshold=1.5"),
        ({**CACHING, "moe__caching__off_threshold": -0.1}, r"off_threshold=-0.1"),
        ({**CACHING, "moe__caching__window": 0}, r"moe.caching.window=0 must be >= 1"),
        ({**CACHING, "moe__caching__warmup_steps": -1}, r"moe.caching.warmup_steps=-1 must be"),
        ({**CACHING, "moe__caching__max_entries": 0}, r"moe.caching.max_entries=0 must be >= 1"),
        # What Monitor, Budget and Compiler would reject.
        ({"recompile__delta_launch": -1}, r"recompile.delta_launch=-1 must be >= 0"),
        ({"recompile__budget__max_recompiles": -1}, r"recompile.budget.max_recompiles=-1"),
        ({"recompile__budget__window_steps": 0}, r"recompile.budget.window_steps=0 must be >= 1"),
        ({"recompile__cache_size": 0}, r"recompile.cache_size=0 must be >= 1"),
        # What Repack and Rebalance would reject, or would silently never accept.
        (
            {**PIPELINE, "balance__repack": True, "balance__comm_seconds": -1.0},
            r"balance.comm_seconds=-1.0 must be >= 0",
        ),
        (
            {**PIPELINE, "balance__enabled": True, "balance__memory_headroom": 1.0},
            r"balance.memory_headroom=1.0 must be in \[0, 1\)",
        ),
    ],
)
def test_values_that_would_train_wrongly_or_fail_a_policy_are_rejected(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(**overrides), num_devices=8)


@pytest.mark.parametrize(
    "overrides",
    [
        {"train__grad_clip": 0.0},  # no clipping
        {"train__weight_decay": 0.0, "train__warmup_steps": 0, "train__min_lr_ratio": 1.0},
        # A policy that is off does not run: its keys are not checked.
        {**MOE, "moe__caching__off_threshold": 0.99},
        {**MOE, "moe__capacity__min_factor": 3.0},
    ],
)
def test_boundary_values_and_keys_of_policies_that_are_off_are_accepted(overrides):
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


@pytest.mark.parametrize(
    "body, message",
    [
        ("def get_config(:\n    pass\n", r"bad\.py:1: .*syntax error in the config file"),
        ("def get_config():\n    return undefined_name\n",
         r"bad\.py:2: running the config file raised NameError: name 'undefined_name'"),
    ],
)
def test_a_config_file_that_does_not_run_is_an_error_naming_its_line(tmp_path, capsys, body,
                                                                    message):
    path = tmp_path / "bad.py"
    path.write_text(body)
    with pytest.raises(ConfigError, match=message):
        config_lib.load_run(path)
    assert main(["--config", str(path), f"--workdir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


def test_a_workdir_that_cannot_be_written_is_an_error_before_any_work(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for workdir, message in ((a_file, "is a file, not a directory"),
                             (a_file / "run", "cannot write to")):
        assert main(["--config=tests/tiny.py", f"--workdir={workdir}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --workdir: ") and message in err and str(a_file) in err


@pytest.mark.parametrize("key, value", [
    ("moe.capacity.policy", "dynamc"), ("moe.dispatch", "grouped"), ("pruning.scale", "nne"),
    ("mod.eval_routing", "causal"), ("early_exit.confidence", "max"),
    ("sparse_attention.kernel", "cuda"), ("freezing.metric", "grad"),
])
def test_an_invalid_choice_is_refused_even_in_a_section_that_is_off(capsys, key, value):
    """Issue 32 §7: a misspelt choice in a scheme that is off (the tiny config has none on)
    is an error now, not when the scheme is turned on."""
    assert main(["--config=tests/tiny.py", f"--config.{key}={value}"]) == 2
    assert f"error: {key}={value!r} is not one of (" in capsys.readouterr().err


def test_cli_reports_config_errors_and_exits_2(capsys):
    assert main(["--config", "configs/quickstart.py", "--config.model.d_modle=64"]) == 2
    assert "unknown config key 'model.d_modle'" in capsys.readouterr().err
    assert main(["--config", "configs/missing.py"]) == 2


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["--config.train.grad_clip=-1"], "train.grad_clip=-1.0 must be >= 0"),
        (
            ["--config.moe.every=2", "--config.moe.caching.enabled=True",
             "--config.moe.caching.off_threshold=0.99"],
            "off_threshold <= on_threshold",
        ),
    ],
)
def test_cli_reports_bad_values_with_the_key_and_exits_2(capsys, overrides, message):
    assert main(["--config", "tests/tiny.py", *overrides]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_cli_reports_config_errors_found_once_devices_are_known(capsys, monkeypatch):
    """Multi-process checks run inside `train` (they need the processes): exit 2 as well."""
    monkeypatch.setattr(
        "dynjax.train.train", lambda cfg, *a, **k: _check_multi_process(cfg)
    )
    # The routing cache runs over processes, in a pipeline and in one program.
    _check_multi_process(tiny_config(moe__caching__enabled=True, moe__every=2))
    # Partial expert saves, in one program over the processes and in a pipeline over them.
    _check_multi_process(tiny_config(checkpoint__experts_per_save=1, moe__every=2))
    _check_multi_process(tiny_config(checkpoint__experts_per_save=1, moe__every=2, mesh__stage=2))
    one = ["--config.train.keep_checkpoints=1", "--config.mesh.stage=2"]
    assert main(["--config", "tests/tiny.py", *one]) == 2
    assert "train.keep_checkpoints=1: a pipeline over processes" in capsys.readouterr().err


def _check_multi_process(cfg) -> None:
    """`train`'s checks of a multi-process run, with a pipeline if the config has one."""
    run = read_run(cfg)
    train_module._check_multi_process(run, pipeline=bool(num_stages(run)))


def test_cli_override_forms():
    config, overrides, workdir = parse_args(
        ["--config", "c.py", "--config.train.steps=5", "--config.seed", "3", "--workdir", "w"]
    )
    assert (config, overrides, workdir) == ("c.py", ["train.steps=5", "seed=3"], "w")


LLAMA = {"model__family": "llama"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model__family": "mistral"}, r"model.family='mistral' is not one of \('gpt', 'llama'\)"),
        ({"model__num_kv_heads": 3, "model__num_heads": 4, "model__d_model": 32},
         r"model.num_kv_heads=3 must divide model.num_heads=4"),
        ({"model__num_kv_heads": -1}, r"model.num_kv_heads=-1 must divide"),
        ({**LLAMA, "model__positions": "learned"},
         r"model.family='llama' uses rotary positions.*model.positions='rope'"),
        ({"model__positions": "learned", "model__rope_scaling": "linear"},
         r"model.rope_scaling='linear' scales rotary positions.*set it to 'none'"),
        ({"model__rope_scaling": "yarn"}, r"model.rope_scaling='yarn' is not one of"),
        ({"model__rope_scaling": "linear", "model__rope_factor": 0.5},
         r"model.rope_factor=0.5 must be >= 1"),
        ({"model__rope_scaling": "llama3", "model__rope_low_freq_factor": 4.0},
         r"model.rope_low_freq_factor=4.0 and model.rope_high_freq_factor=4.0 must satisfy"),
        ({"model__norm_eps": 0.0}, r"model.norm_eps=0.0 must be > 0"),
        ({"model__rope_base": 1.0}, r"model.rope_base=1.0 must be > 1"),
        ({"moe__shared_expert_dim": 16}, r"moe.shared_expert_dim=16 needs MoE layers"),
        ({"moe__normalize_topk": False}, r"moe.normalize_topk=False needs MoE layers"),
        ({**MOE, "moe__shared_expert_dim": -8}, r"moe.shared_expert_dim=-8 must be >= 0"),
        ({**MOE, "moe__shared_expert_gate": True},
         r"moe.shared_expert_gate=True gates the shared expert, but moe.shared_expert_dim=0"),
        ({**MOE, "moe__routing": "expert_choice", "moe__normalize_topk": False},
         r"moe.normalize_topk=False shapes token choice's top-k gates"),
    ],
)
def test_model_family_keys_name_their_conflict(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate_config(tiny_config(**overrides), num_devices=8)


def test_a_llama_config_builds_its_model_config():
    cfg = tiny_config(**LLAMA, **MOE, model__num_kv_heads=1, model__rope_scaling="llama3",
                      model__rope_base=5e5, moe__normalize_topk=False, moe__shared_expert_dim=8)
    validate_config(cfg, num_devices=1)
    model = config_lib.gpt_config(cfg)
    assert (model.family, model.num_kv_heads, model.rope.scaling) == ("llama", 1, "llama3")
    assert model.rope.base == 5e5 and model.rope.factor == 8.0
    assert (model.normalize_topk, model.shared_expert_dim) == (False, 8)
