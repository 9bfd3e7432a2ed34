"""Fixtures of the container tests: the images, built once per session (podman's store caches them per machine).

When this machine cannot run podman at all (not installed, no root, no Debian mirror), every test here FAILS with
the reason in capitals: CI must never pass these silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.containers import podman


@pytest.fixture(scope="session")
def built_images() -> Iterator[dict[str, float]]:
    """Every image the tests need, with the seconds each build took (about 0 when podman's cache had it)."""
    if os.geteuid() != 0:
        pytest.fail("CONTAINER TESTS CANNOT RUN: podman here needs root (CI runs as root)", pytrace=False)
    try:
        podman.check_podman_runs()
    except podman.PodmanUnavailable as exc:
        pytest.fail(f"CONTAINER TESTS CANNOT RUN ON THIS MACHINE: {exc}", pytrace=False)
    yield podman.build_all()
