"""Adapter versions carry their dtype (issue 32): the proxy refuses weights that are not in the run spec's
``adapter_dtype`` (nothing stored), records the dtype in the manifest and the version (kept across a Redis wipe),
announces it, and a generator refuses a download whose weights are not in the announced dtype."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from bucketrl import errors
from bucketrl.generator.adapters import fetch_adapter, file_dtype
from bucketrl.storage import dirs
from tests.proxy.harness import ProxyHarness, make_spec, make_tar
from tests.support.services import RedisServer


def weights(*dtypes: str, n: int = 64) -> bytes:
    """A safetensors file with one ``n``-element tensor per dtype."""
    header, offset = {}, 0
    for i, dtype in enumerate(dtypes):
        size = n * (4 if dtype == "F32" else 2)
        header[f"l{i}.lora_A.weight"] = {"dtype": dtype, "shape": [n], "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + b"\x01" * offset


def tar_of(*dtypes: str) -> bytes:
    files = {"adapter_config.json": b'{"peft_type": "LORA", "r": 8}', "adapter_model.safetensors": weights(*dtypes)}
    return make_tar(files)


def test_publish_refuses_weights_not_in_the_run_dtype_and_records_it(
    proxy_file: ProxyHarness, redis_server: RedisServer
) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec(adapter_dtype="bfloat16"))
    t.register_trainer("t0")
    for bad, says in ((tar_of("F32"), "are float32 but"), (tar_of("BF16", "F16"), "found bfloat16, float16")):
        with pytest.raises(errors.Invalid) as err:
            t.publish_adapter(1, bad)
        assert says in err.value.message, err.value.message
        assert t.get_run().state.latest_version == 0
        assert proxy_file.ctx.store.list_keys("runs/r1/adapters") == []
    assert t.publish_adapter(1, tar_of("BF16")).dtype == "bfloat16"
    manifest = dirs.read_manifest(proxy_file.ctx.store, "runs/r1/adapters/v1")
    assert manifest is not None and manifest.meta["dtype"] == "bfloat16"
    g = proxy_file.client("r1", "generator", retries=3)
    assert g.wait_for_version(0, wait_s=0).dtype == "bfloat16"
    redis_server.wipe()  # the record is rebuilt from the manifest, dtype included
    redis_server.start()
    assert g.wait_for_version(0, wait_s=0).dtype == "bfloat16"


def test_auto_takes_the_trainers_one_dtype(proxy_file: ProxyHarness) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec())  # adapter_dtype: auto
    t.register_trainer("t0")
    assert t.publish_adapter(1, tar_of("F32", "F32")).dtype == "float32"
    assert t.publish_adapter(2, tar_of("F16")).dtype == "float16"
    with pytest.raises(errors.Invalid, match="found bfloat16, float32"):
        t.publish_adapter(3, tar_of("F32", "BF16"))


def test_a_generator_refuses_weights_not_in_the_announced_dtype(proxy_file: ProxyHarness, tmp_path: Path) -> None:
    t = proxy_file.client("r1", "trainer")
    t.put_run(make_spec())
    t.register_trainer("t0")
    t.publish_adapter(1, tar_of("BF16"))
    g, cache = proxy_file.client("r1", "generator"), tmp_path / "cache"
    cache.mkdir()
    with pytest.raises(errors.Invalid) as err:
        fetch_adapter(g, 1, cache, expected_dtype="float32")
    assert err.value.code == "adapter_dtype_mismatch" and not err.value.retryable
    assert "adapter v1: its weights are bfloat16 but" in err.value.message, err.value.message
    assert list(cache.iterdir()) == [], "nothing is left in the cache"
    path = fetch_adapter(g, 1, cache, expected_dtype="bfloat16")
    assert file_dtype(path) == "bfloat16"
