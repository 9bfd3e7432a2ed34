"""``bucketrl export`` (issue 12): the adapter streams to a file and is checked and unpacked from there."""

from __future__ import annotations

import io
import tarfile
import tracemalloc
from pathlib import Path

from typer.testing import CliRunner

from bucketrl.cli import app
from bucketrl.export import adapter_tar_from_proxy, export_adapter
from tests.proxy.harness import TOKENS, adapter_tar, make_spec, make_tar, running
from tests.support.services import RedisServer


def test_a_large_adapter_exports_through_a_file_not_memory(redis_server: RedisServer, tmp_path: Path) -> None:
    """The export downloaded the whole tar into memory (a 512 MiB adapter cost 512 MiB); now the peak of Python
    allocations is a small fraction of the tar, and the folder holds the published files byte for byte."""
    tar = adapter_tar(1, size=48 * 1024 * 1024)
    # No proxy-side cache: it would hold the tar in this (shared) process and blur the figure.
    with running(redis_server.url, f"file://{tmp_path / 'b'}", adapter_cache_mb=0) as p:
        t = p.client("r1", "trainer")
        t.put_run(make_spec())
        t.register_trainer("t0")
        t.publish_adapter(1, tar)
        out = tmp_path / "out" / "adapter"
        tracemalloc.start()
        try:
            got, path = export_adapter(
                out, None, lambda v, fh: adapter_tar_from_proxy(p.url, "r1", TOKENS["generator"], v, fh)
            )
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    print(f"export of a {len(tar) / 1e6:.1f} MB adapter: Python allocation peak {peak / 1e6:.2f} MB")
    assert peak < len(tar) / 8, f"peak {peak / 1e6:.1f} MB for a {len(tar) / 1e6:.1f} MB tar"
    assert (got, path) == (1, out)
    weights = (out / "adapter_model.safetensors").read_bytes()
    assert len(weights) > 48 * 1024 * 1024
    assert sorted(f.name for f in out.parent.iterdir()) == ["adapter"]  # the downloaded tar is gone


def test_export_cli_from_the_proxy_and_a_refused_tar(redis_server: RedisServer, tmp_path: Path) -> None:
    """The CLI end to end over HTTP (latest version, then --version); an adapter tar holding a file a loader
    would unpickle is refused with one line, and neither the folder nor the downloaded tar is left."""
    tar1, tar2 = adapter_tar(1, size=4096), adapter_tar(2, size=4096)
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as p:
        t = p.client("r1", "trainer")
        t.put_run(make_spec())
        t.register_trainer("t0")
        t.publish_adapter(1, tar1)
        t.publish_adapter(2, tar2)
        base = ["export", "--proxy", p.url, "--run", "r1", "--token", TOKENS["generator"]]
        res = CliRunner().invoke(app, [*base[:1], str(tmp_path / "latest"), *base[1:]])
        assert res.exit_code == 0, res.output
        assert "wrote adapter v2" in res.output
        res = CliRunner().invoke(app, [*base[:1], str(tmp_path / "v1"), *base[1:], "--version", "1"])
        assert res.exit_code == 0, res.output
        for folder, tar in (("v1", tar1), ("latest", tar2)):  # the published weights, byte for byte
            with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
                member = tf.extractfile("adapter_model.safetensors")
                assert member is not None
                assert (tmp_path / folder / "adapter_model.safetensors").read_bytes() == member.read()
        # A hostile bundle in the bucket (the proxy refuses it at publish, so it is planted): refused.
        stored = next((tmp_path / "bucket").rglob("adapters/v2/bundle.tar"))
        evil = make_tar({"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.bin": b"pickle"})
        stored.write_bytes(evil)
    bad = tmp_path / "bad"
    res = CliRunner().invoke(app, ["export", str(bad), "--dir", str(tmp_path), "--run", "r1", "--version", "2"])
    assert res.exit_code == 1, res.output
    assert "not a usable adapter tar" in res.output and "Traceback" not in res.output
    assert not bad.exists()
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".export-")]
