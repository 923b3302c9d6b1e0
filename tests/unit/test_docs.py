"""The documentation follows the code: the configuration reference lists every trait with its
default and environment variable, and the README stays a user's page whose links lead somewhere."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference",
                                                  ROOT / "scripts" / "config_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_reference_is_up_to_date() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert _reference().render(page) == page, (
        "docs/configuration.md is out of date: run scripts/config_reference.py --write")


def _wire_schema() -> ModuleType:
    spec = importlib.util.spec_from_file_location("wire_schema",
                                                  ROOT / "scripts" / "wire_schema.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_sidebars_wire_types_and_the_rest_page_follow_the_schema() -> None:
    """labextension/src/schema.ts and docs/rest.md's field tables are generated from
    autogpu_jupyter/server/schema.py: a field added, renamed or retyped there fails here until
    both follow (and the TypeScript compiler then checks the sidebar against schema.ts)."""
    wire = _wire_schema()
    ts = (ROOT / "labextension" / "src" / "schema.ts").read_text()
    assert wire.typescript() == ts, (
        "labextension/src/schema.ts is out of date: run scripts/wire_schema.py --write")
    page = (ROOT / "docs" / "rest.md").read_text()
    assert wire.render(page) == page, (
        "docs/rest.md is out of date: run scripts/wire_schema.py --write")
    for endpoint in ("GET devices", "GET holders", "DELETE kernels/<kernel_id>/move"):
        assert f"| `{endpoint}` |" in page, endpoint  # the hand-written table keeps its rows


def test_every_trait_is_in_the_configuration_reference() -> None:
    from autogpu_jupyter.config import AutoGPU
    from autogpu_jupyter.server.state import AutoGPUServer

    page = (ROOT / "docs" / "configuration.md").read_text()
    for cls in (AutoGPU, AutoGPUServer):
        for name in cls.class_traits(config=True):
            assert f"| `c.{cls.__name__}.{name}` |" in page, name
    # the environment variables the code reads are named
    for var in ("AUTOGPU_MIN_FREE", "AUTOGPU_REGISTRY_DIR", "AUTOGPU_BROKER_SOCKET",
                "AUTOGPU_SAMPLE_INTERVAL", "AUTOGPU_PROMETHEUS_URL"):
        assert f"`{var}`" in page, var


def test_the_readme_is_a_users_page_whose_links_lead_somewhere() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 170
    for heading in ("## Install", "## What you will see", "## Your first hour",
                    "## On JupyterHub", "## Read more"):
        assert heading in readme, heading
    # what moved to docs/ is not in it
    for gone in ("| endpoint |", "GET holders", '"devices": [', "c.AutoGPUServer.interval_s"):
        assert gone not in readme, gone
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name}: broken link {target}"


#: A file path as the docs cite one: at least one folder, then a file with a known suffix or a
#: folder ending in "/" (``core/leasing/safefs.py``, ``labextension/src/schema.ts``,
#: ``tests/multiuser/``); not inside a URL, an absolute path or an endpoint's ``<id>``.
_CITED = re.compile(
    r"(?<![\w./<>:~-])((?:[\w.-]+/)+(?:[\w.-]*\.(?:py|md|ts|toml|json|js|mjs|c|sh|txt|cfg|ya?ml"
    r"|ipynb|service|css)|[\w.-]+/))(?![\w/-])"
)
#: Where a cited path may be read from: the repository, the package, the sidebar's folder.
_BASES = ("", "autogpu_jupyter", "labextension")
#: Paths the docs cite that are not files of this repository, each with whose they are.
_NOT_OURS = {
    "torch/cuda/__init__.py": "PyTorch's source (docs/internals.md, ROCm visibility)",
    "libhsakmt/src/openclose.c": "ROCm's source (docs/internals.md, HIP's too-late check)",
    "jupyterlab_nvdashboard/apps/gpu.py": "jupyterlab-nvdashboard's source (docs/benchmarks.md)",
    "jupyterlab_nvdashboard/apps/utils.py": "jupyterlab-nvdashboard's source (docs/benchmarks.md)",
    "share/jupyter/kernels/python3-autogpu/kernel.json": "under an install prefix",
}


def _made_by_commands() -> tuple[str, ...]:
    """The folders .gitignore names (what make, jlpm, mutmut and the benchmarks write)."""
    lines = (ROOT / ".gitignore").read_text().splitlines()
    return tuple(ln.strip("/") + "/" for ln in lines if ln.endswith("/") and "*" not in ln)


def _missing_paths(text: str) -> list[str]:
    made = _made_by_commands()
    return [
        path for path in _CITED.findall(text)
        if path not in _NOT_OURS and not path.startswith(made)
        and not any((ROOT / base / path).exists() for base in _BASES)
    ]


def test_every_file_path_the_docs_cite_exists() -> None:
    """A path in README.md, CONTRIBUTING.md or docs/*.md names a file or folder of the
    repository (read from its root, the package or labextension/), something a command here
    makes (a folder .gitignore names), or another project's file named as such. Caught (issue
    42): pages that still cite a module after it moved into a package."""
    assert _missing_paths("see `core/cluster.py` and `core/leasing/safefs.py`") == [
        "core/cluster.py"
    ]
    assert _missing_paths("`mutants/sample.txt`, `tests/multiuser/`, `src/model.ts`") == []
    for page in [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")]:
        assert _missing_paths(page.read_text()) == [], page.name
