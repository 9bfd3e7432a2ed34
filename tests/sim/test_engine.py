"""The simulated engine's contract: its timing model, the shapes and values it returns, its adapter rules.

A fake clock makes the timing checks exact (no wall-clock assertion): the engine must spend precisely the
time the GPU model gives for the call it sampled, handing control to ``while_running`` every POLL_S.
"""

from __future__ import annotations

import itertools
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bucketrl import errors
from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.submit import well_formed
from bucketrl.sim.engine import POLL_S, SimEngine, register
from bucketrl.sim.gpu import SimGpu, simulate_call
from bucketrl.wire import Completion, RolloutBatch, RolloutGroup, RunSpec

VOCAB = 500


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s > 0
        self.slept.append(s)
        self.now += s


def _spec(max_new_tokens: int = 64, max_staleness: int = 2) -> RunSpec:
    return RunSpec.model_validate(
        {
            "base_model": "sim/no-model",
            "group_size": 4,
            "max_staleness": max_staleness,
            "sampling": {"max_new_tokens": max_new_tokens},
            "reward": {"name": "toy"},
            "dataset": {"uri": "toy:sim", "size": 100},
            "vocab_size": VOCAB,
        }
    )


def _engine(clock: FakeClock, gpu: SimGpu | None = None, **spec_kw: int) -> SimEngine:
    settings = GeneratorSettings(engine="sim", seed=7)
    return SimEngine(settings=settings, spec=_spec(**spec_kw), gpu=gpu, sleep=clock.sleep, clock=clock)


def _adapter_dir(tmp_path: Path, name: str = "v1") -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text("{}")
    return d


def test_call_time_is_prefill_plus_batched_decode_until_the_longest_completion(tmp_path: Path) -> None:
    gpu = SimGpu(prefill_tokens_per_s=1000, decode_step_s=0.01, decode_step_per_seq_s=0.001, load_adapter_s=0.25)
    clock = FakeClock()
    eng = _engine(clock, gpu, max_new_tokens=200)
    eng.load_adapter("run-v1", 1, _adapter_dir(tmp_path))
    assert clock.now - 100.0 == pytest.approx(0.25)  # the load takes load_adapter_s
    start = clock.now
    hooks: list[float] = []
    out = eng.generate(
        [[1] * 30, [2] * 50],
        adapter="run-v1",
        n=4,
        sampling=_spec(200).sampling,
        while_running=lambda: hooks.append(clock.now),
    )
    lengths = [len(s.token_ids) for group in out for s in group]
    expected = 80 / 1000 + max(lengths) * 0.01 + sum(lengths) * 0.001
    assert clock.now - start == pytest.approx(expected, rel=1e-9)
    assert gpu.call_seconds([30, 50], [[len(s.token_ids) for s in g] for g in out]) == pytest.approx(expected)
    # control comes back at the start and then every POLL_S while the "GPU" works
    assert max(clock.slept) <= POLL_S + 1e-12
    assert len(hooks) >= math.floor(expected / POLL_S)
    assert all(b - a <= POLL_S + 1e-9 for a, b in itertools.pairwise(hooks))


def test_throughput_per_sequence_falls_with_the_batch_and_the_batch_total_rises() -> None:
    gpu = SimGpu(decode_step_s=0.012, decode_step_per_seq_s=0.00005)
    assert gpu.tokens_per_s_per_seq(1) == pytest.approx(1 / 0.01205)
    assert gpu.tokens_per_s_per_seq(64) == pytest.approx(1 / (0.012 + 64 * 0.00005))
    assert gpu.tokens_per_s_per_seq(64) < gpu.tokens_per_s_per_seq(1)
    assert 64 * gpu.tokens_per_s_per_seq(64) > 30 * gpu.tokens_per_s_per_seq(1)
    # a call lasts as long as its longest completion: one long sequence costs the whole batch its steps
    short = gpu.call_seconds([10], [[100] * 8])
    tail = gpu.call_seconds([10], [[100] * 7 + [1000]])
    assert tail - short == pytest.approx(900 * 0.012 + 900 * 0.00005)


