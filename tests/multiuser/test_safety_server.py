"""Shared-host safety of the server extension, over a real Jupyter server (``jp_fetch``).

The registry is a shared one (``/var/tmp``, mode 1777) into which a real second Unix user plants
names and records; the server runs as root, as on a JupyterHub host's admin account. Bodies that
are huge or deeply nested, numbers past float range, ``%`` in messages and Jupyter's own
``token`` parameter each get one clear answer, never a 500.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tornado.httpclient

from tests.leasehelpers import AsUser, as_user, ensure_user, shared_area
from tests.multiuser.test_safety import _mkdir, _plant_record
from tests.server.test_rest import UUID1, fleet, get_json, jp_server_config  # noqa: F401 (fixtures)

pytestmark = [
    pytest.mark.multiuser,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create the test users"),
]


@pytest.fixture
def registry_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A registry every test user can reach (overrides conftest's private one)."""
    with shared_area("autogpu-safety-srv") as root:
        path = root / "registry"
        monkeypatch.setenv("AUTOGPU_REGISTRY_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def bob() -> tuple[int, int]:
    return ensure_user("agtest-bob")


async def _error(jp_fetch: Any, *parts: str, **kwargs: Any) -> tuple[int, str]:
    with pytest.raises(tornado.httpclient.HTTPClientError) as err:
        await jp_fetch("autogpu", *parts, **kwargs)
    assert err.value.response is not None
    assert err.value.response.headers["Content-Type"] == "application/json"
    return err.value.code, json.loads(err.value.response.body)["message"]


async def test_huge_or_deeply_nested_bodies_are_400(jp_fetch: Any) -> None:
    """Item 8: 100k ``[`` (and a body just under the size cap but nested too deeply)."""
    for path in (("select",), ("kernels", "0" * 8, "move")):
        code, msg = await _error(jp_fetch, *path, method="POST", body="[" * 100_000)
        assert (code, msg) == (
            400,
            "request body too large (100000 bytes, at most 65536); expected a small JSON object "
            + (
                'such as {"min_free": "10G"}'
                if path == ("select",)
                else 'such as {"target": "best"} or {"target": "2"}'
            ),
        )
        code, msg = await _error(jp_fetch, *path, method="POST", body="[" * 60_000)
        assert code == 400 and msg.startswith("request body nested too deeply"), msg


async def test_numbers_percent_and_token(jp_fetch: Any, jp_serverapp: Any) -> None:
    """Items 7 and 12: a 400-digit size, a ``%`` in the message, ``?token=`` on a GET."""
    code, msg = await _error(jp_fetch, "select", params={"min_free": "9" * 400 + "G"})
    assert code == 400
    assert msg.startswith(f"invalid size '{'9' * 39}…99999999G': too large (at most 1 EiB)")
    code, msg = await _error(jp_fetch, "select", params={"min_free": "200%"})
    assert (code, msg) == (
        400,
        "invalid size '200%': a share must be 0-100%; expected a number with a unit, e.g. 10G, "
        "10GiB, 512M, 0.5T, 16GB (decimal), or a share of the device like 25%",
    )
    token = jp_serverapp.identity_provider.token
    data = await get_json(jp_fetch, "select", params={"min_free": "1G", "token": token})
    assert [d["uuid"] for d in data["chosen"]] == [UUID1]


async def test_planted_names_do_not_break_the_endpoints(
    jp_fetch: Any, registry_dir: Path, bob: tuple[int, int]
) -> None:
    """Item 2 through the server: holders, select and move answered 500 after ``mkdir ¹``."""
    from autogpu_jupyter.core.leasing import DirectoryStore

    DirectoryStore(registry_dir).check()
    as_user(*bob, _mkdir, str(registry_dir / "¹"))
    holders = await get_json(jp_fetch, "holders")
    assert holders["errors"] == []
    assert [d["uuid"] for d in (await get_json(jp_fetch, "select"))["chosen"]] == [UUID1]
    code, msg = await _error(
        jp_fetch,
        "kernels",
        "no-such-kernel",
        "move",
        method="POST",
        body=json.dumps({"target": "best"}),
    )
    assert (code, msg) == (404, "no kernel 'no-such-kernel' on this server")


async def test_a_forged_lease_with_our_kernel_id_is_not_this_servers(
    jp_fetch: Any, registry_dir: Path, bob: tuple[int, int]
) -> None:
    """Item 11: another user's lease that names one of this server's kernels."""
    from autogpu_jupyter.core.leasing import DirectoryStore

    DirectoryStore(registry_dir).check()
    response = await jp_fetch(
        "api",
        "sessions",
        method="POST",
        body=json.dumps(
            {
                "path": "mine.ipynb",
                "type": "notebook",
                "name": "mine.ipynb",
                "kernel": {"name": "python3"},
            }
        ),
    )
    session = json.loads(response.body)
    kid = session["kernel"]["id"]
    forger = AsUser(
        *bob,
        _plant_record,
        str(registry_dir),
        "lease",
        {"kernel_id": kid, "device_uuids": [UUID1], "notebook_path": "forged.ipynb"},
        hold=True,
    )
    try:
        forger.result()
        data = await get_json(jp_fetch, "holders")
        (lease,) = [h for h in data["holders"] if h["kind"] == "lease"]
        assert (
            lease["user"],
            lease["kernel_id"],
            lease["this_server"],
            lease["notebook_path"],
        ) == ("agtest-bob", kid, False, "forged.ipynb")
    finally:
        forger.stop()
        await jp_fetch("api", "sessions", session["id"], method="DELETE")
