from __future__ import annotations

from pathlib import Path

import pytest

from tests.generator.helpers import make_adapter


@pytest.fixture(scope="session")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(tiny_model_dir, tmp_path_factory.mktemp("adapter") / "v1", seed=1)