def test_samples_are_well_formed_and_pass_the_wire_models(tmp_path: Path) -> None:
    clock = FakeClock()
    eng = _engine(clock, SimGpu(length_median=20, length_sigma=1.5), max_new_tokens=64)
    eng.load_adapter("run-v1", 1, _adapter_dir(tmp_path))
    prompts = [[3, 4, 5], [6] * 10, [7]]
    out = eng.generate(prompts, adapter="run-v1", n=4, sampling=_spec(64).sampling)
    assert [len(g) for g in out] == [4, 4, 4]
    reasons = set()
    for group in out:
        assert well_formed(group)  # what the real submitter checks before it submits
        for s in group:
            assert 1 <= len(s.token_ids) <= 64 and len(s.logprobs) == len(s.token_ids)
            assert all(0 <= t < VOCAB for t in s.token_ids)
            assert all(math.isfinite(lp) and lp <= 0 for lp in s.logprobs)
            assert s.finish_reason == ("length" if len(s.token_ids) == 64 else "stop")
            reasons.add(s.finish_reason)
    assert reasons == {"length", "stop"}  # sigma 1.5 around 20 reaches the cap of 64 in 12 samples (seeded)
    batch = RolloutBatch(
        worker_id="w",
        lease_id="l",
        version=1,
        groups=[
            RolloutGroup(
                prompt_id=f"p{i}",
                prompt_index=i,
                prompt_token_ids=p,
                completions=[
                    Completion(token_ids=s.token_ids, logprobs=s.logprobs, reward=1.0, finish_reason=s.finish_reason)
                    for s in g
                ],
            )
            for i, (p, g) in enumerate(zip(prompts, out, strict=True))
        ],
    )
    assert max(g.max_token_id() for g in batch.groups) < VOCAB


def test_completion_lengths_are_long_tailed_around_the_median() -> None:
    gpu = SimGpu(length_median=150, length_sigma=1.0)
    lengths = gpu.sample_lengths(np.random.default_rng(0), 20_000, 1_000_000)
    median = statistics.median(lengths)
    p99 = sorted(lengths)[int(0.99 * len(lengths))]
    assert 140 <= median <= 160
    assert statistics.mean(lengths) > 1.4 * median  # lognormal: mean = median * e^(sigma^2 / 2) ~ 1.65x
    assert p99 > 6 * median  # e^(2.33 sigma) ~ 10x
    capped = gpu.sample_lengths(np.random.default_rng(0), 1000, 200)
    assert max(capped) == 200 and min(capped) >= 1
    flat = SimGpu(length_median=40, length_sigma=0).sample_lengths(np.random.default_rng(0), 10, 64)
    assert flat == [40] * 10


def test_simulate_call_is_deterministic_per_seed() -> None:
    gpu = SimGpu()
    a = simulate_call(gpu, np.random.default_rng(3), [5, 6], n=3, max_new_tokens=50, vocab_size=VOCAB)
    b = simulate_call(gpu, np.random.default_rng(3), [5, 6], n=3, max_new_tokens=50, vocab_size=VOCAB)
    assert a == b and a.seconds > 0


def test_adapter_rules(tmp_path: Path) -> None:
    clock = FakeClock()
    eng = _engine(clock, max_staleness=0)  # max_loras = max_staleness + 2 = 2
    with pytest.raises(errors.NotFound):
        eng.generate([[1]], adapter="run-v1", n=2, sampling=_spec().sampling)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(errors.Invalid, match=r"adapter_config\.json"):
        eng.load_adapter("run-v1", 1, empty)
    eng.load_adapter("run-v1", 1, _adapter_dir(tmp_path, "a"))
    eng.load_adapter("run-v2", 2, _adapter_dir(tmp_path, "b"))
    with pytest.raises(errors.Invalid, match="max_loras"):
        eng.load_adapter("run-v3", 3, _adapter_dir(tmp_path, "c"))
    eng.unload_adapter("run-v1")
    eng.load_adapter("run-v3", 3, tmp_path / "c")
    assert sorted(eng.loaded_adapters()) == ["run-v2", "run-v3"]
    assert eng.generate([], adapter="run-v3", n=2, sampling=_spec().sampling) == []


