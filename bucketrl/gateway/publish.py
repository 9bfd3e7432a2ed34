"""An adapter directory on the trainer's disk -> the run's next committed version (blocking; run in a thread).

The tar holds exactly what a bucketrl trainer publishes (``adapter_config.json``, ``adapter_model.safetensors``):
peft's README model card, which TRL's ``save_pretrained`` also writes, is left out so the same weights always give
the same sha256. The version is ``latest + 1``; the proxy answers 409 ``version_conflict`` if another writer took
it, and 200 for a re-sent copy of the latest version's bytes (a retried PUT). If the latest version already holds
these very bytes, it is adopted instead of published twice (a gateway that died between the proxy's commit and
its own name-book write, then got the same load again).
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bucketrl import errors
from bucketrl.bundles import ADAPTER_FILES
from bucketrl.client import ProxyClient
from bucketrl.tarball import pack_dir

PUBLISH_ATTEMPTS = 5


@dataclass(frozen=True)
class Published:
    version: int
    sha256: str
    adopted: bool  # the latest version already held these bytes


def pack_adapter(directory: str | Path) -> bytes:
    root = Path(directory)
    if not root.is_absolute():
        raise errors.Invalid(f"lora_path {str(root)!r} is not absolute (the gateway resolves it, not the trainer)")
    missing = [name for name in ADAPTER_FILES if not (root / name).is_file()]
    if missing:
        raise errors.NotFound(f"{root} holds no {', '.join(missing)} (not a PEFT adapter directory)")
    with tempfile.TemporaryDirectory(prefix="bucketrl-gateway-") as tmp:
        for name in ADAPTER_FILES:
            shutil.copyfile(root / name, Path(tmp) / name)
        return pack_dir(tmp)


def sha256_of(tar: bytes) -> str:
    return hashlib.sha256(tar).hexdigest()


def latest_version(client: ProxyClient) -> tuple[int, str | None]:
    info = client.wait_for_version(after=0, wait_s=0)
    return (info.version, info.sha256) if info is not None else (0, None)


def publish(client: ProxyClient, tar: bytes) -> Published:
    """Commit ``tar`` as the next version (or adopt the latest if it is these bytes); 409s are retried."""
    sha = sha256_of(tar)
    for _ in range(PUBLISH_ATTEMPTS):
        latest, latest_sha = latest_version(client)
        if latest_sha == sha:
            return Published(latest, sha, adopted=True)
        try:
            info = client.publish_adapter(latest + 1, tar)
        except errors.Conflict as exc:
            if exc.code != "version_conflict":
                raise  # fenced: another trainer registered for this run
            continue
        return Published(info.version, info.sha256, adopted=False)
    raise errors.Conflict(f"another writer kept publishing versions of run {client.run!r}; gave up", code="conflict")
