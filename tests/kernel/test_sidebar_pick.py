"""The sidebar's pick and the "Python 3 (autogpu)" kernel's texts in a REAL kernel (jupyter_client)
over the fake NVML library: the words a user reads, with no IPython message they did not ask for.

The kernel loads the extension at start as the autogpu kernelspec does (``--ext=autogpu_jupyter``,
here through its profile: the same extension list), then the notebook's own ``%load_ext autogpu``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.fakenvml import FakeNvml, fleet_4x
from tests.kernelhelpers import Kernel, kernel_env

MIME = "application/vnd.autogpu.pick+json"
U = [d["uuid"] for d in fleet_4x()["devices"]]
GiB = 1024**3


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Kernel, FakeNvml]]:
    base = tmp_path_factory.mktemp("sidebar-pick-kernel")
    fake = FakeNvml(base / "nvml")
    fake.write(fleet_4x())
    profile = base / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    # what the autogpu kernelspec's --ext=autogpu_jupyter does
    (profile / "ipython_config.py").write_text(
        "c.InteractiveShellApp.extensions = ['autogpu_jupyter']\n")
    env = kernel_env({**fake.env, "AUTOGPU_REGISTRY_DIR": str(base / "registry"),
                      "IPYTHONDIR": str(base / "ipython")})
    k = Kernel(env)
    try:
        yield k, fake
    finally:
        k.close()


def _answer(run: Any) -> dict[str, Any]:
    (data,) = [o["content"]["data"] for o in run.outputs if MIME in o["content"]["data"]]
    return data[MIME]  # type: ignore[no-any-return]


def test_load_ext_in_a_kernel_that_loaded_autogpu_says_nothing(
    kernel: tuple[Kernel, FakeNvml],
) -> None:
    k, _ = kernel
    r = k.run("%load_ext autogpu")
    assert (r.status, r.stdout, r.stderr, r.outputs) == ("ok", "", "", [])


def test_the_sidebar_pick_in_the_kernel_answers_in_one_line_and_leaves_the_warning(
    kernel: tuple[Kernel, FakeNvml],
) -> None:
    """GPU 1 is full because of another process: the pick is the user's choice (it succeeds),
    its answer goes to the sidebar only, and the overload warning is printed under the next cell
    of the notebook, naming a better GPU (the pick's exclusion of every other GPU is no part
    of that question)."""
    k, fake = kernel
    busy = fleet_4x()
    busy["devices"][1]["memory_used"] = busy["devices"][1]["memory_total"] - GiB
    busy["devices"][1]["processes"] = [{"pid": 1_000_001, "used_memory": 70 * GiB}]
    fake.write(busy)
    r = k.run(f'__import__("autogpu_jupyter.magics", fromlist=["sidebar_pick"])'
              f'.sidebar_pick("{U[1]}")')
    assert r.status == "ok" and r.stdout == "" and r.stderr == "", r
    pick = _answer(r)
    assert pick["ok"] is True
    assert pick["summary"].startswith("autogpu: picked GPU 1 · NVIDIA A100-SXM4-80GB · ")
    for never in ("already loaded", "--exclude", "--wait", "asked:"):
        assert never not in pick["summary"] + pick["details"]
    # the sampler the pick started saw the overload: the notebook's next cell says so (the
    # sidebar's own request did not swallow it)
    r = k.run("1 + 1")
    assert r.stdout.startswith("autogpu: GPU 1 (this kernel's GPU) is overloaded: memory "), r
    assert "Best alternative: move to GPU 0 (" in r.stdout, r.stdout
    assert "no better device" not in r.stdout
    r = k.run("%gpu status")
    assert r.texts()[0].splitlines()[-1] == "this kernel: ▶ GPU 1 (picked from the sidebar)"
    k.run("%gpu release")
    fake.write(fleet_4x())
