"""``python -m dynjax.launch.local --processes N [--devices-per-process K] -- <train args>``.

Starts N local ``python -m dynjax.train`` processes that form one `jax.distributed` run: process
0 hosts the coordinator on a free local port, each process gets K CPU devices (so the run has
N*K devices and each process owns the devices, hence the pipeline stages, that follow its
predecessor's). Each pipeline stage must lie in one process: K must be a multiple of
mesh.data * mesh.expert (a run without stages spans every process's devices). Output is
prefixed ``[i]``; when one process fails the launcher says which and how, stops the others (they
would wait for it) and exits with that process's status (128 + the signal's number if a signal
killed it, as a shell reports it). Every line also goes to ``<workdir>/launch.log``; the
collectives' connection lines (``[Gloo] ...``) only there. SIGTERM, SIGINT (Ctrl-C) and
SIGUSR1 sent to the launcher go to every process (each in its own session, so a terminal's
Ctrl-C reaches them once, through here): they stop at the same step, save it and exit with
`PREEMPTED_EXIT`, as the launcher then does; a second signal aborts them.

    python -m dynjax.launch.local --processes 2 --devices-per-process 4 -- \\
        --config configs/quickstart.py --config.mesh.stage=4 --config.mesh.data=2

With ``--elastic``, a process killed by a signal does not end the run: it starts again on the
processes left (`dynjax.launch.elastic`).

With ``--pin-cores``, process i runs on core i alone (the i-th of the cores the launcher may use,
`os.sched_getaffinity`) and XLA:CPU runs each op in the calling thread (`PIN_XLA_FLAG`): the
processes no longer share cores, so stages in different processes can compute at the same time
on a 2-core machine (whether the pipeline runtime lets them: docs/benchmarks.md, "Stages on
cores of their own"). It needs at least as many cores as processes.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TextIO

from dynjax.errors import ConfigError
from dynjax.launch import elastic
from dynjax.launch.preemption import PREEMPTED_EXIT, SIGNALS
from dynjax.launch.watchdog import RESUME


def free_port() -> int:
    """A TCP port no one listens on now (the coordinator binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# XLA:CPU's intra-op parallelism off: on one pinned core its Eigen thread pool only adds
# switching between threads that share that core. (``intra_op_parallelism_threads`` is not an
# XLA flag; XLA rejects it as unknown, and jax's CPU client has no other thread setting.)
PIN_XLA_FLAG = "--xla_cpu_multi_thread_eigen=false"


def cores_for(processes: int) -> list[int]:
    """The core each of ``processes`` pinned processes runs on: the cores this process may use,
    in order. Raises `ConfigError` when there are fewer than ``processes``."""
    available = sorted(os.sched_getaffinity(0))
    if processes > len(available):
        raise ConfigError(
            f"--pin-cores needs a core per process: {processes} processes but only "
            f"{len(available)} cores available ({available}); use --processes <= "
            f"{len(available)} or leave out --pin-cores"
        )
    return available[:processes]


def process_env(
    rank: int, processes: int, devices: int, port: int, pinned: bool = False
) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DYNJAX_COORDINATOR=f"127.0.0.1:{port}",
        DYNJAX_NUM_PROCESSES=str(processes),
        DYNJAX_PROCESS_ID=str(rank),
        DYNJAX_LOCAL_DEVICES=str(devices),
        JAX_PLATFORMS="cpu",
    )
    # A forced host device count would override DYNJAX_LOCAL_DEVICES.
    flags = env.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if "force_host_platform_device_count" not in f]
    if pinned:
        flags = [f for f in flags if not f.startswith("--xla_cpu_multi_thread_eigen")]
        flags.append(PIN_XLA_FLAG)
    env["XLA_FLAGS"] = " ".join(flags)
    return env


QUIET = ("[Gloo] ",)  # the collectives' connection lines: to the log file only


def _relay(rank: int, stream, log: TextIO | None) -> None:
    """Each line of process ``rank`` to ``log`` (every line) and the console (not `QUIET`)."""
    for raw in iter(stream.readline, b""):
        line = f"[{rank}] {raw.decode(errors='replace')}"
        if log is not None:
            log.write(line)
            log.flush()
        if not line[len(f"[{rank}] "):].startswith(QUIET):
            sys.stdout.write(line)
            sys.stdout.flush()


def workdir_of(train_args: list[str]) -> Path:
    """The run's workdir as ``dynjax.train`` will take it from its arguments."""
    return elastic.train_arguments(train_args)[2]