def test_make_engine_builds_the_sim_engine_from_settings() -> None:
    register()  # the bucketrl command does it: production code never imports the simulation
    eng = make_engine(GeneratorSettings(engine="sim", max_model_len=256), _spec())
    assert isinstance(eng, SimEngine) and eng.name == "sim" and eng.max_model_len == 256


def test_the_sim_engine_exists_only_once_the_simulation_registered_it() -> None:
    """Production code never imports bucketrl.sim: a generator process knows BUCKETRL_ENGINE=sim only once
    something above the generator registered it, which the ``bucketrl`` command does (fresh interpreters, so no
    other test's registration counts)."""
    code = (
        "import sys\n"
        "from bucketrl import errors\n"
        "from bucketrl.generator.engines.factory import make_engine\n"
        "from bucketrl.generator.settings import GeneratorSettings\n"
        "from bucketrl.generator.worker import GeneratorWorker\n"
        "from bucketrl.wire import RunSpec\n"
        "assert not [m for m in sys.modules if m.startswith('bucketrl.sim')], 'the generator imported bucketrl.sim'\n"
        "settings, spec = GeneratorSettings(engine='sim'), RunSpec.model_validate_json(sys.argv[2])\n"
        "if sys.argv[1] == 'cli':\n"
        "    import bucketrl.cli\n"
        "    print(type(make_engine(settings, spec)).__name__)\n"
        "else:\n"
        "    try:\n"
        "        make_engine(settings, spec)\n"
        "    except errors.Invalid as exc:\n"
        "        print(exc.message)\n"
    )
    root = Path(__file__).resolve().parents[2]
    run = [sys.executable, "-c", code]
    spec = _spec().model_dump_json()
    bare = subprocess.run([*run, "bare", spec], cwd=root, capture_output=True, text=True, check=True, timeout=60).stdout
    assert "BUCKETRL_ENGINE=sim is not registered" in bare and "bucketrl.sim.engine.register()" in bare
    cli = subprocess.run([*run, "cli", spec], cwd=root, capture_output=True, text=True, check=True, timeout=60).stdout
    assert cli.strip() == "SimEngine"


class _Abandon(Exception):
    pass


def test_a_call_abandoned_mid_way_counts_what_its_decode_steps_decoded(tmp_path: Path) -> None:
    """A batch's short completions end early, so a call abandoned half-way (the staleness guard's StaleCall) has
    decoded all of theirs: ``tokens_decoded`` counts them step by step, not pro rata of the call's time (which would
    understate what an abandoned call wasted; bench/long_tail.py compares that waste with partial rollouts')."""
    gpu = SimGpu(decode_step_s=0.01, decode_step_per_seq_s=0.0, length_median=20.0, length_sigma=1.0)
    prompt = [[1] * 10]

    def call(abandon_at_s: float | None) -> tuple[SimEngine, list[int], float]:
        clock = FakeClock()
        eng = _engine(clock, gpu, max_new_tokens=400)
        eng.load_adapter("run-v1", 1, _adapter_dir(tmp_path / str(abandon_at_s)))
        start = clock.now

        def hook() -> None:
            if abandon_at_s is not None and clock.now - start >= abandon_at_s:
                raise _Abandon

        try:
            out = eng.generate(prompt, adapter="run-v1", n=8, sampling=_spec(400).sampling, while_running=hook)
        except _Abandon:
            return eng, [], clock.now - start
        return eng, [len(s.token_ids) for s in out[0]], clock.now - start

    (tmp_path / "None").mkdir()
    _, lengths, whole_s = call(None)  # the same seed samples the same lengths: what the abandoned call was decoding
    assert min(lengths) < max(lengths) / 4
    for at in (0.25 * whole_s, 0.5 * whole_s):
        (tmp_path / str(at)).mkdir()
        eng, _, t = call(at)
        k = gpu.steps_done([10], [lengths], t)
        assert eng.tokens_decoded == sum(min(n, k) for n in lengths)
        assert eng.tokens_decoded > sum(lengths) * t / whole_s  # more than a pro-rata share
