"""The SLURM and Kubernetes launchers: the process environment they produce from fake cluster
variables, the sbatch script under fake srun/scontrol, the manifests, the release PATCH."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import jax
import pytest
import yaml

from dynjax.launch.cluster import (
    HEARTBEAT_SECONDS,
    ClusterError,
    ProcessEnv,
    expand_nodelist,
    heartbeat_seconds,
    kubernetes_env,
    process_env,
    slurm_env,
)
from dynjax.launch.preemption import PREEMPTED_EXIT
from dynjax.launch.release import patch_pod_resources

from ..helpers import ROOT


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("node1", ["node1"]),
        ("gpu[01-03,07],cpu5", ["gpu01", "gpu02", "gpu03", "gpu07", "cpu5"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("x-1,y[1,3]", ["x-1", "y1", "y3"]),
    ],
)
def test_slurm_nodelists_expand_in_order(spec, hosts):
    assert expand_nodelist(spec) == hosts


SLURM = {"SLURM_JOB_ID": "12345", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1"}


def test_slurm_gives_the_first_node_as_coordinator_and_the_rank():
    assert slurm_env(SLURM) == ProcessEnv("gpu07:61497", 2, 1, "slurm")  # 61440 + 12345 % 4096
    assert slurm_env({**SLURM, "DYNJAX_COORDINATOR_PORT": "7000"}).coordinator == "gpu07:7000"
    assert process_env(SLURM) == slurm_env(SLURM)
    # One task: a single process, no jax.distributed.
    assert process_env({**SLURM, "SLURM_JOB_NODELIST": "gpu07", "SLURM_NTASKS": "1",
                        "SLURM_PROCID": "0"}) is None


@pytest.mark.parametrize(
    "change, message",
    [
        ({"SLURM_NTASKS": "4"}, "--ntasks-per-node=1"),
        ({"SLURM_PROCID": "2"}, "process 2 of 2"),
        ({"SLURM_NTASKS": "two"}, "SLURM_NTASKS='two'"),
        ({"DYNJAX_COORDINATOR_PORT": "80"}, "DYNJAX_COORDINATOR_PORT=80"),
        ({"SLURM_JOB_NODELIST": "gpu[a-b]"}, "SLURM_JOB_NODELIST"),
    ],
)
def test_contradictory_slurm_variables_are_named(change, message):
    with pytest.raises(ClusterError, match=message.replace("[", r"\[")):
        process_env({**SLURM, **change})


POD = {"JOB_COMPLETION_INDEX": "1", "DYNJAX_NUM_PROCESSES": "2", "DYNJAX_JOB_NAME": "dynjax",
       "DYNJAX_SERVICE": "dynjax", "DYNJAX_COORDINATOR_PORT": "6379"}


def test_an_indexed_job_pod_finds_pod_zero_through_the_headless_service():
    assert kubernetes_env(POD) == ProcessEnv("dynjax-0.dynjax:6379", 2, 1, "kubernetes")
    with pytest.raises(ClusterError, match="DYNJAX_JOB_NAME and DYNJAX_SERVICE"):
        process_env({k: v for k, v in POD.items() if k != "DYNJAX_SERVICE"})
    with pytest.raises(ClusterError, match="process 2 of 2"):
        process_env({**POD, "JOB_COMPLETION_INDEX": "2"})


def test_the_local_launchers_variables_win_and_must_come_together():
    local = {"DYNJAX_COORDINATOR": "127.0.0.1:5000", "DYNJAX_NUM_PROCESSES": "2",
             "DYNJAX_PROCESS_ID": "0"}
    assert process_env({**SLURM, **local}) == ProcessEnv("127.0.0.1:5000", 2, 0, "dynjax")
    with pytest.raises(ClusterError, match="DYNJAX_PROCESS_ID not set"):
        process_env({"DYNJAX_COORDINATOR": "h:1", "DYNJAX_NUM_PROCESSES": "2"})
    assert process_env({}) is None


def test_train_refuses_a_bad_cluster_environment_with_exit_2():
    env = {**os.environ, **SLURM, "SLURM_NTASKS": "3"}
    run = subprocess.run([sys.executable, "-m", "dynjax.train", "--config", "tests/tiny.py"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("error: SLURM_NTASKS=3 on 2 nodes")
    assert "Traceback" not in run.stderr


def fake_tools(tmp_path, srun_seconds):
    """srun and scontrol that log their arguments; srun runs for ``srun_seconds``, or until
    SIGUSR1, which its tasks answer as dynjax does: saved, exit status 75."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "srun").write_text(  # its trap is set before it logs that it runs
        f"#!/usr/bin/env bash\ntrap 'kill $!; echo srun got USR1 >> {log}; exit 75' USR1\n"
        f'echo "srun $*" >> {log}\nsleep {srun_seconds} & wait $!\n'
    )
    (bin_dir / "scontrol").write_text(f'#!/usr/bin/env bash\necho "scontrol $*" >> {log}\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "77",
           "DYNJAX_WORKDIR": str(tmp_path / "work"), "DYNJAX_CONFIG": "configs/moe.py",
           "DYNJAX_PYTHON": "/opt/venv/bin/python"}
    return env, log


