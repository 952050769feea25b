"""Going on with the processes that are left when one dies (issue 32, "Beyond").

No JAX system continues on fewer devices by itself: a dead process stops the others
(`dynjax.launch.watchdog`), and the job must start again. ``python -m dynjax.launch.local
--elastic`` starts it again at once on the processes that are left, with the mesh shrunk to
their devices (`shrunk`: fewer data-parallel devices, or fewer pipeline stages re-packed
uniformly, down to one program) and checked by the config's own validation before it starts;
the run resumes from its newest checkpoint, which restores onto any process count and mesh
(docs/checkpointing.md). Only a process killed by a signal (a lost host, the OOM killer) counts
as dead: an error in the program would fail the same way on fewer processes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dynjax import config as config_lib
from dynjax.errors import ConfigError
from dynjax.settings import RunSettings, num_stages


def died(status: int) -> bool:
    """Whether a launch's status (a shell's: 128 + the signal) says a process was killed."""
    return status > 128


def shrunk(run: RunSettings, devices: int) -> dict[str, object]:
    """Overrides that fit ``run``'s run onto ``devices`` devices: the data-parallel devices of
    one program scale down, or a pipeline keeps its stages' shape and loses stages (uniform
    layers per stage; the balancer may move them again), one program where one stage is left.
    Raises `ConfigError` where the run cannot fit (the caller names it)."""
    mesh = run.mesh
    if not num_stages(run):
        if devices % mesh.expert:
            raise ConfigError(f"{devices} devices do not hold mesh.expert={mesh.expert}")
        return {"mesh.data": devices // mesh.expert}
    per_stage = mesh.data * mesh.expert
    stages = devices // per_stage
    if stages < 1:
        raise ConfigError(f"a pipeline stage needs {per_stage} devices (mesh.data x "
                          f"mesh.expert) and {devices} are left")
    return {"mesh.stage": stages, "pipeline.stage_layers": ""}


def restart_overrides(
    train_args: list[str], processes: int, devices_per_process: int
) -> list[str]:
    """``--config.<key>=<value>`` arguments that, appended to ``train_args`` (later overrides
    win), run it on ``processes`` processes: checked as the run will check them."""
    config, overrides, _ = train_arguments(train_args)
    cfg, schemes = config_lib.load_run(config, overrides)
    devices = processes * devices_per_process
    changes = shrunk(config_lib.read_config(cfg, schemes), devices)
    extra = [f"--config.{k}={v}" for k, v in changes.items()]
    cfg, _ = config_lib.load_run(config, [*overrides, *(a[len("--config."):] for a in extra)])
    config_lib.validate_config(cfg, devices, schemes)
    return extra


def record_restart(workdir: Path, event: dict) -> None:
    """An ``elastic_restart`` event in the run's events.jsonl (no process runs meanwhile)."""
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "events.jsonl", "a") as f:
        f.write(json.dumps({"event": "elastic_restart", "time": time.time(), **event}) + "\n")


def train_arguments(train_args: list[str]) -> tuple[str, list[str], Path]:
    """The config file, its ``a.b=v`` overrides and the workdir in ``dynjax.train``'s arguments
    (its forms: ``--config F`` or ``--config=F``, ``--config.a.b=v`` or ``--config.a.b v``,
    ``--workdir D`` or ``--workdir=D``; the workdir defaults as the CLI's does)."""
    config, overrides, workdir, i = "", [], None, 0
    while i < len(train_args):
        arg, following = train_args[i], train_args[i + 1] if i + 1 < len(train_args) else None
        if arg in ("--config", "--workdir") and following is not None:
            config, workdir = (following, workdir) if arg == "--config" else (config, following)
            i += 1
        elif arg.startswith(("--config=", "--workdir=")):
            key, value = arg[2:].split("=", 1)
            config, workdir = (value, workdir) if key == "config" else (config, value)
        elif arg.startswith("--config."):
            body = arg[len("--config."):]
            if "=" not in body and following is not None:
                body, i = f"{body}={following}", i + 1
            overrides.append(body)
        i += 1
    return config, overrides, Path(workdir or Path("workdirs") / Path(config).stem)
