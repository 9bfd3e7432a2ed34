"""``bucketrl export``: write one adapter version (default: the latest) as a plain PEFT folder.

    bucketrl export out/adapter                         # the last `bucketrl up` from here, latest version
    bucketrl export out/adapter --dir runs/demo --version 40
    bucketrl export out/adapter --proxy http://proxy:8000 --run demo --token $GENERATOR_TOKEN  # a generator token

The folder holds ``adapter_config.json`` and ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base,
"out/adapter")`` loads it, and so does vLLM (``--enable-lora --lora-modules mine=out/adapter``). With a run
directory the version is read from its bucket directly (the proxy need not run); with ``--proxy`` it is
downloaded (sha256 checked). Either way the tar streams to a file beside the folder, is checked as the
generator checks it (exactly the PEFT files, nothing a loader would unpickle) and is unpacked from there:
memory stays bounded whatever the adapter's size. Only committed versions exist (the proxy garbage-collects
old ones; the latest is always kept). Exit codes: 0 written, 1 not found or unreachable, 2 bad usage.

The folder's weights are float32. A run whose versions ship in bfloat16 (``adapter_dtype``, docs/scale.md) keeps
no float32 copy of them in the bucket: export then reads the trainer's float32 master weights of that version from
a checkpoint taken at the step that published it (``state.json``: ``policy_version`` = the version and
``policy_step`` = ``step``; the trainer checkpoints right after publishing, so the latest version usually has one).
A version no such checkpoint holds, or one asked of a proxy (which serves checkpoints to trainers only), is
refused with the versions that can be exported, unless ``--as-shipped`` takes the weights as they were shipped.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Annotated

import typer

from bucketrl import bundles, errors
from bucketrl.client import ProxyClient
from bucketrl.status_cli import last_up_dir
from bucketrl.storage import open_store
from bucketrl.storage.dirs import FILES, iter_bundle, list_dirs, read_manifest
from bucketrl.tarball import pack_dir, unpack

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class ExportError(Exception):
    pass


def _bucket_url(run_dir: Path) -> str:
    """The bucket of a `bucketrl up` run directory (its saved options, else the default file:// bucket)."""
    saved = run_dir / "up_options.json"
    if saved.exists():
        url = json.loads(saved.read_text()).get("bucket_url")
        if url:
            return str(url)
    return f"file://{(run_dir / 'bucket').resolve()}"


def _run_of(run_dir: Path) -> str:
    for name in ("endpoint.json", "up_options.json"):
        path = run_dir / name
        if path.exists():
            run = json.loads(path.read_text()).get("run")
            if run:
                return str(run)
    return "demo"


def adapter_bytes_from_bucket(bucket_url: str, run: str, version: int | None) -> tuple[int, bytes]:
    """(version, tar) of a committed adapter version read from the bucket; the newest when ``version`` is None."""
    buf = io.BytesIO()
    got = adapter_tar_from_bucket(bucket_url, run, version, buf)
    return got, buf.getvalue()


def adapter_tar_from_bucket(bucket_url: str, run: str, version: int | None, out: IO[bytes]) -> int:
    """Write a committed adapter version's tar (the newest when ``version`` is None) into ``out`` chunk by chunk;
    returns the version."""
    from bucketrl.proxy.state.versions import adapter_prefix

    store = open_store(bucket_url)
    try:
        if version is None:
            names = [n for n in list_dirs(store, f"runs/{run}/adapters") if n.startswith("v") and n[1:].isdigit()]
            if not names:
                raise ExportError(f"run {run!r} has no adapter versions in {bucket_url}")
            version = int(names[-1][1:])
        prefix = adapter_prefix(run, version)
        if read_manifest(store, prefix) is None:
            raise ExportError(f"run {run!r} has no version {version} in {bucket_url} (old versions are deleted)")
        for chunk in iter_bundle(store, prefix):
            out.write(chunk)
        return version
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def adapter_tar_from_proxy(proxy: str, run: str, token: str, version: int | None, out: IO[bytes]) -> int:
    """Stream an adapter version's tar (the latest when ``version`` is None) into ``out`` (sha256 checked against
    the proxy's header): an adapter of any size costs one chunk of memory. Returns the version."""

    with ProxyClient(proxy, run, token, retries=1, timeout_s=60.0) as client:
        if version is None:
            version = client.get_run().state.latest_version
            if version < 1:
                raise ExportError(f"run {run!r} has no adapter versions yet")
        client.download_adapter_to(version, out)
        return version


def float32_from_checkpoint(bucket_url: str, run: str, version: int, out: IO[bytes]) -> int | None:
    """Write into ``out`` the adapter tar of the float32 master weights of ``version``, read from a checkpoint
    taken at the step that published it; returns that checkpoint's step, or None when no checkpoint holds them."""
    from bucketrl.proxy.state.checkpoints import checkpoint_prefix

    store = open_store(bucket_url)
    try:
        steps = [int(n[5:]) for n in list_dirs(store, f"runs/{run}/checkpoints") if n.startswith("step-")]
        for step in sorted(steps, reverse=True):
            prefix = checkpoint_prefix(run, step)
            files = f"{prefix}/{FILES}/"
            state = json.loads(store.get_bytes(files + "state.json"))
            if state.get("policy_version") != version or state.get("policy_step") != state.get("step"):
                continue
            with tempfile.TemporaryDirectory(prefix=".export-ckpt-") as tmp:
                for name in ADAPTER_FILES:
                    with open(Path(tmp) / name, "wb") as fh:
                        for chunk in store.iter_chunks(files + f"adapter/{name}"):
                            fh.write(chunk)
                out.write(pack_dir(tmp))
            return step
        return None
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def tar_dtype(tar: Path) -> str:
    """The dtype of an adapter tar's weights (ExportError if it is not a usable adapter)."""
    with tar.open("rb") as fh:
        try:
            return bundles.check_adapter_tar(fh)
        except Exception as exc:  # a hostile tar: Invalid, tarfile errors, MemoryError...
            raise ExportError(f"not a usable adapter tar: {getattr(exc, 'message', None) or exc}") from None


def write_peft_folder(tar: bytes | Path, out: Path) -> Path:
    """Unpack the adapter tar (bytes or a file) into ``out`` (created; an existing adapter folder is replaced,
    nothing else is). The tar is checked first as the generator checks it (exactly the PEFT files, a JSON
    config, safetensors weights: nothing a loader would unpickle), then unpacked member by member from the
    file, none larger than the tar."""

    if out.exists() and any(out.iterdir()) and not all((out / f).exists() for f in ADAPTER_FILES):
        raise ExportError(f"{out} exists and is not an adapter folder: choose an empty or new directory")
    size = len(tar) if isinstance(tar, bytes) else tar.stat().st_size
    with io.BytesIO(tar) if isinstance(tar, bytes) else tar.open("rb") as fh:
        try:
            bundles.check_adapter_tar(fh)
        except Exception as exc:  # a hostile tar: Invalid, tarfile errors, MemoryError...
            raise ExportError(f"not a usable adapter tar: {getattr(exc, 'message', None) or exc}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out.parent) as tmp:
        allowed = dict.fromkeys((*bundles.ADAPTER_FILES, *bundles.ADAPTER_OPTIONAL), size)
        names = unpack(tar, tmp, max_bytes=size, expected=allowed)
        missing = [f for f in ADAPTER_FILES if f not in names]
        if missing:
            raise ExportError(f"the adapter bundle lacks {missing}")
        if out.exists():
            shutil.rmtree(out)
        Path(tmp).rename(out)
        Path(tmp).mkdir()  # TemporaryDirectory removes what it created
    return out


Float32Source = Callable[[int, IO[bytes]], int | None]


def export_adapter(
    out: Path,
    version: int | None,
    fetch: Callable[[int | None, IO[bytes]], int],
    float32: Float32Source | None = None,
    *,
    as_shipped: bool = False,
) -> tuple[int, Path]:
    """``fetch(version, file)`` writes the tar into a file beside ``out`` (on disk, never whole in memory), which
    is checked and unpacked from there and removed; returns (version, folder). A version shipped in another dtype
    than float32 is replaced by ``float32(version, file)``'s tar (the master weights from a checkpoint; None: none
    holds them, ExportError) unless ``as_shipped``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(prefix=".export-", suffix=".tar", dir=out.parent) as fh:
        got = fetch(version, fh)
        fh.flush()
        dtype = tar_dtype(Path(fh.name))
        if dtype == "float32" or as_shipped:
            return got, write_peft_folder(Path(fh.name), out)
        fh.seek(0)
        fh.truncate()
        if float32 is None or float32(got, fh) is None:
            where = "a checkpoint (none taken at the step that published it)" if float32 else "a proxy"
            raise ExportError(
                f"v{got} was shipped in {dtype} and its float32 weights cannot be read from {where}: export the "
                "version of a checkpoint from the run directory (--dir), or pass --as-shipped for the "
                f"{dtype} weights"
            )
        fh.flush()
        return got, write_peft_folder(Path(fh.name), out)


def export_command(
    out: Annotated[Path, typer.Argument(help="Directory to write the PEFT adapter folder to.")],
    version: Annotated[int | None, typer.Option(help="Adapter version (default: the latest).")] = None,
    dir: Annotated[
        Path | None, typer.Option("--dir", help="A `bucketrl up` run directory (default: the last one from here).")
    ] = None,
    proxy: Annotated[str | None, typer.Option(help="Proxy base URL (instead of --dir).")] = None,
    run: Annotated[str | None, typer.Option(help="Run id (with --proxy; default BUCKETRL_RUN).")] = None,
    token: Annotated[str | None, typer.Option(help="Token (with --proxy; default BUCKETRL_TOKEN).")] = None,
    as_shipped: Annotated[
        bool,
        typer.Option(
            "--as-shipped",
            help="Write the weights in the dtype the version was shipped in (bfloat16 runs) instead of float32.",
        ),
    ] = False,
) -> None:
    """Write an adapter version (default: the latest) as a plain PEFT folder."""

    if version is not None and version < 1:
        typer.echo("bucketrl export: --version must be >= 1", err=True)
        raise typer.Exit(code=2)
    try:
        if proxy is not None:
            run_id, tok = run or os.environ.get("BUCKETRL_RUN", "demo"), token or os.environ.get("BUCKETRL_TOKEN", "")
            got, path = export_adapter(
                out, version, lambda v, fh: adapter_tar_from_proxy(proxy, run_id, tok, v, fh), as_shipped=as_shipped
            )
        else:
            run_dir = dir or last_up_dir()
            if run_dir is None:
                typer.echo("bucketrl export: pass --dir <run directory> (or --proxy, --run, --token)", err=True)
                raise typer.Exit(code=2)
            url, run_id = _bucket_url(run_dir), run or _run_of(run_dir)
            got, path = export_adapter(
                out,
                version,
                lambda v, fh: adapter_tar_from_bucket(url, run_id, v, fh),
                lambda v, fh: float32_from_checkpoint(url, run_id, v, fh),
                as_shipped=as_shipped,
            )
    except (ExportError, errors.BucketRLError, ValueError, OSError) as exc:
        typer.echo(f"bucketrl export: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"wrote adapter v{got} to {path} (PeftModel.from_pretrained(base, {str(path)!r}))")
