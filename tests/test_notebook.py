"""The quickstart notebook runs top to bottom, so it never goes stale."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # the real default model (train_and_serve trains it for 100 steps)

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def execute(name: str) -> tuple[nbformat.NotebookNode, str]:
    """Run a notebook top to bottom (a failing cell, assertions included, fails the test); its text output."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=1500, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb, "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def test_quickstart_notebook_executes():
    _, outputs = execute("quickstart.ipynb")
    assert "digit-seven" in outputs and "all-caps" in outputs
    assert "step" in outputs and "set_slot" in outputs  # the compile report table


def test_train_and_serve_notebook_executes():
    nb, outputs = execute("train_and_serve.ipynb")
    assert "step  99" in outputs  # the whole training loop ran
    assert "format learned: 4/4 valid JSON answers" in outputs
    assert "XLA compiles while serving the trained adapter: 0" in outputs
    assert "peft agrees: 4/4 greedy replies" in outputs
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the loss plot
