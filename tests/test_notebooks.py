"""The notebooks run top to bottom in a real Jupyter kernel (nbclient + ipykernel), and are
committed without outputs."""

import json
import pathlib
import sys

import nbformat
import pytest
from ipykernel.kernelspec import write_kernel_spec
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300  # per cell; each one takes seconds on a CPU, the first jit included
KERNEL = "kivi-jax-test"


def _kernel_manager(spec_dir: pathlib.Path) -> KernelManager:
    """A kernel on this interpreter (the venv with kivi_jax installed), from a spec written for
    this test only: a `python3` spec elsewhere on the Jupyter path (the one the ipykernel wheel
    ships runs `python` from PATH; a user's may name another environment) cannot take its place."""
    write_kernel_spec(spec_dir / KERNEL)
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir)])
    assert ksm.get_kernel_spec(KERNEL).argv[0] == sys.executable
    return KernelManager(kernel_name=KERNEL, kernel_spec_manager=ksm)


def _stdout(nb) -> str:
    return "".join(
        out["text"]
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
        if out["output_type"] == "stream" and out["name"] == "stdout"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    committed = path.read_bytes()
    nb = nbformat.read(path, as_version=4)  # executed in memory, never written back
    client = NotebookClient(
        nb,
        km=_kernel_manager(tmp_path),
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(path.parent)}},  # cwd, as Jupyter opens it
    )
    client.execute()  # a cell that raises fails the test (CellExecutionError)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.execution_count is not None for c in code)
    assert "relative error" in _stdout(nb)
    assert path.read_bytes() == committed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_committed_without_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [
        i
        for i, cell in enumerate(nb["cells"])
        if cell["cell_type"] == "code"
        and (cell.get("outputs") or cell.get("execution_count") is not None)
    ]
    assert dirty == [], f"{path.name}: code cells {dirty} carry outputs or execution counts"


def test_there_are_notebooks():
    assert NOTEBOOKS
