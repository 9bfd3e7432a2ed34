"""``bucketrl export``: write one adapter version (default: the latest) as a plain PEFT folder.

    bucketrl export out/adapter                         # the last `bucketrl up` from here, latest version
    bucketrl export out/adapter --dir runs/demo --version 40
    bucketrl export out/adapter --proxy http://proxy:8000 --run demo --token $VIEWER_TOKEN

The folder holds ``adapter_config.json`` and ``adapter_model.safetensors``: ``PeftModel.from_pretrained(base,
"out/adapter")`` loads it, and so does vLLM (``--enable-lora --lora-modules mine=out/adapter``). With a run
directory the version is read from its bucket directly (the proxy need not run); with ``--proxy`` it is
downloaded (sha256 checked). Only committed versions exist (the proxy garbage-collects old ones; the latest is
always kept). Exit codes: 0 written, 1 not found or unreachable, 2 bad usage.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Annotated

import typer

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
    from bucketrl.proxy.state.versions import adapter_prefix
    from bucketrl.storage import open_store
    from bucketrl.storage.dirs import iter_bundle, list_dirs, read_manifest

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
        return version, b"".join(iter_bundle(store, prefix))
    finally:
        close = getattr(store, "close", None)
        if close is not None:
            close()


def adapter_bytes_from_proxy(proxy: str, run: str, token: str, version: int | None) -> tuple[int, bytes]:
    from bucketrl.client import ProxyClient

    with ProxyClient(proxy, run, token, retries=1, timeout_s=60.0) as client:
        if version is None:
            version = client.get_run().state.latest_version
            if version < 1:
                raise ExportError(f"run {run!r} has no adapter versions yet")
        return version, client.download_adapter(version)


def write_peft_folder(tar: bytes, out: Path) -> Path:
    """Unpack the adapter tar into ``out`` (created; an existing adapter folder is replaced, nothing else is)."""
    from bucketrl.tarball import unpack

    if out.exists() and any(out.iterdir()) and not all((out / f).exists() for f in ADAPTER_FILES):
        raise ExportError(f"{out} exists and is not an adapter folder: choose an empty or new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".export-", dir=out.parent) as tmp:
        names = unpack(tar, tmp)
        missing = [f for f in ADAPTER_FILES if f not in names]
        if missing:
            raise ExportError(f"the adapter bundle lacks {missing}")
        if out.exists():
            shutil.rmtree(out)
        Path(tmp).rename(out)
        Path(tmp).mkdir()  # TemporaryDirectory removes what it created
    return out


def export_command(
    out: Annotated[Path, typer.Argument(help="Directory to write the PEFT adapter folder to.")],
    version: Annotated[int | None, typer.Option(help="Adapter version (default: the latest).")] = None,
    dir: Annotated[
        Path | None, typer.Option("--dir", help="A `bucketrl up` run directory (default: the last one from here).")
    ] = None,
    proxy: Annotated[str | None, typer.Option(help="Proxy base URL (instead of --dir).")] = None,
    run: Annotated[str | None, typer.Option(help="Run id (with --proxy; default BUCKETRL_RUN).")] = None,
    token: Annotated[str | None, typer.Option(help="Token (with --proxy; default BUCKETRL_TOKEN).")] = None,
) -> None:
    """Write an adapter version (default: the latest) as a plain PEFT folder."""
    import os

    from bucketrl import errors
    from bucketrl.status_cli import last_up_dir

    if version is not None and version < 1:
        typer.echo("bucketrl export: --version must be >= 1", err=True)
        raise typer.Exit(code=2)
    try:
        if proxy is not None:
            got, tar = adapter_bytes_from_proxy(
                proxy,
                run or os.environ.get("BUCKETRL_RUN", "demo"),
                token or os.environ.get("BUCKETRL_TOKEN", ""),
                version,
            )
        else:
            run_dir = dir or last_up_dir()
            if run_dir is None:
                typer.echo("bucketrl export: pass --dir <run directory> (or --proxy, --run, --token)", err=True)
                raise typer.Exit(code=2)
            got, tar = adapter_bytes_from_bucket(_bucket_url(run_dir), run or _run_of(run_dir), version)
        path = write_peft_folder(tar, out)
    except (ExportError, errors.BucketRLError, ValueError, OSError) as exc:
        typer.echo(f"bucketrl export: {getattr(exc, 'message', None) or exc}", err=True)
        raise typer.Exit(code=1) from None
    typer.echo(f"wrote adapter v{got} to {path} (PeftModel.from_pretrained(base, {str(path)!r}))")
