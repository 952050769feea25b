"""Re-packing inside dynjax.train: four stages become two, two sub-meshes are released, the
losses do not change, and a resumed run stays packed (seed 000 §3.4)."""

import shutil

import jax
import numpy as np
import pytest

from dynjax.errors import ConfigError
from dynjax.launch.release import RELEASED_FILE, load_release_hook, release
from dynjax.parallel.profile import device_memory_limit
from dynjax.train import train
from dynjax.writers import read_jsonl

from ..helpers import layer_moves, loss_curve
from ..tiny import tiny_config

# The swap waits for its compile (recompile.blocking): it lands at the same step on any machine
# (in the background, 16-27 steps of this tiny model on an idle machine, 37-50 on a loaded one,
# or past the run's end when the re-pack picked a split whose cold compile was long).
RUN = dict(
    model__num_layers=5, mesh__data=2, train__steps=40, train__microbatches=4,
    train__log_every=1, train__eval_every=40, train__checkpoint_every=10,
    recompile__delta_launch=1, recompile__blocking=True,
)
REPACK = dict(
    balance__repack=True, balance__repack_every=5, balance__repack_target=2,
    balance__repack_max_slowdown=100.0, balance__memory_bytes=1e12,
)


class GrowBack:
    """A test policy that asks for four stages again once a two-stage layout has run."""

    name = "grow-back"

    def propose(self, history, plan):
        ran = history.values("profile/stage_layers", 1)
        if ran and len(ran[0]) == 2:
            return plan.replace(stage_layers=(2, 1, 1, 1))
        return None



@pytest.mark.slow
def test_repack_releases_stages_and_keeps_the_losses(tmp_path):
    # Two stages from the start: the losses to match (layouts change no loss).
    reference = tmp_path / "reference"
    train(tiny_config(**RUN, mesh__stage=2), reference, progress=False)
    released = []
    packed = tmp_path / "packed"
    train(
        tiny_config(**RUN, **REPACK, mesh__stage=4),
        packed,
        policies=[GrowBack()],
        progress=False,
        release_hook=released.append,
    )
    events = read_jsonl(packed / "events.jsonl")
    decision = next(e for e in events if e["event"] == "repack")
    # Which two-stage split is optimal depends on the measured layer times: any one will do.
    old, new = decision["old"], decision["new"]
    assert old == [2, 1, 1, 1] and len(new) == 2 and sum(new) == 5 and decision["accepted"]
    assert decision["policy"] == "repack"
    (migrate,) = [e for e in events if e["event"] == "migrate"]
    assert migrate["moves"] == layer_moves(old, new)
    (release,) = [e for e in events if e["event"] == "release"]
    # the run resumes from step 30 below
    assert release["step"] == migrate["step"] < 30 and release["stages"] == [2, 3]
    devices = jax.devices()[4:8]  # sub-meshes 2 and 3 of the (4, 2, 1) mesh
    assert [d["id"] for d in release["devices"]] == [d.id for d in devices]
    assert released == [devices] and release["hook"].endswith("append")
    # Packed to the target: no further decision; the released sub-meshes cannot come back.
    assert [e["profile_step"] for e in events if e["event"] == "repack"] == [0]
    refused = [e for e in events if e["event"] == "recompile_rejected"]
    assert refused and all(e["policy"] == "grow-back" for e in refused)
    assert "only 2 stage sub-meshes are available" in refused[0]["reason"]
    assert len([e for e in events if e["event"] == "migrate"]) == 1
    assert len(loss_curve(packed)) == 40
    np.testing.assert_allclose(loss_curve(packed), loss_curve(reference), rtol=1e-5)

    # Lose the last checkpoint: resumed from step 30 on the same mesh, the run stays on two
    # stages, gives the other two back again and trains the same steps to the same losses.
    shutil.rmtree(packed / "checkpoints" / "40")
    train(tiny_config(**RUN, **REPACK, mesh__stage=4), packed, progress=False)
    events = read_jsonl(packed / "events.jsonl")
    resumed = [e for e in events if e["event"] == "release"][-1]
    assert resumed["step"] == 30 and resumed["stages"] == [2, 3] and resumed["hook"] is None
    assert resumed["reason"] == "resumed re-packed"
    restart = [e for e in events if e["event"] == "compile"][-1]
    assert restart["step"] == 30 and restart["plan"]["stage_layers"] == new
    np.testing.assert_allclose(loss_curve(packed), loss_curve(reference), rtol=1e-5)


def test_repack_config_errors_name_the_fix(tmp_path):
    if device_memory_limit(jax.devices()) is not None:
        pytest.skip("this backend reports its memory limit: balance.memory_bytes may stay 0")
    with pytest.raises(ConfigError, match="balance.memory_bytes"):  # CPU reports no limit
        train(
            tiny_config(**RUN, **{**REPACK, "balance__memory_bytes": 0.0}, mesh__stage=4),
            tmp_path / "no-limit",
            progress=False,
        )
    with pytest.raises(ConfigError, match="cannot import 'no_such_module'"):
        train(
            tiny_config(**RUN, **REPACK, mesh__stage=4, balance__release_hook="no_such_module:f"),
            tmp_path / "bad-hook",
            progress=False,
        )


def test_the_file_hook_writes_what_a_watcher_needs(tmp_path, monkeypatch):
    target = tmp_path / "released.jsonl"
    monkeypatch.setenv(RELEASED_FILE, str(target))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    hook = load_release_hook("dynjax.launch.release:append_to_file")
    event = release(jax.devices()[6:8], (3,), hook, step=7, reason="test")
    (line,) = read_jsonl(target)
    assert line["job"] == "4242" and [d["id"] for d in line["devices"]] == [6, 7]
    assert event["devices"] == line["devices"] and event["stages"] == [3]
    assert event["hook"] == "append_to_file" and "hook_error" not in event

    def broken(devices):
        raise RuntimeError("scheduler unreachable")

    failed = release(jax.devices()[6:8], (3,), broken, step=7, reason="test")
    assert failed["hook_error"] == "RuntimeError: scheduler unreachable"
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        load_release_hook("dynjax.launch.release:nope")
