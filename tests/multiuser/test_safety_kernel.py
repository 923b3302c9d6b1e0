"""Shared-host safety in a REAL IPython kernel (jupyter_client) on a simulated fleet.

Another Unix user (``useradd``; CI runs as root) writes lease records into the shared registry;
this user's kernel then runs ``%gpu`` / ``%gpu pick`` and the test reads what the notebook would
show: the HTML of the status table (escaped), one-line ``UsageError``s for values past float
range, and a pick that says there are no GPUs when the fleet has none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from autogpu_jupyter.core.leasing import DirectoryStore
from tests.kernelhelpers import Kernel, kernel_env
from tests.leasehelpers import fleet
from tests.multiuser.test_safety import planted_lease

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
]

XSS = "<img src=x onerror=alert(document.domain)>.ipynb"
NINES = "9" * 400


@pytest.fixture(scope="module")
def host() -> Iterator[dict[str, Any]]:
    with planted_lease("autogpu-safety-k", 3, 1, XSS) as (fleet_path, registry):
        env = kernel_env(
            {
                "AUTOGPU_SIMULATE": str(fleet_path),
                "AUTOGPU_REGISTRY_DIR": str(registry),
                "JPY_SESSION_NAME": "notes/run\t1.ipynb",
            }
        )
        kernel = Kernel(env)
        try:
            assert kernel.run("%load_ext autogpu").status == "ok"
            yield {"kernel": kernel, "fleet": fleet_path, "registry": registry}
        finally:
            kernel.close()


def _usage_error(r: Any) -> str:
    assert r.status == "error" and r.error[0] == "UsageError", r
    return str(r.stderr.removeprefix("UsageError: ").rstrip("\n"))


def test_status_html_escapes_other_users_notebook_paths(host: dict[str, Any]) -> None:
    """Item 1: a held lease whose notebook path is an <img onerror> tag renders as text."""
    r = host["kernel"].run("%gpu")
    assert r.status == "ok", r
    (out,) = r.outputs
    html = out["content"]["data"]["text/html"]
    assert "<img" not in html
    assert (
        "agtest-bob: &lt;img src=x onerror=alert(document.domain)&gt;.ipynb (1.0 GiB booked)"
    ) in html


def test_values_past_float_range_are_one_line_errors(host: dict[str, Any]) -> None:
    """Item 7 in the notebook, and item 12's negative size and empty --max-util."""
    k = host["kernel"]
    assert _usage_error(k.run(f"%gpu pick --min-free {NINES}G")).startswith(
        f"invalid size '{'9' * 39}…99999999G': too large (at most 1 EiB)"
    )
    assert _usage_error(k.run("%gpu pick --min-free -5G")).startswith(
        "invalid size '-5G': must not be negative; expected a number with a unit"
    )
    assert _usage_error(k.run("%gpu pick --max-util ''")).startswith(
        "invalid --max-util '': empty; expected a number from 0 to 100"
    )
    r = k.run(
        "import autogpu_jupyter as ag\ntry:\n    ag.pick(min_free=10**400)\n"
        "except __import__('autogpu_jupyter.errors').errors.AutoGPUError as e:\n"
        "    print(type(e).__name__, e)"
    )
    assert r.stdout.startswith("OptionError invalid size 100000000000…: too large"), r
    assert k.env() == {"CUDA_VISIBLE_DEVICES": None, "CUDA_DEVICE_ORDER": None}


def test_a_tab_in_the_notebook_name_still_gives_a_readable_exclusive_lease(
    host: dict[str, Any],
) -> None:
    """Item 3a: ``JPY_SESSION_NAME`` with a TAB; the lease must be one that readers accept, so
    a second exclusive pick cannot take the same GPU."""
    k = host["kernel"]
    r = k.run("%gpu pick --exclusive")
    assert r.status == "ok", r
    try:
        leases = [x for x in DirectoryStore(host["registry"]).list_leases()
                  if x.uid == os.geteuid()]
        assert [(x.notebook_path, x.exclusive) for x in leases] == [("notes/run?1.ipynb", True)]
        mine = leases[0].device_uuids
        # Another exclusive pick (a second kernel) must go elsewhere or be refused.
        from autogpu_jupyter.core.backends.simulated import SimulatedBackend
        from autogpu_jupyter.core.options import PickOptions
        from autogpu_jupyter.core.picker import pick
        from autogpu_jupyter.core.policy import Constraints

        other = pick(
            PickOptions(Constraints(exclusive=True)),
            backend=SimulatedBackend(str(host["fleet"])),
            store=DirectoryStore(host["registry"]),
        )
        assert other.lease is not None
        assert other.lease.record.device_uuids != mine
        other.lease.release()
    finally:
        k.run("%gpu release")


def test_no_devices_while_holding_a_pick(host: dict[str, Any]) -> None:
    """Item 9: the GPUs vanish while the kernel holds a pick: ``%gpu`` still answers, and a
    pick says there is no GPU instead of listing nothing under "no device fits"."""
    k = host["kernel"]
    assert k.run("%gpu pick").status == "ok"
    fleet_path: Path = host["fleet"]
    try:
        fleet_path.write_text(json.dumps({"driver_version": "550.54.15", "devices": []}))
        r = k.run("%gpu")
        assert r.status == "ok", r
        (out,) = r.outputs
        assert "this kernel: ▶" in out["content"]["data"]["text/html"]
        assert _usage_error(k.run("%gpu pick")) == (
            "no GPU on this host: simulated lists no devices"
        )
    finally:
        fleet_path.write_text(json.dumps(fleet(3)))
        k.run("%gpu release")
