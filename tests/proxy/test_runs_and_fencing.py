"""Run specs (create/confirm/update/immutable) and trainer fencing, including a publish racing a new
registration (docs/design.md invariant 2: a fenced trainer can never publish)."""

from __future__ import annotations

import hashlib
import threading

import pytest

from bucketrl import errors
from bucketrl.proxy.state import versions
from bucketrl.wire import RunSpec
from tests.proxy.harness import ProxyHarness, adapter_files, adapter_tar, checkpoint_tar, make_spec, make_tar, running
from tests.support.services import RedisServer


def test_put_run_create_confirm_update_and_immutable_fields(proxy: ProxyHarness) -> None:
    spec = make_spec()
    with proxy.http("trainer") as t:
        r = t.put("/v1/runs/r1", content=spec.model_dump_json())
        assert r.status_code == 201
        created_at = r.json()["state"]["created_at"]
        r = t.put("/v1/runs/r1", content=spec.model_dump_json())
        assert r.status_code == 200 and r.json()["spec"] == spec.model_dump(mode="json")
        changed = spec.model_copy(update={"max_staleness": 7})
        r = t.put("/v1/runs/r1", content=changed.model_dump_json())
        assert r.status_code == 200 and r.json()["spec"]["max_staleness"] == 7
        assert r.json()["state"]["created_at"] == created_at
        for field, value in [
            ("base_model", "other"),
            ("group_size", 4),
            ("vocab_size", 128),
            ("lora", spec.lora.model_copy(update={"r": 16})),
            ("dataset", spec.dataset.model_copy(update={"size": 65})),
        ]:
            bad = changed.model_copy(update={field: value})
            r = t.put("/v1/runs/r1", content=bad.model_dump_json())
            assert r.status_code == 409, field
            assert r.json()["error"]["code"] == "immutable_field" and field in r.json()["error"]["message"]
    # The bucket holds the current spec (what a rebuild restores from); the refused changes left no trace.
    stored = RunSpec.model_validate_json(proxy.ctx.store.get_bytes("runs/r1/run.json"))
    assert stored == changed
    assert proxy.client("r1", "viewer").get_run().spec == changed


def test_registration_epochs_are_monotonic_and_old_epochs_are_fenced(proxy_file: ProxyHarness) -> None:
    old = proxy_file.client("r1", "trainer")
    old.put_run(make_spec())
    assert old.register_trainer("a").epoch == 1
    assert old.publish_adapter(1, adapter_tar(1)).version == 1
    new = proxy_file.client("r1", "trainer")
    reg = new.register_trainer("b")
    assert reg.epoch == 2 and reg.latest_version == 1
    with pytest.raises(errors.Fenced) as exc:
        old.publish_adapter(2, adapter_tar(2))
    assert exc.value.status == 409 and exc.value.code == "fenced"
    with pytest.raises(errors.Fenced):
        old.put_checkpoint(5, checkpoint_tar(b"old"))
    future = proxy_file.client("r1", "trainer")
    future.epoch = 99
    with pytest.raises(errors.Fenced, match="never issued"):
        future.publish_adapter(2, adapter_tar(2))
    assert new.publish_adapter(2, adapter_tar(2)).version == 2
    assert new.put_checkpoint(5, checkpoint_tar(b"new")).epoch == 2
    assert new.get_run().state.trainer_epoch == 2
    assert proxy_file.ctx.store.list_keys("runs/r1/checkpoints")[0].startswith("runs/r1/checkpoints/step-5/")
    with proxy_file.http("trainer") as t:
        r = t.put("/v1/runs/r1/adapters/3", content=adapter_tar(3), headers={"X-Content-SHA256": "0" * 64})
        assert r.status_code == 422 and "X-Trainer-Epoch" in r.json()["error"]["message"]


def test_versions_are_dense_latest_plus_one_only(proxy: ProxyHarness) -> None:
    t = proxy.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("a")
    for bad in (0, 2, 5):
        with pytest.raises((errors.Conflict, errors.Invalid)):
            t.publish_adapter(bad, adapter_tar(bad or 1))
    tar1 = adapter_tar(1)
    first = t.publish_adapter(1, tar1)
    assert t.publish_adapter(1, tar1) == first  # a retried PUT of the committed bytes is a no-op
    with pytest.raises(errors.Conflict) as exc:
        t.publish_adapter(1, adapter_tar(99))  # different bytes under a committed number
    assert exc.value.code == "version_conflict"
    assert t.publish_adapter(2, adapter_tar(2)).version == 2
    assert t.get_run().state.latest_version == 2


def test_bad_tar_and_sha_mismatch_write_nothing(proxy: ProxyHarness) -> None:
    t = proxy.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("a")
    with proxy.http("trainer") as h:
        tar = adapter_tar(1)
        r = h.put(
            "/v1/runs/r1/adapters/1",
            content=tar,
            headers={"X-Trainer-Epoch": "1", "X-Content-SHA256": "a" * 64, "Content-Type": "application/x-tar"},
        )
        assert r.status_code == 422 and r.json()["error"]["code"] == "sha256_mismatch"
        r = h.put("/v1/runs/r1/adapters/1", content=tar, headers={"X-Trainer-Epoch": "1", "X-Content-SHA256": "xyz"})
        assert r.status_code == 422 and "X-Content-SHA256" in r.json()["error"]["message"]
    with pytest.raises(errors.Invalid, match="tar"):
        t.publish_adapter(1, b"this is not a tar archive at all" * 40)
    evil = make_tar({"../escape": b"x"})
    with pytest.raises(errors.Invalid, match="unsafe"):
        t.publish_adapter(1, evil)
    assert t.get_run().state.latest_version == 0
    assert proxy.ctx.store.list_keys("runs/r1/adapters") == []
    assert t.publish_adapter(1, adapter_tar(1)).version == 1


