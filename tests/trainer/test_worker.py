"""The trainer worker against a real proxy (uvicorn + real Redis + file bucket), fed by a fake generator
over the real wire. The worker runs in this process (its model loads once); the restart and fencing
tests with trainer subprocesses are in ``test_worker_processes.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.tarball import unpack
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.worker import EXIT_CONFIG, EXIT_OK, TrainerWorker
from tests.proxy.harness import TOKENS, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator


def spec_json(model_dir: Path, dataset: dict, **kw: object) -> str:
    spec = {
        "base_model": str(model_dir),
        "lora": {"r": 4, "alpha": 8.0},
        "group_size": 4,
        "max_staleness": 16,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8},
        "reward": {"name": "toy"},
        "dataset": dataset,
        "vocab_size": 64,
        "queue_capacity_groups": 16,
        "groups_per_step": 2,
    }
    spec.update(kw)
    return json.dumps(spec)


def test_worker_trains_publishes_checkpoints_acks_and_reports(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(12)))
    bucket = tmp_path / "bucket"
    with running(redis_server.url, f"file://{bucket}") as proxy:
        settings = TrainerSettings(
            proxy_url=proxy.url,
            token=TOKENS["trainer"],
            run="r1",
            worker_id="trainer-a",
            # No dataset.size: the trainer counts the JSONL file.
            run_spec=spec_json(tiny_model_dir, {"uri": str(data)}),
            max_steps=4,
            sync_every=1,
            checkpoint_every=2,
            device="cpu",
            lr=1e-2,
            claim_wait_s=0.5,
            audit_log=str(tmp_path / "audit.jsonl"),
            work_dir=str(tmp_path / "work"),
        )
        gen = FakeGenerator(proxy.url, "r1", TOKENS["generator"], worker_id="gen-a")
        gen.start()
        out: list[str] = []
        try:
            rc = TrainerWorker(settings, echo=out.append).run()
        finally:
            gen.stop()
        assert rc == EXIT_OK, out
        assert not gen.errors, gen.errors
        assert (tmp_path / "work").is_dir() and not any((tmp_path / "work").iterdir()), "scratch is left clean"
        viewer = proxy.client("r1", role="admin")
        run = viewer.get_run()
        assert run.spec.dataset.size == 12
        status = viewer.status()
        # v1 (initial adapter) before the first step, then one version per step: dense.
        assert status.latest_version == 5
        assert [v.version for v in status.versions] == [1, 2, 3, 4, 5]
        assert viewer.latest_checkpoint().step == 4
        # Every trained group acked after its checkpoint: 4 steps x 2 groups.
        assert status.queue.acked_total == 8
        # Done at max_steps: the run left a shared pool's competition (docs/pool.md), until a trainer registers.
        assert status.pool is not None and status.pool.hold == "finished"
        metrics = status.metrics["trainer-a"]
        for name in (
            "train/loss",
            "train/grad_norm",
            "train/lr",
            "ratio",
            "entropy",
            "clip_ratio/region_mean",
            "reward",
            "reward_std",
            "perf/step_s",
            "perf/fwd_bwd_s",
            "perf/rollout_wait_s",
            "perf/weight_sync_s",
            "sample/staleness_mean",
            "sample/staleness_max",
            "sample/dropped_stale_total",
            "sample/zero_variance_groups",
            "policy/version",
        ):
            assert name in metrics, name
        assert metrics["policy/version"] == 5
        v1 = viewer.download_adapter(1)
        unpack(v1, tmp_path / "v1")
        from safetensors.torch import load_file

        weights = load_file(str(tmp_path / "v1" / "adapter_model.safetensors"))
        assert all(float(w.abs().max()) == 0.0 for k, w in weights.items() if "lora_B" in k), "v1 is the identity"

    # The final adapter: printed, in the bucket as plain files, and loadable by peft from there.
    assert any("runs/r1/adapters/v5/files/" in line for line in out), out
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    files = bucket / "runs" / "r1" / "adapters" / "v5" / "files"
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)), str(files))
    b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert b and any(float(p.abs().max()) > 0 for p in b), "trained weights, not the identity"
    # The audit trail: each step's deliveries, each checkpoint acks exactly the deliveries since the previous one.
    records = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    ckpts = [r for r in records if r["event"] == "checkpoint"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and [r["step"] for r in ckpts] == [2, 4]
    assert ckpts[0]["acked"] == steps[0]["deliveries"] + steps[1]["deliveries"]
    assert ckpts[1]["acked"] == steps[2]["deliveries"] + steps[3]["deliveries"]
    assert all(len(r["deliveries"]) == 2 for r in steps)


def test_worker_refuses_an_immutable_change_and_a_missing_run(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        base = {"proxy_url": proxy.url, "token": TOKENS["trainer"], "run": "r2", "device": "cpu"}
        out: list[str] = []
        assert TrainerWorker(TrainerSettings(**base), echo=out.append).run() == EXIT_CONFIG
        assert "BUCKETRL_RUN_SPEC" in out[-1]
        client = proxy.client("r2")
        from bucketrl.wire import RunSpec

        client.put_run(RunSpec.model_validate_json(spec_json(tiny_model_dir, {"uri": "toy:digits", "size": 8})))
        changed = spec_json(tiny_model_dir, {"uri": "toy:digits", "size": 8}, group_size=8)
        assert TrainerWorker(TrainerSettings(**base, run_spec=changed), echo=out.append).run() == EXIT_CONFIG
        assert "immutable" in out[-1]
        # Nothing changed on the proxy: same spec, no trainer registered.
        run = client.get_run()
        assert run.spec.group_size == 4 and run.state.trainer_epoch == 0


def test_old_epoch_cannot_publish_after_a_new_registration(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from bucketrl.trainer.model import PolicyModel
    from bucketrl.wire import RunSpec

    spec = RunSpec.model_validate_json(spec_json(tiny_model_dir, {"uri": "toy:digits", "size": 8}))
    tar = PolicyModel(spec, device="cpu").adapter_tar()
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        old, new = proxy.client("r3", role="trainer"), proxy.client("r3", role="trainer")
        old.put_run(spec)
        old.register_trainer("a")
        old.publish_adapter(1, tar)
        new.register_trainer("b")
        with pytest.raises(errors.Fenced):
            old.publish_adapter(2, tar)
        with pytest.raises(errors.Fenced):
            old.put_checkpoint(1, tar)
        assert new.publish_adapter(2, tar).version == 2
        assert new.status().latest_version == 2


def test_dataset_file_is_counted_uploaded_and_readable_by_generators(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    from bucketrl.datasets import load_examples

    data = "".join(json.dumps({"q": f"{i}*2=", "a": 2 * i}) + "\n" for i in range(5)).encode()
    path = tmp_path / "train.jsonl"
    path.write_bytes(data)
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        base = {"proxy_url": proxy.url, "token": TOKENS["trainer"], "device": "cpu", "dataset_file": str(path)}
        dataset = {"uri": "bucket:dataset.jsonl", "prompt_field": "q", "answer_field": "a"}
        worker = TrainerWorker(TrainerSettings(**base, run="r4", run_spec=spec_json(tiny_model_dir, dataset)))
        spec = worker._ensure_run()
        assert spec.dataset.size == 5
        gen = proxy.client("r4", role="generator")
        assert gen.download_dataset() == data
        examples = load_examples(spec.dataset, gen)
        assert [(e.prompt, e.answer) for e in examples] == [(f"{i}*2=", str(2 * i)) for i in range(5)]
        # The file must be what the spec points at; a run whose dataset differs is refused.
        out: list[str] = []
        wrong = spec_json(tiny_model_dir, {"uri": "toy:digits", "size": 4})
        assert TrainerWorker(TrainerSettings(**base, run="r5", run_spec=wrong), echo=out.append).run() == EXIT_CONFIG
        assert "bucket:dataset.jsonl" in out[-1]
        path.write_bytes(data + data)
        again = TrainerSettings(**base, run="r4", run_spec=spec_json(tiny_model_dir, {**dataset, "size": 5}))
        assert TrainerWorker(again, echo=out.append).run() == EXIT_CONFIG
        assert "BUCKETRL_DATASET_FILE differs" in out[-1]
        assert gen.download_dataset() == data
        for c in (worker.client, worker.claim_client, worker.write_client):
            c.close()


def test_stop_before_registering_leaves_the_current_trainer_alone(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as proxy:
        spec = spec_json(tiny_model_dir, {"uri": "toy:digits", "size": 8})
        settings = TrainerSettings(proxy_url=proxy.url, token=TOKENS["trainer"], run="r6", run_spec=spec, device="cpu")
        worker = TrainerWorker(settings, echo=lambda s: None)
        worker.request_stop()  # as if SIGTERM arrived while the model was loading
        assert worker.run() == EXIT_OK
        run = proxy.client("r6").get_run()
        assert run.state.trainer_epoch == 0 and run.state.latest_version == 0


class _RecordingWorker(TrainerWorker):
    """The real worker, keeping a copy of every step's pushed metrics (the proxy keeps only the latest)."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.pushed: list[tuple[int, dict[str, float]]] = []

    def _push(self, step: int, stats: dict[str, float], *, report_eval: bool = True) -> None:
        self.pushed.append((step, dict(stats)))
        super()._push(step, stats, report_eval=report_eval)