def test_the_sbatch_script_runs_one_task_per_node_with_its_arguments(tmp_path):
    env, log = fake_tools(tmp_path, 0)
    run = subprocess.run(["bash", "launch/slurm.sbatch", "--config.train.steps=9"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert log.read_text().split() == [
        "srun", "--kill-on-bad-exit=1", "--ntasks-per-node=1", "/opt/venv/bin/python", "-m",
        "dynjax.train", "--config", "configs/moe.py", "--workdir", str(tmp_path / "work"),
        "--config.train.steps=9",
    ]
    directives = [line for line in (ROOT / "launch/slurm.sbatch").read_text().splitlines()
                  if line.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in directives and "#SBATCH --signal=B:USR1@300" in directives
    assert "#SBATCH --ntasks-per-node=1" in directives
    missing = {k: v for k, v in env.items() if k != "DYNJAX_WORKDIR"}
    run = subprocess.run(["bash", "launch/slurm.sbatch"], cwd=ROOT, env=missing,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "DYNJAX_WORKDIR" in run.stderr


def test_the_preemption_signal_reaches_the_tasks_and_a_saved_job_is_requeued(tmp_path):
    """SLURM's notice goes to the batch shell (``--signal=B:USR1``): it passes it to the tasks
    (srun forwards it), which save and exit with `PREEMPTED_EXIT`; then it requeues the job."""
    env, log = fake_tools(tmp_path, 30)
    script = subprocess.Popen(["bash", "launch/slurm.sbatch"], cwd=ROOT, env=env,
                              stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while not (log.exists() and "srun" in log.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    script.send_signal(signal.SIGUSR1)
    _, stderr = script.communicate(timeout=60)
    assert script.returncode == PREEMPTED_EXIT
    calls = log.read_text().splitlines()
    assert calls[-2:] == ["srun got USR1", "scontrol requeue 77"], calls
    assert "saving" in stderr and "requeueing" in stderr


def test_the_manifests_carry_what_a_cluster_needs():
    docs = list(yaml.safe_load_all((ROOT / "launch/k8s/job.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert kinds["Service"]["spec"]["clusterIP"] == "None"
    job = kinds["Job"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"]
    pod = job["template"]["spec"]
    assert pod["subdomain"] == kinds["Service"]["metadata"]["name"]
    assert pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    (container,) = pod["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert int(env["DYNJAX_NUM_PROCESSES"]) == job["parallelism"]
    assert env["DYNJAX_CONTAINER"] == container["name"]
    assert any("patch_pod_resources" in a for a in container["args"])
    rules = kinds["Role"]["rules"]
    assert {"pods", "pods/resize"} <= {r for rule in rules for r in rule["resources"]}
    # The process environment a pod of index 1 gets from it.
    pod_env = {**{k: v for k, v in env.items() if v is not None}, "JOB_COMPLETION_INDEX": "1"}
    found = kubernetes_env(pod_env)
    assert found.coordinator == f"{kinds['Job']['metadata']['name']}-0.{pod['subdomain']}:6379"
    pvc = yaml.safe_load((ROOT / "launch/k8s/workdir-pvc.yaml").read_text())
    claim = next(v for v in pod["volumes"] if v["name"] == "workdir")["persistentVolumeClaim"]
    assert pvc["metadata"]["name"] == claim["claimName"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    # A stopped run's pods (exit `PREEMPTED_EXIT`, step saved) are replaced, not failed.
    [rule] = job["podFailurePolicy"]["rules"]
    assert rule["action"] == "Ignore" and rule["onExitCodes"]["values"] == [PREEMPTED_EXIT]
    assert rule["onExitCodes"]["containerName"] == container["name"]
    assert pod["terminationGracePeriodSeconds"] >= 60


@pytest.mark.parametrize("resize_exists", [True, False])
def test_the_release_hook_patches_the_pods_gpu_request(tmp_path, monkeypatch, resize_exists):
    calls = []

    class Api(BaseHTTPRequestHandler):
        def do_PATCH(self):  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append((self.path, self.headers["Authorization"], body))
            found = resize_exists or not self.path.endswith("/resize")
            self.send_response(200 if found else 404)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    account = tmp_path / "sa"
    account.mkdir()
    (account / "token").write_text("secret\n")
    monkeypatch.setenv("DYNJAX_K8S_API", f"http://127.0.0.1:{server.server_port}")
    monkeypatch.setenv("DYNJAX_K8S_SERVICE_ACCOUNT", str(account))
    monkeypatch.setenv("POD_NAME", "dynjax-1-abcde")
    monkeypatch.setenv("POD_NAMESPACE", "research")
    try:
        patch_pod_resources(jax.local_devices()[4:])  # half the local devices released
    finally:
        server.shutdown()
    pod = "/api/v1/namespaces/research/pods/dynjax-1-abcde"
    assert [c[0] for c in calls] == ([f"{pod}/resize"] if resize_exists else
                                     [f"{pod}/resize", pod])
    path, auth, body = calls[-1]
    assert auth == "Bearer secret"
    remaining = str(len(jax.local_devices()) - 4)
    (container,) = body["spec"]["containers"]
    assert container == {"name": "train", "resources": {
        "requests": {"nvidia.com/gpu": remaining}, "limits": {"nvidia.com/gpu": remaining}}}


def test_the_heartbeat_timeout_has_one_default_and_refuses_nonsense():
    assert heartbeat_seconds({}) == HEARTBEAT_SECONDS
    assert heartbeat_seconds({"DYNJAX_HEARTBEAT_SECONDS": "2.5"}) == 2.5
    for bad in ("0", "-3", "ten", "inf", "nan"):
        with pytest.raises(ClusterError, match=f"DYNJAX_HEARTBEAT_SECONDS='{bad}' is not a pos"):
            heartbeat_seconds({"DYNJAX_HEARTBEAT_SECONDS": bad})