def how_it_ended(returncode: int) -> str:
    """A child's `subprocess.Popen.returncode` in words."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _spawn(command: list[str], env: dict[str, str], core: int | None) -> subprocess.Popen:
    """Start ``command``; with ``core``, on that core alone. The calling thread's affinity is
    set for the fork and put back: the child inherits it before it runs anything, so every
    thread it starts is pinned too (no window where one runs elsewhere)."""
    kwargs = dict(env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                  start_new_session=True)
    if core is None:
        return subprocess.Popen(command, **kwargs)
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        return subprocess.Popen(command, **kwargs)
    finally:
        os.sched_setaffinity(0, mine)


def launch(
    processes: int,
    devices: int,
    command: list[str],
    log: TextIO | None = None,
    pin_cores: bool = False,
) -> int:
    """Run ``command`` as each process of the run, to completion; the status of the first that
    failed, else `PREEMPTED_EXIT` if they stopped at a signal, else 0. Every line the processes
    print goes to ``log`` too. ``pin_cores``: process i on core i alone (`cores_for`)."""
    cores = cores_for(processes) if pin_cores else [None] * processes
    port = free_port()
    procs, relays = [], []
    if threading.current_thread() is threading.main_thread():  # where Python allows handlers
        for sig in SIGNALS:  # a scheduler's notice, or Ctrl-C: every process stops and saves
            signal.signal(sig, lambda signum, frame: _forward(procs, signum))
    for rank in range(processes):
        proc = _spawn(command, process_env(rank, processes, devices, port, pin_cores), cores[rank])
        relay = threading.Thread(target=_relay, args=(rank, proc.stdout, log), daemon=True)
        relay.start()
        procs.append(proc)
        relays.append(relay)
    failed: int | None = None
    while True:
        running = any(proc.poll() is None for proc in procs)
        if failed is None:
            failed = next(
                (r for r, proc in enumerate(procs) if proc.poll() not in (None, 0, PREEMPTED_EXIT)),
                None,
            )
            if failed is not None:  # the others would wait for it: stop them
                print(
                    f"error: process {failed} (of {processes}) "
                    f"{how_it_ended(procs[failed].returncode)}; {RESUME}",
                    file=sys.stderr,
                    flush=True,
                )
                for proc in procs:
                    if proc.poll() is None:
                        proc.terminate()
        if not running:
            break
        time.sleep(0.2)
    for relay in relays:
        relay.join()
    if failed is None:
        return PREEMPTED_EXIT if any(p.returncode == PREEMPTED_EXIT for p in procs) else 0
    code = procs[failed].returncode
    return 128 - code if code < 0 else code


def launch_elastic(
    processes: int,
    devices: int,
    command: list[str],
    train_args: list[str],
    log: TextIO | None,
    pin_cores: bool = False,
) -> int:
    """`launch`, started again on one process fewer whenever one is killed (`elastic.died`),
    its mesh shrunk to the devices left (`elastic.restart_overrides`), resuming from the newest
    checkpoint; down to one process. Each restart is an ``elastic_restart`` event."""
    extra: list[str] = []
    workdir = workdir_of(train_args)
    while True:
        status = launch(processes, devices, [*command, *extra], log, pin_cores)
        if not elastic.died(status) or processes == 1:
            return status
        ended = time.time()
        try:
            more = elastic.restart_overrides([*train_args, *extra], processes - 1, devices)
        except ConfigError as err:
            print(f"error: cannot go on with {processes - 1} processes: {err}", file=sys.stderr)
            return status
        processes, extra = processes - 1, [*extra, *more]
        elastic.record_restart(workdir, {"processes": processes, "status": status,
                                         "overrides": more, "stopped_at": ended})
        print(f"elastic: a process was killed; going on with {processes} process(es) "
              f"({' '.join(more)}) from the newest checkpoint", file=sys.stderr, flush=True)


def _forward(procs: list[subprocess.Popen], signum: int) -> None:
    """Send the launcher's signal on to every process still running."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: python -m dynjax.launch.local --processes N -- <train args>", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m dynjax.launch.local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, required=True)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument(
        "--elastic", action="store_true",
        help="when a process is killed, go on with the others (mesh shrunk, from the newest "
        "checkpoint)",
    )
    parser.add_argument(
        "--pin-cores", action="store_true",
        help="run process i on core i alone, XLA:CPU single-threaded: the processes compute in "
        "parallel, one per core (needs a core per process)",
    )
    args = parser.parse_args(argv[:split])
    if args.processes < 1 or args.devices_per_process < 1:
        parser.error("--processes and --devices-per-process must be >= 1")
    if args.pin_cores:
        try:
            cores_for(args.processes)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    train = [sys.executable, "-m", "dynjax.train", *argv[split + 1 :]]
    workdir = workdir_of(argv[split + 1 :])
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "launch.log", "a") as log:
        if args.elastic:
            return launch_elastic(
                args.processes, args.devices_per_process, train, argv[split + 1 :], log,
                args.pin_cores,
            )
        return launch(args.processes, args.devices_per_process, train, log, args.pin_cores)


if __name__ == "__main__":
    sys.exit(main())