def test_publish_racing_a_new_registration_is_fenced_at_commit(proxy_file: ProxyHarness, monkeypatch) -> None:
    """Deterministic: the new trainer registers while the old one's files are being written."""
    old = proxy_file.client("r1", "trainer")
    old.put_run(make_spec())
    old.register_trainer("old")
    new = proxy_file.client("r1", "trainer")
    original = versions._write_bundle

    def write_then_get_fenced(*args, **kwargs):  # runs in the proxy's worker thread, mid-publish
        original(*args, **kwargs)
        new.register_trainer("new")

    monkeypatch.setattr(versions, "_write_bundle", write_then_get_fenced)
    with pytest.raises(errors.Fenced):
        old.publish_adapter(1, adapter_tar(1))
    monkeypatch.setattr(versions, "_write_bundle", original)
    assert new.get_run().state.latest_version == 0
    assert proxy_file.ctx.store.list_keys("runs/r1/adapters") == []  # the fenced files were removed
    tar = adapter_tar(1, size=300)
    assert new.publish_adapter(1, tar).sha256 == hashlib.sha256(tar).hexdigest()
    assert proxy_file.client("r1", "generator").download_adapter(1) == tar


def test_publishes_racing_registrations_never_commit_a_fenced_version(proxy_file: ProxyHarness) -> None:
    """Randomised race: if a publish succeeded, the concurrent registration saw it; if it was fenced, nothing
    of it remains. Versions stay dense throughout."""
    run = "race"
    setup = proxy_file.client(run, "trainer")
    setup.put_run(make_spec())
    setup.register_trainer("t0")
    trainer = setup
    big = 2_000_000  # a commit takes long enough for registrations to land inside it
    outcomes: list[str] = []
    for i in range(12):
        n = trainer.get_run().state.latest_version + 1
        tar = make_tar(adapter_files(f"race-{i}", size=big))
        result: dict[str, object] = {}

        def publish(client=trainer, n=n, tar=tar, result=result) -> None:
            try:
                result["info"] = client.publish_adapter(n, tar)
            except errors.BucketRLError as exc:
                result["error"] = exc

        challenger = proxy_file.client(run, "trainer")
        th = threading.Thread(target=publish)
        th.start()
        threading.Event().wait(0.002 * (i % 6))
        reg = challenger.register_trainer(f"t{i + 1}")
        th.join(30)
        if "info" in result:
            assert reg.latest_version >= n, "a publish committed after the registration that fenced it"
            outcomes.append("ok")
        else:
            assert isinstance(result["error"], errors.Fenced), result["error"]
            assert reg.latest_version == n - 1
            assert not proxy_file.ctx.store.exists(f"runs/{run}/adapters/v{n}/manifest.json")
            outcomes.append("fenced")
        trainer = challenger
    state = trainer.get_run().state
    assert state.latest_version == outcomes.count("ok")
    assert sorted(
        int(k.split("/")[3][1:])
        for k in proxy_file.ctx.store.list_keys(f"runs/{run}/adapters")
        if k.endswith("manifest.json")
    ) == list(range(1, state.latest_version + 1))
    assert "fenced" in outcomes  # the race was actually exercised


@pytest.mark.parametrize("keep", [2, 0])
def test_old_checkpoints_are_pruned_keeping_the_newest(redis_server: RedisServer, bucket_url: str, keep: int) -> None:
    from bucketrl.proxy import gc, keys
    from bucketrl.proxy.state import checkpoints

    with running(redis_server.url, bucket_url, checkpoint_keep=keep) as h:
        t = h.client("r1", "trainer")
        t.put_run(make_spec())
        t.register_trainer("a")
        for step in (5, 10, 15, 20):
            t.put_checkpoint(step, checkpoint_tar(f"step {step}".encode()))
        # Step 5 is being written again right now (its write lock is held): a pass leaves it alone.
        lock = keys.run_key("r1", keys.WRITE_LOCK.format(name="step-5"))
        h.call(lambda ctx: ctx.redis.set(lock, "someone", px=60_000))
        h.call(gc.collect_all)

        def on_disk() -> set[int]:
            found = h.ctx.store.list_keys("runs/r1/checkpoints/")
            return {int(k.split("/step-")[1].split("/")[0]) for k in found}

        if keep == 0:
            assert on_disk() == {5, 10, 15, 20}
            return
        assert on_disk() == {5, 15, 20}  # 10 pruned; 5 skipped while locked
        assert t.latest_checkpoint().step == 20  # type: ignore[union-attr]
        assert h.call(lambda ctx: checkpoints.get_info(ctx.redis, "r1", 10)) is None
        h.call(lambda ctx: ctx.redis.delete(lock))
        h.call(gc.collect_all)
        assert on_disk() == {15, 20}
        steps = h.call(lambda ctx: ctx.redis.zrange(keys.run_key("r1", keys.CHECKPOINTS), 0, -1))
        assert [int(s) for s in steps] == [15, 20]
