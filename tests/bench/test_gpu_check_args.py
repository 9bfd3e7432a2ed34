"""``bench/gpu_check.py``'s multi-GPU mode without GPUs: how ``--gpus N --trainer-gpus K`` splits the GPUs between the
trainer's ranks and the generators, and what it refuses (the run itself: ``test_gpu_check.py``, on CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("argv", "ranks", "trainer_visible", "generator_gpus", "generators"),
    [
        ([], 1, "0", ["0"], 1),  # one GPU: the generator shares it with the trainer
        (["--gpus", "4", "--trainer-gpus", "2"], 2, "0,1", ["2", "3"], 2),
        (["--gpus", "8"], 7, "0,1,2,3,4,5,6", ["7"], 1),  # default: all but one GPU train
        (["--gpus", "2", "--trainer-gpus", "2", "--shard-base"], 2, "0,1", ["0"], 1),
        (["--gpus", "3", "--trainer-gpus", "1", "--generators", "4"], 1, "0", ["1", "2"], 4),
    ],
)
def test_gpus_split_between_trainer_ranks_and_generators(
    gpu_check: ModuleType, argv: list[str], ranks: int, trainer_visible: str, generator_gpus: list[str], generators: int
) -> None:
    args = gpu_check.parse_args(argv)
    assert gpu_check.trainer_ranks(args) == ranks and args.generators == generators
    assert gpu_check.gpu_plan(args) == (trainer_visible, generator_gpus)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "2", "--trainer-gpus", "3"], "--trainer-gpus must be between 1 and --gpus (2)"),
        (["--shard-base"], "--shard-base shards the base across trainer ranks"),
        (["--device", "cpu", "--shard-base"], "--shard-base shards the base across trainer ranks"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(
    gpu_check: ModuleType, argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_cpu_ranks_can_shard(gpu_check: ModuleType) -> None:
    args = gpu_check.parse_args(["--device", "cpu", "--trainer-procs", "2", "--shard-base"])
    assert gpu_check.trainer_ranks(args) == 2 and args.shard_base
