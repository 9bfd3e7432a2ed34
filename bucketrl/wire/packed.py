"""Numeric arrays packed as typed bytes on the msgpack wire (token ids, logprobs).

A rollout group is almost all numbers (8 x 256 token ids and as many logprobs). As JSON or plain msgpack every
number is a separate item that the proxy decodes into a Python object and pydantic then checks one by one;
that was a fifth of the proxy's CPU per submitted group. Packed, an array is one msgpack ext object (its
items as little-endian int32, float32 or float64 bytes) that the proxy checks in a few numpy passes and
stores as it came.

How it stays generic: a wire model types such a field with :class:`NumericArray` (``TokenIds`` and
``Logprobs`` in ``rollouts.py``). The field accepts a plain list (JSON, plain msgpack, Python code) or a packed
ext object, and :func:`packb` (the msgpack of ``model_dump(mode="json")``) packs every field so typed, in
nested models and lists of them too: a field added later with one of these types is packed and checked with
no other change; any other field travels as plain msgpack. A decoder needs no hook: msgpack hands an unknown
ext type back as :class:`msgpack.ExtType`, which these fields accept.

Validation gives lists by default (what Python code expects), or the numpy arrays themselves with
``context=KEEP_ARRAYS`` (the proxy: it checks and stores the bytes it received, and never builds the lists).
float32 is used only where it is exact (logprobs sampled in float32 are), so packing never changes a value.
"""

from __future__ import annotations

import functools
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import msgpack
import numpy as np
from pydantic import BaseModel
from pydantic_core import PydanticCustomError, core_schema

# msgpack ext type codes (application range 0..127): the array's dtype, always little-endian.
EXT_INT32 = 17
EXT_FLOAT32 = 18
EXT_FLOAT64 = 19
_DTYPES = {EXT_INT32: "<i4", EXT_FLOAT32: "<f4", EXT_FLOAT64: "<f8"}
_NAMES = {EXT_INT32: "int32", EXT_FLOAT32: "float32", EXT_FLOAT64: "float64"}
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
M = TypeVar("M", bound=BaseModel)

# model_validate(..., context=KEEP_ARRAYS): packed fields stay numpy arrays (read-only views of the bytes).
KEEP_ARRAYS = {"packed_arrays": "keep"}


_SIZES = {EXT_INT32: 4, EXT_FLOAT32: 4, EXT_FLOAT64: 8}


@dataclass(frozen=True)
class NumericArray:
    """Annotation of a ``list[int]`` / ``list[float]`` field that may arrive packed (see the module docstring).

    ``kind``: "int" (packed as int32) or "float" (float32 when exact, else float64). The length bounds and the
    value rule (``non_negative`` ints; ``logprob``: finite and <= 0) apply to both forms alike."""

    kind: Literal["int", "float"]
    min_length: int = 0
    max_length: int | None = None
    non_negative: bool = False
    logprob: bool = False

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        item = core_schema.int_schema() if self.kind == "int" else core_schema.float_schema(allow_inf_nan=False)
        # fail_fast: one error for a list of two million bad items, not two million
        as_list = core_schema.list_schema(item, min_length=self.min_length, max_length=self.max_length, fail_fast=True)
        return core_schema.with_info_wrap_validator_function(self._validate, as_list)

    def _validate(self, value: Any, handler: Any, info: core_schema.ValidationInfo) -> Any:
        name = info.field_name or "array"
        if isinstance(value, msgpack.ExtType):
            ctx = info.context
            deferred = ctx.get("deferred") if ctx is not None else None
            arr = self._unpack(value, name, check_values=deferred is None)
            if deferred is not None:
                deferred.append((self, arr))
            return arr if ctx is not None and ctx.get("packed_arrays") == "keep" else arr.tolist()
        out = handler(value)
        self._check_values(out, name)
        return out

    def _unpack(self, ext: msgpack.ExtType, name: str, check_values: bool = True) -> Any:
        dtype = _DTYPES.get(ext.code)
        allowed = (EXT_INT32,) if self.kind == "int" else (EXT_FLOAT32, EXT_FLOAT64)
        if ext.code not in allowed:
            want = "int32" if self.kind == "int" else "float32 or float64"
            got = _NAMES.get(ext.code, f"msgpack ext type {ext.code}")
            raise PydanticCustomError("packed_array", f"a packed {got} array; {name} must be {want}")
        size = _SIZES[ext.code]
        if len(ext.data) % size:
            raise PydanticCustomError(
                "packed_array", f"packed {_NAMES[ext.code]} data of {len(ext.data)} bytes is not whole items"
            )
        arr = np.frombuffer(ext.data, dtype=dtype)
        if len(arr) < self.min_length or (self.max_length is not None and len(arr) > self.max_length):
            raise PydanticCustomError(
                "packed_array",
                f"{len(arr)} items; {name} must have {self.min_length} to {self.max_length} items",
            )
        if not len(arr) or not check_values:
            return arr
        if self.non_negative and arr.min() < 0:
            i = int(np.argmax(arr < 0))
            raise PydanticCustomError("packed_array", f"{name} must be >= 0 ({name}[{i}] = {int(arr[i])})")
        if self.logprob and not (np.isfinite(arr).all() and arr.max() <= 0.0):
            i = int(np.argmax(~(np.isfinite(arr) & (arr <= 0.0))))
            raise PydanticCustomError("packed_array", f"{name}[{i}] = {float(arr[i])!r} is not a finite value <= 0")
        return arr

    def _check_values(self, values: list[Any], name: str) -> None:
        if not values:
            return
        if self.non_negative and min(values) < 0:
            raise ValueError(f"{name} must be >= 0")
        if self.logprob and not all_finite_non_positive(values):
            for i, lp in enumerate(values):  # the slow walk only to name the bad entry
                if not math.isfinite(lp) or lp > 0.0:
                    raise ValueError(f"{name}[{i}] = {lp!r} is not a finite value <= 0")


