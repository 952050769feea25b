"""Giving devices back after a re-pack: the release hook (seed 000 §3.4.2).

When a re-packed Plan leaves stage sub-meshes unused, the training loop calls
``release(devices)`` once with their `jax.Device`s and records an ``event: "release"`` in
events.jsonl. JAX cannot shrink a running process's device set, so the devices stay visible to
the process, but dynjax never uses them again in this run; the hook is where a cluster learns
they are free (docs/parallelism.md): e.g. a Kubernetes PATCH that lowers the pod's GPU
request, as DynMo does with ECK, or a message to a SLURM-side agent. Set it with
``balance.release_hook="package.module:function"`` (or ``train(..., release_hook=fn)``).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from dynjax.errors import ConfigError

ReleaseHook = Callable[[Sequence[jax.Device]], None]
log = logging.getLogger("dynjax")


def load_release_hook(spec: str) -> ReleaseHook | None:
    """The function ``spec`` ("package.module:function") names; None for ""."""
    if not spec:
        return None
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"balance.release_hook={spec!r}: cannot import {module_name!r} ({e}); put the module "
            "on PYTHONPATH or fix the name"
        ) from e
    hook = getattr(module, attr, None)
    if not callable(hook):
        raise ConfigError(
            f"balance.release_hook={spec!r}: {module_name} has no function {attr!r}"
        )
    return hook


RELEASED_FILE = "DYNJAX_RELEASED_FILE"


def append_to_file(devices: Sequence[jax.Device]) -> None:
    """A release hook for a watcher outside the process (a node agent, the launch script):
    appends one JSON line with the job and the freed devices to ``$DYNJAX_RELEASED_FILE``
    (default ``released_devices.jsonl`` in the working directory)."""
    record = {
        "time": time.time(),
        "job": os.environ.get("SLURM_JOB_ID") or os.environ.get("HOSTNAME"),
        "devices": _describe(devices),
    }
    with open(os.environ.get(RELEASED_FILE, "released_devices.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def _describe(devices: Sequence[jax.Device]) -> list[dict[str, Any]]:
    return [{"id": d.id, "process": d.process_index, "kind": d.device_kind} for d in devices]


def release(
    devices: Sequence[jax.Device],
    stages: Sequence[int],
    hook: ReleaseHook | None,
    *,
    step: int,
    reason: str,
) -> dict[str, Any]:
    """Call ``hook`` with this process's ``devices`` (freed stage sub-meshes ``stages``);
    returns the ``release`` event, which names them all. Over several processes each process
    gives back its own devices (a process whose stages are all freed gives back all of its);
    one with none among them calls no hook. A failing hook is logged, not raised: training goes
    on without the devices either way."""
    own = [d for d in devices if d.process_index == jax.process_index()]
    hook = hook if own else None
    event: dict[str, Any] = {
        "event": "release",
        "step": step,
        "reason": reason,
        "stages": list(stages),
        "devices": _describe(devices),
        "hook": None if hook is None else getattr(hook, "__qualname__", repr(hook)),
    }
    start = time.perf_counter()
    if hook is not None:
        try:
            hook(own)
        except Exception as e:  # the run must not die for a scheduler's sake
            event["hook_error"] = f"{type(e).__name__}: {e}"
            log.warning("release hook %s failed: %s", event["hook"], e)
    event["hook_seconds"] = time.perf_counter() - start
    log.info("released stage sub-meshes %s (%d devices)", list(stages), len(devices))
    return event


SERVICE_ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
GPU_RESOURCE = "nvidia.com/gpu"


def pod_resource_patch(container: str, gpus: int) -> dict[str, Any]:
    """The strategic-merge patch that sets ``container``'s GPU request and limit to ``gpus``."""
    amount = {GPU_RESOURCE: str(gpus)}
    return {"spec": {"containers": [
        {"name": container, "resources": {"requests": amount, "limits": amount}}
    ]}}


def patch_pod_resources(devices: Sequence[jax.Device]) -> None:
    """A release hook for a pod of ``launch/k8s/job.yaml``: lowers this pod's GPU request by
    the local devices released, as DynMo does with ECK (seed 000 §3.4.2), through the API
    server with the pod's service-account token. Tries the ``pods/<name>/resize`` subresource
    (in-place resize) and falls back to patching the pod where the cluster has no such
    subresource (404). Whether a running pod's extended resource may change depends on the
    cluster (docs/parallelism.md); a refusal raises, which `release` records in the event.

    Reads ``POD_NAME``, ``POD_NAMESPACE`` and ``DYNJAX_CONTAINER`` (set by the manifest) and
    ``DYNJAX_K8S_API`` (default: the in-cluster ``https://$KUBERNETES_SERVICE_HOST:port``)."""
    import ssl
    import urllib.error
    import urllib.request

    env = os.environ
    pod, namespace = env.get("POD_NAME"), env.get("POD_NAMESPACE", "default")
    if not pod:
        raise RuntimeError("POD_NAME is not set: the manifest passes it from metadata.name")
    mine = [d for d in devices if d.process_index == jax.process_index()]
    gpus = max(len(jax.local_devices()) - len(mine), 0)
    body = json.dumps(pod_resource_patch(env.get("DYNJAX_CONTAINER", "train"), gpus)).encode()
    api = env.get("DYNJAX_K8S_API") or (
        f"https://{env['KUBERNETES_SERVICE_HOST']}:{env.get('KUBERNETES_SERVICE_PORT', '443')}"
    )
    account = env.get("DYNJAX_K8S_SERVICE_ACCOUNT", SERVICE_ACCOUNT)
    headers = {"Content-Type": "application/strategic-merge-patch+json"}
    token_file = os.path.join(account, "token")
    if os.path.exists(token_file):
        with open(token_file) as f:
            headers["Authorization"] = f"Bearer {f.read().strip()}"
    ca = os.path.join(account, "ca.crt")
    context = ssl.create_default_context(cafile=ca) if os.path.exists(ca) else None
    pod_url = f"{api}/api/v1/namespaces/{namespace}/pods/{pod}"
    for url in (f"{pod_url}/resize", pod_url):
        request = urllib.request.Request(url, data=body, headers=headers, method="PATCH")
        try:
            with urllib.request.urlopen(request, timeout=30, context=context) as response:
                log.info("patched %s: %s=%d (HTTP %d)", url, GPU_RESOURCE, gpus, response.status)
                return
        except urllib.error.HTTPError as e:
            if e.code != 404 or url == pod_url:
                raise RuntimeError(f"PATCH {url}: HTTP {e.code} {e.read()[:200]!r}") from e
