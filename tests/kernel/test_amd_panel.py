"""The panel and its overload warning on an AMD fleet, in a real kernel (nbclient) on the
simulated ``demo-amd`` (``demo-4x``'s load pattern on AMD Instinct GPUs): the notebook sits on
the busy GPU 1 on purpose, through ``set_visible_devices`` (so through ROCm's variables), as
``notebooks/panel.ipynb`` does on NVIDIA."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from tests.kernelhelpers import REPO, kernel_env

CELLS = [
    "import os\nimport autogpu_jupyter as ag\nag.set_visible_devices([1])\n"
    "print(os.environ['ROCR_VISIBLE_DEVICES'], os.environ['HIP_VISIBLE_DEVICES'])",
    "from autogpu_jupyter import Panel\npanel = Panel(window_s=60)\npanel",
    'print("\\n".join(w.message() for w in panel.warnings) or "no overload")',
]


def _text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def test_the_panel_warns_of_the_overload_on_an_amd_fleet(tmp_path: Path) -> None:
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    env = kernel_env({"AUTOGPU_SIMULATE": "demo-amd",
                      "AUTOGPU_REGISTRY_DIR": str(tmp_path / "registry")})
    client = NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO)}})
    client.execute(env=env)
    assert _text(nb.cells[0]).split() == ["GPU-4d0a3d0000000001", "0"]
    warning = _text(nb.cells[-1])
    assert warning.startswith("autogpu: GPU 1 (this kernel's GPU) is overloaded: "), warning
    assert "caused by 1 other process holding " in warning and "(user bob)" in warning
    # demo-amd's other GPUs take turns being the least loaded: any but GPU 1 (and its twin 5)
    assert re.search(r"Best alternative: move to GPU [023467] \(\d", warning), warning