def validate_keeping_arrays(model: type[M], obj: Any) -> M:
    """``model.model_validate(obj, strict=True, context=KEEP_ARRAYS)`` with the value rules of all its packed
    arrays checked together: one numpy pass per rule over the concatenated arrays instead of a few per array
    (each numpy call costs microseconds whatever the array's size, and a group has 17 arrays). When a rule
    fails, the model is validated again array by array, which raises the error naming the field."""
    deferred: list[tuple[NumericArray, Any]] = []
    out = model.model_validate(obj, strict=True, context={**KEEP_ARRAYS, "deferred": deferred})
    if deferred and not _values_ok(deferred):
        model.model_validate(obj, strict=True, context=KEEP_ARRAYS)
        raise AssertionError("a packed array broke its rule in the combined pass but not alone")  # pragma: no cover
    return out


def _values_ok(deferred: list[tuple[NumericArray, Any]]) -> bool:
    non_negative = [a for rule, a in deferred if rule.non_negative and len(a)]
    if non_negative and np.concatenate(non_negative).min() < 0:
        return False
    logprobs = [a for rule, a in deferred if rule.logprob and len(a)]
    if logprobs:
        joined = np.concatenate(logprobs)  # float32 and float64 arrays: float64, exactly
        if not (np.isfinite(joined).all() and joined.max() <= 0.0):
            return False
    return True


def all_finite_non_positive(values: list[float]) -> bool:
    """True iff every value is finite and <= 0, in C-speed passes (this runs on every completion a plain-list
    body carries). A NaN or an infinity makes the sum non-finite (so does a sum overflowing, in which case the
    caller's exact walk decides); with none of them, ``max`` orders the values correctly."""
    return math.isfinite(sum(values)) and max(values) <= 0.0


def pack_array(values: Any, kind: Literal["int", "float"]) -> Any:
    """One array as a msgpack ext object; the plain list when it cannot be packed exactly (an int outside
    int32 or a non-number: the receiver then refuses it with its usual message)."""
    try:
        if kind == "int":
            arr = np.asarray(values, dtype=np.int64)
            if arr.ndim != 1 or (len(arr) and (arr.min() < _INT32_MIN or arr.max() > _INT32_MAX)):
                return values
            return msgpack.ExtType(EXT_INT32, arr.astype("<i4").tobytes())
        arr = np.asarray(values, dtype="<f8")
    except (TypeError, ValueError, OverflowError):
        return values
    if arr.ndim != 1:
        return values
    narrow = arr.astype("<f4")
    if np.array_equal(narrow, arr):  # exact (NaN never is: it stays float64, and the receiver refuses it)
        return msgpack.ExtType(EXT_FLOAT32, narrow.tobytes())
    return msgpack.ExtType(EXT_FLOAT64, arr.tobytes())


# -- the packing plan of a model class: which fields are packed, which hold models to recurse into ----------


@functools.cache
def _plan(cls: type[BaseModel]) -> dict[str, Any]:
    plan: dict[str, Any] = {}
    for name, field in cls.model_fields.items():
        numeric = next((m for m in field.metadata if isinstance(m, NumericArray)), None)
        step = numeric.kind if numeric is not None else _nested(field.annotation)
        if step is not None:
            plan[field.serialization_alias or name] = step
    return plan


def _nested(annotation: Any) -> Any:
    """How to walk a value of ``annotation``: a model class, ("list", step), or None (nothing packed inside)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        args = typing.get_args(annotation)
        numeric = next((m for m in args[1:] if isinstance(m, NumericArray)), None)
        return numeric.kind if numeric is not None else _nested(args[0])
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation if _plan(annotation) else None
    if origin in (list, tuple):
        args = typing.get_args(annotation)
        inner = _nested(args[0]) if args else None
        return ("list", inner) if inner is not None else None
    if origin in (typing.Union, types.UnionType):  # X | None, or a union of models: the first that packs
        for arg in typing.get_args(annotation):
            inner = _nested(arg)
            if inner is not None:
                return inner
    return None


def _walk(value: Any, step: Any) -> Any:
    if value is None:
        return None
    if step in ("int", "float"):
        return pack_array(value, step)
    if isinstance(step, tuple):
        return [_walk(v, step[1]) for v in value]
    if isinstance(value, dict):
        plan = _plan(step)
        return {k: (_walk(v, plan[k]) if k in plan else v) for k, v in value.items()}
    return value


def packed(model: BaseModel) -> dict[str, Any]:
    """``model.model_dump(mode="json")`` with every :class:`NumericArray` field packed (msgpack-ready)."""
    return _walk(model.model_dump(mode="json", by_alias=True), type(model))


def packb(model: BaseModel) -> bytes:
    """The msgpack of ``model`` with its numeric arrays packed: what ``model_validate`` reads back equal."""
    return msgpack.packb(packed(model), use_bin_type=True)
