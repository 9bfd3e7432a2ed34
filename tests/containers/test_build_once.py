"""The images are built once per run however the container modules land on the workers: two sessions calling
``build_all`` at once take turns (the second then finds the images carrying the tree's build key). Checked without
podman: the build steps are replaced by ones that note when they run, since the real ones take minutes to an hour
on a cold image store."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.containers import podman


def test_two_sessions_building_at_once_take_turns(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(podman, "STATE", tmp_path)
    spans: list[tuple[float, float]] = []
    started: dict[int, float] = {}

    def standins() -> dict[str, float]:
        started[threading.get_ident()] = time.monotonic()
        time.sleep(0.3)
        return {}

    def context() -> Path:
        time.sleep(0.3)  # a second session's copy would delete this one's context mid-build
        return tmp_path

    def service(image: podman.ServiceImage, ctx: Path) -> float:
        if image is podman.SERVICE_IMAGES[-1]:
            spans.append((started[threading.get_ident()], time.monotonic()))
        return 0.0

    monkeypatch.setattr(podman, "build_standins", standins)
    monkeypatch.setattr(podman, "build_context", context)
    monkeypatch.setattr(podman, "build_service", service)
    sessions = [threading.Thread(target=podman.build_all) for _ in range(2)]
    for t in sessions:
        t.start()
    for t in sessions:
        t.join(30)
    assert len(spans) == 2, spans
    first, second = sorted(spans)
    assert second[0] >= first[1], f"two builds overlapped: {spans}"
