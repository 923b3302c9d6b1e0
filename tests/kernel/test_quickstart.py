"""``notebooks/quickstart.ipynb`` runs top to bottom, with no error, on the simulated fleet.

Executed with nbclient in a real kernel, as CI does (``AUTOGPU_SIMULATE=demo-4x``).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from autogpu_jupyter.core.backends.simulated import builtin_fleet
from tests.kernelhelpers import REPO, kernel_env

NOTEBOOK = REPO / "notebooks" / "quickstart.ipynb"


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", "") + out["data"].get("text/html", ""))
    return "".join(parts)


def test_quickstart_runs_on_the_simulated_fleet(tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = kernel_env(
        {"AUTOGPU_SIMULATE": "demo-4x", "AUTOGPU_REGISTRY_DIR": str(tmp_path / "registry")}
    )
    client = NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}
    )
    client.execute(env=env)  # raises CellExecutionError on any error

    code = {c.source.splitlines()[0]: c for c in nb.cells if c.cell_type == "code"}
    uuids = [d["uuid"] for d in builtin_fleet("demo-4x")["devices"]]
    assert "SIMULATED fleet (AUTOGPU_SIMULATE=demo-4x)" in _text(code["%gpu status"])
    picked = _text(code["%gpu pick --min-free 10G"])
    assert picked.startswith("autogpu [SIMULATED]: picked GPU ")
    assert "  asked: min free 10.0 GiB · runner-up GPU " in picked
    chosen = picked.split("CUDA_VISIBLE_DEVICES=")[1].split()[0]
    assert chosen in uuids
    assert _text(code["import os"]) == repr((chosen, "PCI_BUS_ID"))
    assert _text(code["%gpu pick --dry-run --min-free 30G --max-util 50"]).startswith(
        "autogpu [SIMULATED] dry run (min free 30.0 GiB, max util 50%): nothing changed"
    )
    report = _text(code["%%gpu --min-free 10G"])
    assert "autogpu [SIMULATED] %%gpu on GPU " in report and " · mean utilisation " in report
    assert "2666646666700000" in report  # the cell's value, displayed as usual
    assert "▶" in _text(code["import autogpu_jupyter as ag"])
    assert _text(code["%gpu release"]).startswith("autogpu: released GPU ")
