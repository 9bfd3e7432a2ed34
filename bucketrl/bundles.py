"""What an adapter and a checkpoint must hold: checked where they enter the bucket and where they leave it.

An adapter is exactly the PEFT files::

    adapter_config.json          a JSON object naming its ``peft_type``
    adapter_model.safetensors    the weights (safetensors: a JSON header and raw tensor bytes, never a pickle)

plus, optionally, the ``README.md`` model card ``PeftModel.save_pretrained`` writes beside them (text nobody
loads: refusing it would only make every directory PEFT saves unpublishable). Anything else (an
``adapter_model.bin``, which PEFT and vLLM would ``torch.load``, i.e. unpickle) is refused.
A checkpoint (``bucketrl.trainer.checkpoint``) holds ``state.json``, the adapter under ``adapter/`` and the
optimizer and RNG state as safetensors + JSON pairs; again nothing a loader would unpickle.

The proxy checks a tar at publish (422 naming the problem, nothing stored); the generator checks what it
downloaded before its engine sees it. Both learn the adapter's dtype from the check (:func:`check_adapter_tar`
returns it: every weight of an adapter is float32, bfloat16 or float16, all the same), and each compares it
with what it was told (the run spec's ``adapter_dtype``, the version's announced dtype). Imports nothing heavier
than the standard library.
"""

from __future__ import annotations

import json
import struct
import tarfile
from collections.abc import Callable, Iterable
from typing import IO, Any

from bucketrl import errors

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS)
ADAPTER_OPTIONAL = ("README.md",)
CHECKPOINT_FILES = (
    "state.json",
    f"adapter/{ADAPTER_CONFIG}",
    f"adapter/{ADAPTER_WEIGHTS}",
    "optimizer.json",
    "optimizer.safetensors",
    "rng.json",
    "rng.safetensors",
)
MAX_JSON_BYTES = 16 * 1024 * 1024
# safetensors' own loader refuses headers over 100 MB.
MAX_SAFETENSORS_HEADER = 100_000_000
_DTYPES = {"BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64"} | {
    "F8_E4M3",
    "F8_E5M2",
}

# safetensors dtype -> the name the run spec, the manifest and torch use, for the dtypes an adapter may ship in.
WEIGHT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}

Reader = Callable[[int], bytes]


