"""core.session: this process's choice, and the environment it narrows and gives back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from autogpu_jupyter.core import session
from autogpu_jupyter.core.backends.simulated import SimulatedBackend
from autogpu_jupyter.core.options import PickOptions
from autogpu_jupyter.core.picker import pick
from autogpu_jupyter.core.policy import Constraints
from tests.leasehelpers import fleet, uuid_of


@pytest.fixture
def backend(tmp_path: Path) -> SimulatedBackend:
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(fleet(4)))
    return SimulatedBackend(str(path))


@pytest.fixture
def environ() -> Iterator[dict[str, str]]:
    """A kernel environment that its scheduler granted GPUs 1 and 2; the choice is dropped after."""
    env = {"CUDA_VISIBLE_DEVICES": "1,2"}
    yield env
    session.release(environ=env)


def test_a_second_pick_keeps_the_allocation_from_before_the_first(
    backend: SimulatedBackend, environ: dict[str, str]
) -> None:
    first = pick(PickOptions(Constraints()), backend=backend, environ=environ)
    session.apply(first, environ=environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": uuid_of(1), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    # A re-pick narrows within what the scheduler granted, not within the first pick.
    again = pick(
        PickOptions(Constraints.parse(exclude="1")),
        backend=backend,
        environ=session.original_environ(environ),
    )
    session.apply(again, environ=environ)
    assert environ == {"CUDA_VISIBLE_DEVICES": uuid_of(2), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert session.original_environ(environ) == {"CUDA_VISIBLE_DEVICES": "1,2"}
    assert session.release(environ=environ) is not None
    assert environ == {"CUDA_VISIBLE_DEVICES": "1,2"}
