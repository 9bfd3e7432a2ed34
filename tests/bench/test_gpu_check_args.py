"""``bench/gpu_check.py``'s multi-GPU mode without GPUs: how ``--gpus N --trainer-gpus K`` splits the GPUs between the
trainer's ranks and the generators, what it refuses, and how it reads peak GPU memory from nvidia-smi (a stand-in
``nvidia-smi`` script; the run itself: ``test_gpu_check.py``, on CPU)."""

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


def fake_nvidia_smi(bin_dir: Path, apps: list[str], used: list[str]) -> None:
    """An ``nvidia-smi`` that answers the two queries GpuMemory makes; ``used`` is one reading per poll."""
    bin_dir.mkdir()
    (bin_dir / "polls").write_text("0")
    script = bin_dir / "nvidia-smi"
    script.write_text(
        "#!/bin/sh\n"
        f'd="{bin_dir}"\n'
        'case "$1" in\n'
        f"  --query-compute-apps=*) printf '{''.join(a + chr(92) + 'n' for a in apps)}' ;;\n"
        '  --query-gpu=*) n=$(cat "$d/polls"); echo $((n + 1)) > "$d/polls"\n'
        + "".join(f"    [ \"$n\" = {i} ] && echo '{u}'\n" for i, u in enumerate(used))
        + "    true ;;\n"
        "esac\n"
    )
    script.chmod(0o755)


def test_gpu_memory_per_process_and_per_device(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path / "bin", ["101, 2048", "202, [N/A]"], ["500", "4596", "2548"])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    memory = gpu_check.GpuMemory()
    assert memory.available
    for _ in range(3):
        memory.poll()
    # 500 MiB in use before the run (baseline), 4596 at peak: 4 GiB grown; one process row readable (2 GiB).
    assert memory.figures() == {"gpu_peak_gib_total": 2.0, "gpu_peak_gib_device": 4.0}
    assert memory.peak_mib == {101: 2048.0}


def test_gpu_memory_when_the_sandbox_hides_processes(
    gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_nvidia_smi(tmp_path / "bin", [], ["0", "1024"])
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:/usr/bin:/bin")
    memory = gpu_check.GpuMemory()
    memory.poll()
    memory.poll()
    # No process row at all: said so (None), not reported as 0 GiB; the device figure still comes.
    assert memory.figures() == {"gpu_peak_gib_total": None, "gpu_peak_gib_device": 1.0}


def test_gpu_memory_without_nvidia_smi(gpu_check: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    memory = gpu_check.GpuMemory()
    memory.start()
    memory.halt.set()
    memory.join(5)
    assert not memory.available and memory.figures() == {"gpu_peak_gib_total": None, "gpu_peak_gib_device": None}
