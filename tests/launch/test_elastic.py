"""``--elastic``: a process killed for good does not end the run; it goes on with the processes
left, its mesh shrunk, from the newest checkpoint (issue 32, "Beyond")."""

import sys

import numpy as np
import pytest

from dynjax.errors import ConfigError
from dynjax.launch import elastic, local
from dynjax.settings import read_run
from dynjax.writers import read_jsonl

from ..helpers import ROOT, TWO_PROCESS_BASE, TWO_PROCESS_LAYOUTS, events_of, two_processes
from ..helpers import losses as losses_of
from ..tiny import dotted_config


def test_the_mesh_shrinks_to_the_devices_left():
    one_program = read_run(dotted_config({"mesh.data": 8}))
    assert elastic.shrunk(one_program, 4) == {"mesh.data": 4}
    pipeline = read_run(
        dotted_config({"mesh.stage": 2, "mesh.data": 4, "pipeline.stage_layers": "(1,1)"})
    )
    assert elastic.shrunk(pipeline, 4) == {"mesh.stage": 1, "pipeline.stage_layers": ""}
    with pytest.raises(ConfigError, match="a pipeline stage needs 4 devices"):
        elastic.shrunk(pipeline, 2)
    assert elastic.died(128 + 9) and not elastic.died(1) and not elastic.died(75)


def test_restart_overrides_are_checked_as_the_run_checks_them():
    args = ["--config", "tests/tiny.py", "--config.mesh.data=8", "--workdir", "/tmp/x"]
    assert elastic.restart_overrides(args, 1, 4) == ["--config.mesh.data=4"]
    with pytest.raises(ConfigError):  # 3 devices split no batch of the tiny config
        elastic.restart_overrides(args, 1, 3)


def test_restart_overrides_refuse_a_config_with_an_unknown_key_naming_it(tmp_path):
    """The mesh is shrunk from the config's records, read after its keys are checked: a key
    the records lack is the run's own error, not a TypeError."""
    path = tmp_path / "extra.py"
    path.write_text(
        "from tests.tiny import tiny_config\n"
        "def get_config():\n"
        "    c = tiny_config()\n"
        "    c.unlock()\n"
        "    c.mesh.pods = 2\n"
        "    return c\n"
    )
    args = ["--config", str(path), "--config.mesh.data=8", "--workdir", "/tmp/x"]
    with pytest.raises(ConfigError, match=r"unknown config keys \['mesh.pods'\]"):
        elastic.restart_overrides(args, 1, 4)


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(TWO_PROCESS_LAYOUTS))
def test_a_killed_process_leaves_a_run_that_goes_on_with_the_other(tmp_path, monkeypatch, layout):
    """Process 1 dies for good after saving step 4 of 8; the launcher restarts the run on
    process 0 alone (4 devices), which resumes from step 4: steps 1-4 as trained, 5-8 as an
    uninterrupted run trains them (up to the summation order of fewer devices)."""
    run = {**TWO_PROCESS_BASE, **TWO_PROCESS_LAYOUTS[layout], "train.steps": 8,
           "train.checkpoint_every": 2, "train.eval_every": 1000}
    reference, workdir = tmp_path / "reference", tmp_path / "run"
    two_processes(reference, run)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(ROOT)
    args = ["--config", "tests/tiny.py", "--workdir", str(workdir),
            *(f"--config.{k}={v}" for k, v in run.items())]
    marker = tmp_path / "died"
    command = [sys.executable, "tests/scripts/die_once.py", "4", str(marker), *args]
    assert local.launch_elastic(2, 4, command, args, None) == 0
    [restart] = events_of(workdir, "elastic_restart")
    assert restart["processes"] == 1 and restart["status"] == 128 + 9
    [resume] = events_of(workdir, "resume")
    assert resume["step"] == 4
    got, want = losses_of(workdir), losses_of(reference)
    assert sorted(got) == list(range(1, 9))
    assert {s: got[s] for s in range(1, 5)} == {s: want[s] for s in range(1, 5)}
    np.testing.assert_allclose([got[s] for s in range(5, 9)], [want[s] for s in range(5, 9)],
                               rtol=1e-4)
    # What the restart cost: seconds from the death to the first step the restarted run
    # logged, and the steps the dead run trained past its last checkpoint (trained again).
    died = float(marker.read_text())
    records = [r for r in read_jsonl(workdir / "metrics.jsonl") if "loss" in r]
    first_after = min(r["time"] for r in records if r.get("resumed_from") == 4)
    redone = [r["step"] for r in records if "resumed_from" not in r and r["step"] > 4]
    print(f"{layout}: {first_after - died:.1f} s from the death to the first step after it; "
          f"steps trained again: {len(redone)}")
