"""Archives from the bucket are someone else's bytes (issue 12): ``tarball.unpack`` and ``bucketrl.bundles``.

A 10 KB tar with a GNU sparse member made a 3 GB allocation; an adapter without its config or with a pickled
``adapter_model.bin`` was accepted; a MemoryError while unpacking was not handled by the generator.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import IO

import pytest

from bucketrl import bundles, errors
from bucketrl.generator import adapters as gen_adapters
from bucketrl.tarball import pack_dir, unpack
from tests.proxy.harness import adapter_files, make_tar, safetensors_bytes


def sparse_tar(real_size: int = 3 * 1024**3) -> bytes:
    """An old-GNU sparse member: ~1 KB on the wire, ``real_size`` bytes once expanded."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("adapter_model.safetensors")
        info.size = 512
        tar.addfile(info, io.BytesIO(b"\0" * 512))
    raw = bytearray(buf.getvalue())
    header = raw[:512]
    header[156:157] = tarfile.GNUTYPE_SPARSE  # type flag 'S'
    # old GNU sparse map at 386: one entry (offset 0, numbytes 512), then realsize at 483 (octal, 12 bytes).
    header[386:398] = b"%011o\0" % 0
    header[398:410] = b"%011o\0" % 512
    header[482:483] = b"\0"  # isextended
    header[483:495] = b"%011o\0" % real_size
    header[148:156] = b" " * 8
    chksum = sum(header)
    header[148:156] = b"%06o\0 " % chksum
    raw[:512] = header
    return bytes(raw)


def test_unpack_refuses_sparse_members_before_allocating_anything(tmp_path: Path) -> None:
    data = sparse_tar()
    assert len(data) < 20_000
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        assert tar.getmembers()[0].issparse()  # the fixture is what it claims to be
    with pytest.raises(ValueError, match="sparse"):
        unpack(data, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing left behind


def test_unpack_refuses_members_larger_than_expected_and_streams_from_a_file(tmp_path: Path) -> None:
    tar = make_tar({"a.json": b"{}", "b.bin": b"x" * 5000})
    with pytest.raises(ValueError, match=r"b\.bin"):
        unpack(tar, tmp_path / "o1", expected={"a.json": 2, "b.bin": 4000})
    with pytest.raises(ValueError, match="not one of the expected"):
        unpack(tar, tmp_path / "o2", expected={"a.json": 2})
    with pytest.raises(ValueError, match="more than 100 bytes"):
        unpack(tar, tmp_path / "o3", max_bytes=100)
    path = tmp_path / "t.tar"
    path.write_bytes(tar)
    assert sorted(unpack(path, tmp_path / "o4", expected={"a.json": 2, "b.bin": 5000})) == ["a.json", "b.bin"]
    assert (tmp_path / "o4" / "b.bin").read_bytes() == b"x" * 5000
    with pytest.raises(ValueError, match=r"truncated|unexpected end"):
        unpack(tar[: len(tar) - 2048 - 4000], tmp_path / "o5")


def test_an_adapter_is_exactly_the_peft_files() -> None:
    good = make_tar(adapter_files("g"))
    bundles.check_adapter_tar(io.BytesIO(good))
    # PEFT's save_pretrained writes a README.md model card beside them: allowed (nobody loads it).
    bundles.check_adapter_tar(io.BytesIO(make_tar({**adapter_files("r"), "README.md": b"# card"})))
    cases = {
        "lacks adapter_config.json": {"adapter_model.safetensors": safetensors_bytes(b"w")},
        "adapter_model.bin": {**adapter_files("p"), "adapter_model.bin": b"\x80\x04pickle"},
        "notes.txt": {**adapter_files("n"), "notes.txt": b"x"},
        "peft_type": {**adapter_files("c"), "adapter_config.json": b'{"r": 8}'},
        "not JSON": {**adapter_files("j"), "adapter_config.json": b"{nope"},
        "not a safetensors file": {**adapter_files("s"), "adapter_model.safetensors": b"\xff" * 64},
    }
    for problem, files in cases.items():
        with pytest.raises(errors.Invalid, match=problem):
            bundles.check_adapter_tar(io.BytesIO(make_tar(files)))
    # A header pointing outside the file.
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}).encode()
    bad = len(header).to_bytes(8, "little") + header + b"\0" * 16
    with pytest.raises(errors.Invalid, match="outside"):
        bundles.check_adapter_tar(io.BytesIO(make_tar({**adapter_files("o"), "adapter_model.safetensors": bad})))


