"""What a run spec may make this generator do: the operator's allow-lists (the trust model in docs/deploy.md).

A trainer or admin token sets the run spec. Its ``reward.name`` may be ``module:function`` (the generator
imports and runs that module) and its ``dataset.uri`` a local path or hub name (the generator reads it). A
generator operator who does not trust every trainer narrows both before anything is imported or read:

    BUCKETRL_ALLOWED_REWARD_MODULES=my_rewards           # 'module:function' (and env 'module:Class') only
                                                         # from my_rewards(.*)
    BUCKETRL_ALLOWED_DATASET_LOCATIONS=bucket:,toy:,/data/datasets/

``*`` (the default) allows anything; an empty value allows only the built-in rewards and the ``toy:`` and
``bucket:`` datasets. A refusal is a :class:`~bucketrl.preflight.ConfigError` naming the setting (exit code 2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bucketrl.datasets import _local_path  # what load_examples reads as a local file or directory
from bucketrl.envs.loader import VERIFIERS_PREFIX
from bucketrl.envs.verifiers_env import imported_modules
from bucketrl.preflight import ConfigError
from bucketrl.rewards import BUILTIN
from bucketrl.wire import RunSpec

ALWAYS_DATASETS = ("toy:", "bucket:")


def _entries(raw: str) -> list[str] | None:
    """None = anything ('*'); else the comma-separated entries."""
    if raw.strip() == "*":
        return None
    return [e.strip() for e in raw.split(",") if e.strip()]


def check_reward(name: str, allowed: str) -> None:
    if name in BUILTIN or ":" not in name:
        return  # built-ins are part of bucketrl; a bad plain name is the preflight's error
    entries = _entries(allowed)
    if entries is None:
        return
    module = name.partition(":")[0]
    if not any(module == e or module.startswith(e + ".") for e in entries):
        raise ConfigError(
            f"reward.name {name!r}: module {module!r} is not in this generator's BUCKETRL_ALLOWED_REWARD_MODULES "
            f"({allowed!r}); the generator's operator must allow it, or the run must use a built-in reward "
            f"({', '.join(sorted(BUILTIN))})"
        )


def _is_path(entry: str) -> bool:
    return entry.startswith(("/", "./", "../", "file://"))


def _absolute(path: str | Path) -> Path:
    return Path(os.path.abspath(str(path).removeprefix("file://")))  # normalises '..' without touching the disk


def check_dataset(uri: str, allowed: str) -> None:

    entries = _entries(allowed)
    if entries is None or uri.startswith(ALWAYS_DATASETS):
        return
    local = _local_path(uri)
    for e in entries:
        if _is_path(e) and local is not None and _absolute(local).is_relative_to(_absolute(e)):
            return
        if not _is_path(e) and local is None and uri.startswith(e):
            return
    raise ConfigError(
        f"dataset.uri {uri!r} is not in this generator's BUCKETRL_ALLOWED_DATASET_LOCATIONS ({allowed!r}); the "
        "generator's operator must allow it, or the run must upload its dataset (dataset.uri 'bucket:dataset.jsonl')"
    )


def check_env(name: str, allowed: str, kwargs: dict[str, Any] | None = None) -> None:
    """A run's ``env.name`` 'module:Class' is imported like a reward module: the same allow-list admits it. A
    ``verifiers:<taskset>`` env imports its taskset's module and every plugin its kwargs name (harness, env and
    judge ids, reward ``fn`` paths): each must be admitted (an entry ``verifiers`` admits verifiers' built-ins)."""

    if ":" not in name or name.startswith("toy:"):
        return  # built-ins ('toy:tools', 'external') are part of bucketrl
    entries = _entries(allowed)
    if entries is None:
        return
    if name.startswith(VERIFIERS_PREFIX):
        modules = imported_modules(name.removeprefix(VERIFIERS_PREFIX), kwargs or {})
    else:
        modules = [name.partition(":")[0]]
    for module in modules:
        if not any(module == e or module.startswith(e + ".") for e in entries):
            raise ConfigError(
                f"env.name {name!r}: module {module!r} is not in this generator's BUCKETRL_ALLOWED_REWARD_MODULES "
                f"({allowed!r}, which admits environment modules too); the generator's operator must allow it"
            )


def check_spec(spec: RunSpec, allowed_reward_modules: str, allowed_dataset_locations: str) -> None:
    """ConfigError unless this generator's allow-lists admit the run's reward and environment modules and its
    dataset location."""
    check_reward(spec.reward.name, allowed_reward_modules)
    if spec.env is not None:
        check_env(spec.env.name, allowed_reward_modules, spec.env.kwargs)
    check_dataset(spec.dataset.uri, allowed_dataset_locations)
