"""Partial rollouts in the generator (bucketrl/generator/partial_rollouts.py) on the simulated engine, in process: a
call overtaken by a newer version stops at a step and goes on under it; the completions keep the lengths they were
drawn with, finished ones stay whole, every token's version is recorded, the batch holds both versions and its spans
make a valid rollout batch as of the newest. The transformers engine's logprobs per span: tests/trainer/
test_engine_agreement.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from bucketrl.generator.adapters import VersionBook
from bucketrl.generator.metrics import GeneratorMetrics
from bucketrl.generator.partial_rollouts import sample_partial
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.staleness_guard import StalenessGuard
from bucketrl.generator.submit import HeldVersions
from bucketrl.rollout.engine import StopAtStep
from bucketrl.sim.engine import SimEngine
from bucketrl.sim.gpu import SimGpu
from bucketrl.wire import Completion, RolloutBatch, RolloutGroup, SamplingSpec
from tests.generator.helpers import run_spec

GPU = SimGpu(decode_step_s=0.002, decode_step_per_seq_s=0.0, length_median=120.0, length_sigma=1.0)
PROMPTS = [[1, 2, 3], [4, 5]]


class Clock:
    """The simulated GPU's time, advanced by its own sleeps: the cut falls at the same step however loaded the
    machine is."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


def _engine(tmp_path: Path, spec: object, clock: Clock) -> SimEngine:
    (tmp_path / "adapter_config.json").write_text("{}")
    settings = GeneratorSettings(engine="sim", seed=7, max_model_len=1024)
    return SimEngine(settings=settings, spec=spec, gpu=GPU, clock=clock, sleep=clock.sleep)  # type: ignore[arg-type]


def test_an_overtaken_call_goes_on_under_the_newer_version(tmp_path: Path) -> None:
    spec = run_spec(tmp_path, max_staleness=2, group_size=4, sampling=SamplingSpec(max_new_tokens=300))
    spec = spec.model_copy(update={"partial_rollouts": True})
    # The reference: the same seed, nothing newer published, so one uncut call.
    clock = Clock()
    ref = _engine(tmp_path, spec, clock)
    ref.load_adapter("r-v1", 1, tmp_path)
    uncut = ref.generate(PROMPTS, adapter="r-v1", n=4, sampling=spec.sampling)
    assert any(len(s.token_ids) > 100 for g in uncut for s in g) and any(
        len(s.token_ids) < 60 for g in uncut for s in g
    )

    engine, book, metrics = _engine(tmp_path, spec, clock), VersionBook("r"), GeneratorMetrics()
    book.add(1, "L1", tmp_path, 0.0)
    engine.load_adapter(book.name(1), 1, tmp_path)
    book.mark_loaded(1)
    guard = StalenessGuard(book, lambda: spec, metrics, clock=clock)
    guard.continues = True
    held = HeldVersions(book)
    held.hold(1)
    t0 = clock()

    def worker_hook() -> None:  # v2 arrives 0.12 s into the call (after ~60 of the longest's steps)
        if clock() - t0 > 0.12 and book.newest_known < 2:
            book.add(2, "L2", tmp_path, 0.0)
            engine.load_adapter(book.name(2), 2, tmp_path)
            book.mark_loaded(2)

    out = guard.rollout(engine, held, PROMPTS, spec, worker_hook)
    assert [[len(s.token_ids) for s in g] for g in out.samples] == [[len(s.token_ids) for s in g] for g in uncut]
    assert [[s.finish_reason for s in g] for g in out.samples] == [[s.finish_reason for s in g] for g in uncut]
    assert out.spans is not None and out.continuations >= 1 and metrics.snapshot()["rollout/continuations_total"] >= 1
    # The whole call, continuations included: what bench/long_tail.py sets against the staleness window.
    assert metrics.snapshot()["rollout/call_s_max"] == pytest.approx(clock() - t0)
    spans = [sp for g in out.spans for sp in g]
    cut_at = {sp[0].end for sp in spans if len(sp) == 2}
    assert len(cut_at) == 1  # every continued completion was cut at the same step
    for sp, s in zip(spans, [s for g in out.samples for s in g], strict=True):
        assert sp[0].version == 1 and sp[-1].end == len(s.token_ids)
        assert [x.version for x in sp] == ([1] if len(s.token_ids) <= min(cut_at) else [1, 2])
        # The tokens kept before the cut are the uncut call's own (same draw): nothing resampled.
    for g_out, g_ref in zip(out.samples, uncut, strict=True):
        for s, r in zip(g_out, g_ref, strict=True):
            k = min(cut_at)
            assert s.token_ids[:k] == r.token_ids[:k] and s.logprobs[:k] == r.logprobs[:k]
    assert held.versions() == [1, 2] and held.newest.version == 2
    groups = [
        RolloutGroup(
            prompt_id=f"p{i}",
            prompt_index=i,
            prompt_token_ids=p,
            completions=[
                Completion(token_ids=s.token_ids, logprobs=s.logprobs, reward=0.0, version_spans=sp)
                for s, sp in zip(g, gs, strict=True)
            ],
        )
        for i, (p, g, gs) in enumerate(zip(PROMPTS, out.samples, out.spans, strict=True))
    ]
    # Finished-early completions end at v1, the batch is v2's (its newest): a valid batch, submitted once.
    RolloutBatch(worker_id="w", lease_id="L2", version=2, groups=groups)
    assert held.give_back() and not held.give_back()
    assert book.retire(max_staleness=0, capacity=1) and book.versions() == {2}  # v1 free to go once settled


def test_a_cut_with_no_version_loaded_to_go_on_under_is_a_clear_error(tmp_path: Path) -> None:
    """A book with nothing loaded at a cut (the held versions are never retired: a bug) says so, not ``assert``."""
    spec = run_spec(tmp_path, group_size=2, sampling=SamplingSpec(max_new_tokens=300)).model_copy(
        update={"partial_rollouts": True}
    )
    clock = Clock()
    engine, book = _engine(tmp_path, spec, clock), VersionBook("r")
    book.add(1, "L1", tmp_path, 0.0)
    engine.load_adapter(book.name(1), 1, tmp_path)
    book.mark_loaded(1)
    held = HeldVersions(book)
    held.hold(1)

    def hook(slot: object) -> None:
        book.drop(1)
        raise StopAtStep("cut")

    with pytest.raises(
        RuntimeError, match=r"4 completion\(s\) of a v1 call were stopped .* no adapter version is loaded"
    ):
        sample_partial(engine, held, book, PROMPTS, spec, hook)
