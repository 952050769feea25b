"""The notebooks in notebooks/: committed without outputs, and each runs end to end on a CPU
with tiny sizes injected after its `parameters` cell (as papermill does)."""

import json
import os
import sys

import pytest

from .helpers import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

TINY_MODEL = dict(
    NUM_LAYERS=2, D_MODEL=32, NUM_HEADS=2, MLP_DIM=64, BATCH_SIZE=8, SEQ_LEN=32, LOG_EVERY=2
)
# Sizes CI runs with, per notebook: every name must be one its parameter cell sets.
TINY = {
    "quickstart": dict(
        TINY_MODEL,
        STEPS=40,
        MOE_EVERY=1,
        NUM_EXPERTS=4,
        TOP_K=2,
        EXPERT_MLP_DIM=64,
        CAPACITY_WINDOW=4,
        EVAL_EVERY=20,
        DTYPE="float32",  # what its parameter cell says to set on a CPU (the default: bf16)
    ),
    "dynamic_pipeline": dict(
        TINY_MODEL,
        STEPS=40,
        NUM_LAYERS=4,
        STAGES=2,
        DATA=1,
        FREEZE_EVERY=5,
        FREEZE_START=5,
        FREEZE_PERCENTILE=100.0,
        PROFILE_EVERY=10,
        BALANCE_EVERY=10,
    ),
}


def test_every_notebook_has_tiny_settings():
    assert NOTEBOOKS, "no notebooks found"
    assert sorted(p.stem for p in NOTEBOOKS) == sorted(TINY)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_notebooks_have_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    dirty = [
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)
    ]
    assert not dirty, (
        f"{path.name}: code cells {dirty} hold outputs or execution counts; strip them before "
        "committing (Jupyter: Edit > Clear Outputs of All Cells, then save; or "
        "`jupyter nbconvert --clear-output --inplace notebooks/*.ipynb`)"
    )
    [params] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert nb.cells.index(params) < 4, "the parameter cell belongs at the top"
    namespace = {}
    exec(params.source, {}, namespace)  # plain assignments
    assert set(TINY[path.stem]) <= set(namespace), set(TINY[path.stem]) - set(namespace)


def inject_parameters(nb, values):
    """A cell tagged `injected-parameters` after the `parameters` cell, as papermill writes it."""
    [params] = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    source = "# Parameters injected by tests/test_notebooks.py\n" + "".join(
        f"{name} = {value!r}\n" for name, value in values.items()
    )
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    cell.id = "injected-parameters"
    nb.cells.insert(nb.cells.index(params) + 1, cell)


def kernel_manager(tmp_path):
    """A kernel that runs this interpreter (whatever kernels the machine has registered),
    connected over Unix sockets in ``tmp_path``: TCP ports chosen free, then bound by the
    kernel, collided once between two notebook tests running side by side."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    spec = tmp_path / "kernels" / "dynjax-test"
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "dynjax test", "language": "python"})
    )
    specs = KernelSpecManager(kernel_dirs=[str(spec.parent)])
    return AsyncKernelManager(
        kernel_name="dynjax-test",
        kernel_spec_manager=specs,
        transport="ipc",
        ip=str(tmp_path / "kernel"),
    )


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_tiny_settings(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, TINY[path.stem])
    run_dir = tmp_path / "cwd"
    run_dir.mkdir()
    # The kernel imports this checkout, and sets up its own devices: without the 8 fake CPU
    # devices conftest.py gives the tests (the pipeline notebook fakes what it needs itself).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        MPLBACKEND="module://matplotlib_inline.backend_inline",
        IPYTHONDIR=str(tmp_path / "ipython"),
    )
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        km=kernel_manager(tmp_path),
        resources={"metadata": {"path": str(run_dir)}},
    )
    client.execute(env=env)
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if "image/png" in o.get("data", {})
    ]
    assert len(images) >= 3, "the notebook drew fewer figures than it should"
    assert (run_dir / "runs").is_dir(), "the run's workdir is not under the notebook's cwd"