@pytest.mark.parametrize("failure", [MemoryError, RecursionError, ValueError, OSError])
def test_any_unpack_failure_is_a_bad_version_not_a_crash(tmp_path: Path, monkeypatch, failure) -> None:
    """The generator's fetch turns every unpack failure into a non-retryable Invalid (the worker skips the
    version and counts it); a sparse tar and a pickled adapter are refused the same way."""
    good = make_tar(adapter_files("g"))

    class Client:
        data = good

        def download_adapter_to(self, version: int, out: IO[bytes], *, fresh: bool = False) -> str:
            out.write(self.data)
            return hashlib.sha256(self.data).hexdigest()

    def explode(*_a: object, **_k: object) -> list[str]:
        raise failure("boom")

    monkeypatch.setattr(gen_adapters, "unpack", explode)
    with pytest.raises(errors.Invalid, match=f"v3: .*{failure.__name__}") as info:
        gen_adapters.fetch_adapter(Client(), 3, tmp_path)  # type: ignore[arg-type]
    assert not info.value.retryable
    monkeypatch.undo()
    for data, problem in (
        (sparse_tar(), "regular file"),
        (make_tar({**adapter_files("x"), "adapter_model.bin": b"\x80"}), "adapter_model.bin"),
    ):
        Client.data = data
        with pytest.raises(errors.Invalid, match=problem) as info:
            gen_adapters.fetch_adapter(Client(), 4, tmp_path)  # type: ignore[arg-type]
        assert not info.value.retryable
    assert [p.name for p in tmp_path.iterdir()] == []  # no half-unpacked directory left
    Client.data = good
    out = gen_adapters.fetch_adapter(Client(), 5, tmp_path)  # type: ignore[arg-type]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == sorted(bundles.ADAPTER_FILES)


def test_checkpoint_state_round_trips_without_pickles(tmp_path: Path) -> None:
    import random

    import torch

    from bucketrl.trainer.checkpoint import rng_state, set_rng_state
    from bucketrl.trainer.tensor_state import load_state, save_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_state(opt.state_dict(), tmp_path, "optimizer")
    save_state(rng_state(), tmp_path, "rng")
    names = {p.name for p in tmp_path.iterdir()}
    assert names == {"optimizer.json", "optimizer.safetensors", "rng.json", "rng.safetensors"}
    for name in names:
        assert b"\x80\x04" not in (tmp_path / name).read_bytes()[:2]  # not a pickle stream
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters(), lr=0.1)
    opt2.load_state_dict(load_state(tmp_path, "optimizer"))
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for k in a["state"]:
        for name, value in a["state"][k].items():
            assert torch.equal(value, b["state"][k][name])
    # Canonical bytes: the loaded state (its entries in load_state_dict's order) saves to the same files.
    again = tmp_path / "again"
    again.mkdir()
    save_state(opt2.state_dict(), again, "optimizer")
    for name in ("optimizer.json", "optimizer.safetensors"):
        assert (again / name).read_bytes() == (tmp_path / name).read_bytes(), name
    expected = [random.random() for _ in range(3)]
    set_rng_state(load_state(tmp_path, "rng"))
    assert [random.random() for _ in range(3)] == expected
    # The files the trainer writes are what the proxy accepts.
    assert set(bundles.CHECKPOINT_FILES) >= names
    assert pack_dir(tmp_path)


UNPICKLERS = {("torch", "load"), ("pickle", "load"), ("pickle", "loads"), ("pickle", "Unpickler")}


def test_no_worker_code_unpickles() -> None:
    """No worker ever unpickles anything from the bucket (issue 12): no ``torch.load``, ``pickle.load(s)`` or
    ``Unpickler`` anywhere in bucketrl, except the proxy's decoder pool, whose pickles it makes itself (its child
    pickles the models it validated; the parent never passes it anything read from a client or the bucket)."""
    import ast

    import bucketrl

    root = Path(bucketrl.__file__).parent
    allowed = {root / "proxy" / "decode_pool.py"}
    found = []
    for path in sorted(root.rglob("*.py")):
        if path in allowed:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                owner, attr = node.value.id, node.attr
                if (owner, attr) in UNPICKLERS:
                    found.append(f"{path.relative_to(root)}:{node.lineno} ({owner}.{attr})")
            if isinstance(node, ast.ImportFrom) and node.module in {"pickle", "dill", "cloudpickle", "joblib"}:
                found.append(f"{path.relative_to(root)}:{node.lineno} (from {node.module} import ...)")
    assert found == [], found
