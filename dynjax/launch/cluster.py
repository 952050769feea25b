"""Where a process of a run is: `jax.distributed` arguments from what the launcher set.

Three launchers start the processes of one run (docs/parallelism.md, "Clusters"):

- ``dynjax.launch.local`` sets ``DYNJAX_COORDINATOR``, ``DYNJAX_NUM_PROCESSES`` and
  ``DYNJAX_PROCESS_ID`` itself (those always win);
- SLURM (``launch/slurm.sbatch``, one task per node): the coordinator is the job's first node, on
  port 61440 + job id mod 4096 (or ``DYNJAX_COORDINATOR_PORT``), the process id the task's rank;
- Kubernetes (``launch/k8s/job.yaml``, an indexed Job behind a headless Service): the process id
  is the pod's completion index, the coordinator pod 0's stable DNS name
  ``<job>-0.<service>``, and the manifest sets the process count.

Pure functions of an environment mapping, so the tests feed them fake clusters.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping

SLURM_BASE_PORT = 61440  # + job id mod 4096: jobs sharing a node get different ports
HEARTBEAT_SECONDS = 10.0  # default of DYNJAX_HEARTBEAT_SECONDS
EXPLICIT = ("DYNJAX_COORDINATOR", "DYNJAX_NUM_PROCESSES", "DYNJAX_PROCESS_ID")


class ClusterError(ValueError):
    """The launcher's environment cannot describe this process: names the variable and fix."""


@dataclasses.dataclass(frozen=True)
class ProcessEnv:
    """`jax.distributed.initialize` arguments, and which launcher they came from."""

    coordinator: str  # host:port of process 0
    num_processes: int
    process_id: int
    source: str  # "dynjax", "slurm" or "kubernetes"


def expand_nodelist(spec: str) -> list[str]:
    """SLURM's compressed host list, in order: ``"gpu[01-03,07],cpu5"`` ->
    ``["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]`` (zero padding kept)."""
    hosts: list[str] = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", spec):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()):
                raise ClusterError(f"SLURM_JOB_NODELIST={spec!r}: cannot read the range {part!r}")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    if not hosts:
        raise ClusterError(f"SLURM_JOB_NODELIST={spec!r} names no host")
    return hosts


def _int(env: Mapping[str, str], key: str, fix: str) -> int:
    value = env.get(key)
    if value is None:
        raise ClusterError(f"{key} is not set: {fix}")
    try:
        return int(value)
    except ValueError:
        raise ClusterError(f"{key}={value!r} is not an integer: {fix}") from None


def _port(env: Mapping[str, str], default: int) -> int:
    raw = env.get("DYNJAX_COORDINATOR_PORT")
    if raw is None:
        return default
    port = _int(env, "DYNJAX_COORDINATOR_PORT", "set it to a free TCP port (1024-65535)")
    if not 1024 <= port <= 65535:
        raise ClusterError(f"DYNJAX_COORDINATOR_PORT={port} is not a port in 1024-65535")
    return port


def _checked(coordinator: str, count: int, index: int, source: str, fix: str) -> ProcessEnv:
    if count < 1 or not 0 <= index < count:
        raise ClusterError(f"process {index} of {count} is not a process of the run: {fix}")
    return ProcessEnv(coordinator, count, index, source)


def slurm_env(env: Mapping[str, str]) -> ProcessEnv:
    """The process of a SLURM job step started with one task per node."""
    fix = "launch with launch/slurm.sbatch (srun, one task per node)"
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ClusterError(f"SLURM_JOB_NODELIST is not set: {fix}")
    nodes = expand_nodelist(nodelist)
    tasks = _int(env, "SLURM_NTASKS", fix)
    if tasks != len(nodes):
        raise ClusterError(
            f"SLURM_NTASKS={tasks} on {len(nodes)} nodes: dynjax runs one process per node "
            "(it drives every GPU of its node); submit with --ntasks-per-node=1"
        )
    job = _int(env, "SLURM_JOB_ID", fix)
    port = _port(env, SLURM_BASE_PORT + job % 4096)
    return _checked(f"{nodes[0]}:{port}", tasks, _int(env, "SLURM_PROCID", fix), "slurm", fix)


def kubernetes_env(env: Mapping[str, str]) -> ProcessEnv:
    """The pod of an indexed Job (launch/k8s/job.yaml): index, count and service from it."""
    fix = "launch with launch/k8s/job.yaml (an indexed Job behind a headless Service)"
    index = _int(env, "JOB_COMPLETION_INDEX", fix)
    count = _int(env, "DYNJAX_NUM_PROCESSES", fix + ", which sets it to the Job's parallelism")
    job, service = env.get("DYNJAX_JOB_NAME"), env.get("DYNJAX_SERVICE")
    if not job or not service:
        raise ClusterError(
            f"DYNJAX_JOB_NAME and DYNJAX_SERVICE must name the Job and its headless Service: {fix}"
        )
    port = _port(env, 6379)
    return _checked(f"{job}-0.{service}:{port}", count, index, "kubernetes", fix)


def process_env(env: Mapping[str, str]) -> ProcessEnv | None:
    """This process's place in a multi-process run, or None for a single process."""
    # The local launcher's variables; DYNJAX_NUM_PROCESSES alone is the Kubernetes manifest's.
    if "DYNJAX_COORDINATOR" in env or "DYNJAX_PROCESS_ID" in env:
        missing = [k for k in EXPLICIT if k not in env]
        if missing:
            raise ClusterError(
                f"{', '.join(missing)} not set beside {', '.join(k for k in EXPLICIT if k in env)}"
                ": set all three (dynjax.launch.local does) or none"
            )
        fix = "dynjax.launch.local sets DYNJAX_NUM_PROCESSES and DYNJAX_PROCESS_ID consistently"
        return _checked(
            env["DYNJAX_COORDINATOR"],
            _int(env, "DYNJAX_NUM_PROCESSES", fix),
            _int(env, "DYNJAX_PROCESS_ID", fix),
            "dynjax",
            fix,
        )
    if "JOB_COMPLETION_INDEX" in env and "DYNJAX_NUM_PROCESSES" in env:
        found = kubernetes_env(env)
    elif "SLURM_JOB_ID" in env and "SLURM_PROCID" in env:
        found = slurm_env(env)
    else:
        return None
    return found if found.num_processes > 1 else None


def heartbeat_seconds(env: Mapping[str, str]) -> float:
    """``DYNJAX_HEARTBEAT_SECONDS``: after how long without a heartbeat a process of the run is
    declared dead, and the others stop (`dynjax.launch.watchdog`)."""
    raw = env.get("DYNJAX_HEARTBEAT_SECONDS")
    if raw is None:
        return HEARTBEAT_SECONDS
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ClusterError(
            f"DYNJAX_HEARTBEAT_SECONDS={raw!r} is not a positive number of seconds: unset it "
            f"for the default ({HEARTBEAT_SECONDS:g}) or set e.g. 30 on a slow network"
        )
    return seconds