def check_json_object(raw: bytes, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise errors.Invalid(f"{where}: not JSON ({str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise errors.Invalid(f"{where}: must be a JSON object")
    return obj


def check_safetensors(read: Reader, size: int, where: str) -> set[str]:
    """The header of a safetensors file (``read(n)`` gives its next n bytes): every tensor's dtype, shape and
    byte range consistent and inside the file. Returns the safetensors dtypes it holds (``F32``, ``BF16``...)."""
    if size < 8:
        raise errors.Invalid(f"{where}: {size} bytes is too short for a safetensors file")
    (n,) = struct.unpack("<Q", read(8))
    if n > min(MAX_SAFETENSORS_HEADER, size - 8):
        raise errors.Invalid(f"{where}: not a safetensors file (header length {n} for a {size}-byte file)")
    header = check_json_object(read(n), f"{where} header")
    data = size - 8 - n
    dtypes: set[str] = set()
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise errors.Invalid(f"{where}: tensor {name[:60]!r} has no description")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in _DTYPES:
            raise errors.Invalid(f"{where}: tensor {name[:60]!r} has an unknown dtype {str(dtype)[:20]!r}")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise errors.Invalid(f"{where}: tensor {name[:60]!r} has a bad shape")
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise errors.Invalid(f"{where}: tensor {name[:60]!r} points outside the file's {data} data bytes")
        dtypes.add(dtype)
    return dtypes


def weights_dtype(dtypes: set[str], where: str) -> str:
    """The one dtype (``float32``, ``bfloat16``, ``float16``) of an adapter's weights; Invalid for none, a mix, or
    any other dtype (a consumer could not tell what it is serving)."""
    names = {WEIGHT_DTYPES.get(d, d) for d in dtypes}
    if len(names) != 1 or not names <= set(WEIGHT_DTYPES.values()):
        raise errors.Invalid(
            f"{where}: the adapter's weights must all be one of {', '.join(WEIGHT_DTYPES.values())}, "
            f"found {', '.join(sorted(names)) or 'no tensors'}"
        )
    return names.pop()


def check_members(names: Iterable[str], required: Iterable[str], what: str, optional: Iterable[str] = ()) -> None:
    have, want = set(names), set(required)
    if missing := sorted(want - have):
        raise errors.Invalid(f"{what} lacks {', '.join(missing)} (it must hold exactly {', '.join(sorted(want))})")
    if extra := sorted(have - want - set(optional)):
        raise errors.Invalid(
            f"{what} holds {', '.join(x[:80] for x in extra[:5])}, which is not allowed (it must hold exactly "
            f"{', '.join(sorted(want))}; weights only as safetensors, never a pickle)"
        )


def _check_contents(files: dict[str, tuple[Reader, int]], prefix: str, what: str) -> str:
    read, size = files[prefix + ADAPTER_CONFIG]
    if size > MAX_JSON_BYTES:
        raise errors.Invalid(f"{what}: {ADAPTER_CONFIG} is {size} bytes")
    config = check_json_object(read(size), f"{what}: {prefix}{ADAPTER_CONFIG}")
    if not isinstance(config.get("peft_type"), str):
        raise errors.Invalid(f"{what}: {prefix}{ADAPTER_CONFIG} names no peft_type (not a PEFT adapter config)")
    read, size = files[prefix + ADAPTER_WEIGHTS]
    where = f"{what}: {prefix}{ADAPTER_WEIGHTS}"
    return weights_dtype(check_safetensors(read, size, where), where)


def check_adapter_tar(fileobj: IO[bytes]) -> str:
    """Invalid (naming the problem) unless the tar is exactly a PEFT adapter; returns its weights' dtype
    (``float32``, ``bfloat16`` or ``float16``). Leaves ``fileobj`` at 0."""
    with _members(fileobj) as files:
        check_members(files, ADAPTER_FILES, "the adapter", ADAPTER_OPTIONAL)
        return _check_contents(files, "", "the adapter")


def check_dtype(got: str, want: str | None, what: str, source: str) -> None:
    """Invalid (code ``adapter_dtype_mismatch``) when an adapter's weights are not in the dtype ``source`` says
    (``want``; None or ``auto``: any)."""
    if want not in (None, "auto") and got != want:
        raise errors.Invalid(f"{what}: its weights are {got} but {source} says {want}", code="adapter_dtype_mismatch")


def check_checkpoint_tar(fileobj: IO[bytes]) -> None:
    """Invalid unless the tar holds exactly a checkpoint's files, with a PEFT adapter and safetensors state."""
    with _members(fileobj) as files:
        check_members(files, CHECKPOINT_FILES, "the checkpoint")
        _check_contents(files, "adapter/", "the checkpoint")
        for stem in ("optimizer", "rng"):
            read, size = files[f"{stem}.safetensors"]
            check_safetensors(read, size, f"the checkpoint: {stem}.safetensors")
        for name in ("state.json", "optimizer.json", "rng.json"):
            read, size = files[name]
            if size > MAX_JSON_BYTES:
                raise errors.Invalid(f"the checkpoint: {name} is {size} bytes")
            check_json_object(read(size), f"the checkpoint: {name}")


class _members:
    """name -> (reader, size) of a tar's regular files; the tar stays open inside ``with``."""

    def __init__(self, fileobj: IO[bytes]) -> None:
        self.fileobj = fileobj
        self.tar: tarfile.TarFile | None = None

    def __enter__(self) -> dict[str, tuple[Reader, int]]:
        self.fileobj.seek(0)
        try:
            self.tar = tarfile.open(fileobj=self.fileobj, mode="r:")
            out: dict[str, tuple[Reader, int]] = {}
            for info in self.tar:
                if info.isdir():
                    continue
                name = info.name.removeprefix("./")
                if name.startswith("/") or ".." in name.split("/"):
                    raise errors.Invalid(f"unsafe tar member name {info.name[:80]!r}")
                src = self.tar.extractfile(info) if info.isreg() and not info.issparse() else None
                if src is None:
                    raise errors.Invalid(f"tar member {info.name[:80]!r} is not a regular file")
                out[name] = (src.read, info.size)
            return out
        except (tarfile.TarError, EOFError) as exc:
            raise errors.Invalid(f"body is not an uncompressed tar archive: {exc}") from None

    def __exit__(self, *exc: object) -> None:
        if self.tar is not None:
            self.tar.close()
        self.fileobj.seek(0)
