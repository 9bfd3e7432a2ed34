"""The images' locks (services/locks/), checked without building anything: each covers what pyproject.toml
asks of its image and each Dockerfile installs from its own lock. (test_images checks the built images match.)"""

from __future__ import annotations

import tomllib

import pytest
from packaging.requirements import Requirement

from tests.containers import podman

EXTRA = {"proxy": "proxy", "trainer": "trainer", "generator": "generator"}


@pytest.mark.parametrize("image", podman.SERVICE_IMAGES, ids=lambda i: i.name)
def test_lock_pins_every_dependency_pyproject_names_for_the_image(image: podman.ServiceImage) -> None:
    project = tomllib.loads((podman.ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"][EXTRA[image.name]]]
    lock = podman.parse_pins((podman.LOCKS / image.lock).read_text())
    missing = [
        req
        for req in wanted
        if podman.canonical(Requirement(req).name) not in podman.UNLOCKED
        and podman.canonical(Requirement(req).name) not in lock
    ]
    assert not missing, f"services/locks/{image.lock} does not pin {missing}: run `make lock`"
    for name, version in lock.items():
        spec = next((Requirement(r) for r in wanted if podman.canonical(Requirement(r).name) == name), None)
        assert spec is None or spec.specifier.contains(version, prereleases=True), (
            f"services/locks/{image.lock} pins {name}=={version}, outside pyproject's {spec}: relock"
        )


@pytest.mark.parametrize("image", podman.SERVICE_IMAGES, ids=lambda i: i.name)
def test_dockerfile_installs_from_its_lock(image: podman.ServiceImage) -> None:
    text = (podman.ROOT / image.dockerfile).read_text()
    assert f"COPY services/locks/{image.lock} /opt/lock.txt" in text
    assert "-r /opt/lock.txt" in text and "-c /opt/lock.txt" in text
