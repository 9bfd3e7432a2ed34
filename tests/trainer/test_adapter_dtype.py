"""A run on a bfloat16 model ships its adapter versions in bfloat16 (``adapter_dtype: auto``, issue 32): half the
bytes of the float32 run on the same model, the float32 master weights and checkpoints untouched, a generator's
bfloat16 engine holds exactly the shipped weights, and ``bucketrl export`` still gives float32 (from the checkpoint
taken at the step that published the version)."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from bucketrl.cli import app
from bucketrl.generator.adapters import fetch_adapter
from bucketrl.generator.engines.factory import make_engine
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.worker import EXIT_OK, TrainerWorker
from tests.proxy.harness import TOKENS, running
from tests.support.services import RedisServer
from tests.trainer.fake_generator import FakeGenerator
from tests.trainer.test_worker import spec_json

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bucketrl.tasks.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-bf16"), dtype="bfloat16")


def _train(proxy: Any, run: str, model: Path, data: Path, work: Path, **spec: Any) -> None:
    settings = TrainerSettings(
        proxy_url=proxy.url,
        token=TOKENS["trainer"],
        run=run,
        worker_id=f"trainer-{run}",
        run_spec=spec_json(model, {"uri": str(data)}, **spec),
        max_steps=2,
        sync_every=1,
        checkpoint_every=2,
        device="cpu",
        lr=1e-2,
        claim_wait_s=0.5,
        work_dir=str(work),
    )
    gen = FakeGenerator(proxy.url, run, TOKENS["generator"], worker_id=f"gen-{run}")
    gen.start()
    out: list[str] = []
    try:
        rc = TrainerWorker(settings, echo=out.append).run()
    finally:
        gen.stop()
    assert rc == EXIT_OK, out
    assert not gen.errors, gen.errors


def _data_bytes(path: Path) -> int:
    """A safetensors file's tensor bytes (its size less the JSON header)."""
    raw = path.read_bytes()
    return len(raw) - 8 - int.from_bytes(raw[:8], "little")


def _weights(bucket: Path, key: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(bucket / key))


def test_a_bf16_run_ships_half_the_bytes_keeps_fp32_masters_and_exports_fp32(
    redis_server: RedisServer, tmp_path: Path, bf16_model: Path
) -> None:
    import torch

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(8)))
    bucket = tmp_path / "bucket"
    with running(redis_server.url, f"file://{bucket}") as proxy:
        _train(proxy, "half", bf16_model, data, tmp_path / "w1")  # adapter_dtype: auto -> bfloat16 (the model's)
        _train(proxy, "full", bf16_model, data, tmp_path / "w2", adapter_dtype="float32")
        half, full = proxy.client("half", role="admin"), proxy.client("full", role="admin")
        shipped = half.wait_for_version(0, wait_s=0)
        assert shipped is not None and shipped.version == 3 and shipped.dtype == "bfloat16"
        reference = full.wait_for_version(0, wait_s=0)
        assert reference is not None and reference.dtype == "float32"
        assert [x.version for x in half.status().versions] == [x.version for x in full.status().versions] == [1, 2, 3]
        half_data = _data_bytes(bucket / "runs/half/adapters/v3/files/adapter_model.safetensors")
        full_data = _data_bytes(bucket / "runs/full/adapters/v3/files/adapter_model.safetensors")
        print(
            f"\nv3: {shipped.bytes} tar bytes in bfloat16, {reference.bytes} in float32; "
            f"weights {half_data}/{full_data}"
        )
        # Exactly half the weights; the tar shrinks by those bytes, to its 10 KiB records (a tiny adapter's tar is
        # mostly headers and padding: a real one's ratio is ~0.5, docs/scale.md).
        assert 2 * half_data == full_data
        assert abs(reference.bytes - shipped.bytes - half_data) <= 10240

        # The checkpoint (taken at step 2, which published v3) holds the float32 master weights; v3 is them cast.
        ckpt = proxy.client("half", role="trainer").latest_checkpoint()
        assert ckpt is not None and ckpt.step == 2
        master = _weights(bucket, "runs/half/checkpoints/step-2/files/adapter/adapter_model.safetensors")
        sent = _weights(bucket, "runs/half/adapters/v3/files/adapter_model.safetensors")
        assert master.keys() == sent.keys()
        assert all(master[k].dtype == torch.float32 and sent[k].dtype == torch.bfloat16 for k in master)
        assert all(torch.equal(master[k].to(torch.bfloat16), sent[k]) for k in master)
        assert any(float(v.abs().max()) > 0 for k, v in sent.items() if "lora_B" in k), "trained, not the identity"

        # A generator fetches it (announced dtype checked) and its bfloat16 engine holds exactly the shipped tensors.
        gen = proxy.client("half", role="generator")
        (tmp_path / "cache").mkdir()
        path = fetch_adapter(gen, 3, tmp_path / "cache", shipped.sha256, shipped.dtype)
        spec = half.get_run().spec
        engine: Any = make_engine(GeneratorSettings(engine="transformers", seed=0, dtype="bfloat16"), spec)
        try:
            engine.load_adapter("half-v3", 3, path)
            held = {k: p for k, p in engine._model.named_parameters() if ".half-v3." in k}
            assert len(held) == len(sent)
            for k, p in held.items():
                key = next(s for s in sent if s.removesuffix(".weight") in k.replace(".half-v3", ""))
                assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), sent[key]), k
        finally:
            engine.close()

    # Export from the run directory gives float32 (from the checkpoint); --as-shipped the bfloat16 file; v2 has
    # no checkpoint of its own weights: refused, naming the way out.
    (tmp_path / "up_options.json").write_text(json.dumps({"bucket_url": f"file://{bucket}", "run": "half"}))
    runner = CliRunner()
    res = runner.invoke(app, ["export", str(tmp_path / "out32"), "--dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    got = _weights(tmp_path, "out32/adapter_model.safetensors")
    assert all(torch.equal(got[k], master[k]) for k in master) and len(got) == len(master)
    res = runner.invoke(app, ["export", str(tmp_path / "out16"), "--dir", str(tmp_path), "--as-shipped"])
    assert res.exit_code == 0, res.output
    assert all(v.dtype == torch.bfloat16 for v in _weights(tmp_path, "out16/adapter_model.safetensors").values())
    res = runner.invoke(app, ["export", str(tmp_path / "old"), "--dir", str(tmp_path), "--version", "2"])
    assert res.exit_code == 1, res.output
    assert "v2 was shipped in bfloat16" in res.output and "--as-shipped" in res.output, res.output
    assert not (tmp_path / "old").exists()
    assert not any(p.name.startswith(".export") for p in tmp_path.iterdir()), "no temporary file left"
    with tarfile.open(bucket / "runs/half/adapters/v3/bundle.tar") as tar:
        assert sorted(tar.getnames()) == ["adapter_config.json", "adapter_model.safetensors"]