@pytest.mark.slow  # about a minute of real training steps: make test runs it, make test-fast does not
def test_no_trained_group_is_staler_than_max_staleness(
    redis_server: RedisServer, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The trainer claims a step ahead and publishes asynchronously, so a group that passes the proxy's
    ``latest - max_staleness`` at claim time could be trained 1-2 versions later. A slow generator submitting
    at the oldest accepted version (latest - max_staleness) makes that happen every step unless the claim
    carries the trainer's floor (``min_version``): then such groups are dropped and counted, never trained."""
    bucket = tmp_path / "bucket"
    with running(redis_server.url, f"file://{bucket}") as proxy:
        settings = TrainerSettings(
            proxy_url=proxy.url,
            token=TOKENS["trainer"],
            run="r-stale",
            worker_id="trainer-a",
            run_spec=spec_json(
                tiny_model_dir, {"uri": "toy:digits", "size": 200}, max_staleness=1, queue_capacity_groups=8
            ),
            max_steps=6,
            sync_every=1,
            checkpoint_every=3,
            device="cpu",
            lr=1e-2,
            claim_wait_s=0.5,
            work_dir=str(tmp_path / "work"),
        )
        gens = [
            FakeGenerator(proxy.url, "r-stale", TOKENS["generator"], worker_id="gen-fresh", seed=1),
            FakeGenerator(proxy.url, "r-stale", TOKENS["generator"], worker_id="gen-slow", seed=2, lag=1),
        ]
        for g in gens:
            g.start()
        out: list[str] = []
        worker = _RecordingWorker(settings, echo=out.append)
        try:
            rc = worker.run()
        finally:
            for g in gens:
                g.stop()
        assert rc == EXIT_OK, out
        assert not any(g.errors for g in gens), [g.errors for g in gens]
        assert [step for step, _ in worker.pushed] == [1, 2, 3, 4, 5, 6]
        staleness = [stats["sample/staleness_max"] for _, stats in worker.pushed]
        assert max(staleness) <= 1, staleness
        assert all("sample/stale_held_back" not in stats for _, stats in worker.pushed), "the claim floor suffices"
        # The slow generator's groups that reach a claim too stale are dropped and counted: the trainer's total is
        # the proxy's. (Admission control now paces a lagging generator, so on a quiet machine it may get no
        # group accepted that turns stale: the count can be 0; the staleness bound above is the point.)
        q = proxy.client("r-stale", role="admin").status().queue
        final = worker.pushed[-1][1]
        assert final["sample/dropped_stale_total"] == q.dropped_stale_total
        assert q.accepted_total == q.acked_total + q.dropped_stale_total + q.groups + q.pending, q
        # The claims told the proxy the trainer's pace (admission control): the version of the step the next
        # queued group joins (step 6 trained with v6; the claim ahead may have reached the step after).
        pace = proxy.call(lambda ctx: ctx.redis.hgetall("brl:r-stale:queue:pace"))
        assert int(pace[b"sync"]) == 1 and 6 <= int(pace[b"at"]) <= 8, pace
