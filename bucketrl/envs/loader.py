"""A run's ``env.name`` as an environment instance (the names are listed in :mod:`bucketrl.envs.protocol`)."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from typing import Any

from bucketrl import errors
from bucketrl.envs.verifiers_env import PREFIX as VERIFIERS_PREFIX
from bucketrl.envs.verifiers_env import load_verifiers_env

BUILTIN_ENVS = {"toy:tools": "bucketrl.envs.toy_tools:ToyToolsEnv"}


def resolve_env_class(name: str) -> type:
    """The class ``name`` means (``Invalid`` with the reason when there is none)."""
    target = BUILTIN_ENVS.get(name, name)
    if ":" not in target:
        raise errors.Invalid(f"env.name {name!r} is not one of {sorted(BUILTIN_ENVS)}, 'external' or 'module:Class'")
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:  # like reward modules: the user's module beside them
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise errors.Invalid(f"env.name {name!r}: cannot import {module_name!r}: {exc!r}") from exc
    cls = getattr(module, attr, None)
    if not inspect.isclass(cls) or not callable(getattr(cls, "rollout", None)):
        raise errors.Invalid(f"env.name {name!r}: {module_name!r} has no class {attr!r} with a rollout method")
    return cls


def make_env(name: str, kwargs: dict[str, Any]) -> Any:
    if name.startswith(VERIFIERS_PREFIX):
        return load_verifiers_env(name.removeprefix(VERIFIERS_PREFIX), kwargs)
    cls = resolve_env_class(name)
    try:
        return cls(**kwargs)
    except Exception as exc:
        raise errors.Invalid(f"env.name {name!r}: {cls.__name__}(**env.kwargs) failed: {exc!r}") from exc
