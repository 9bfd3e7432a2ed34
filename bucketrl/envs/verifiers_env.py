"""``verifiers`` environments on bucketrl's generators (the optional extra: ``pip install 'bucketrl[verifiers]'``).

A run spec's ``env.name`` ``verifiers:<taskset id>`` runs that ``verifiers`` (v1) environment: the taskset id is
the module verifiers imports (an installed environment package such as one from the Environments Hub, or a module
of yours on the generator's path), ``env.kwargs`` are the rest of its ``EnvConfig`` (``agent.harness``,
``taskset`` options, judges...) plus ``task_from``:

- ``"row"`` (default): each episode's task is built from the bucketrl dataset row: its prompt (a chat row's
  messages) and, when the taskset's task data has an ``answer`` field, its answer.
- ``"taskset"``: the row's index picks the taskset's own task (its ``load()`` order); the run's dataset lists the
  taskset's tasks in that order (a row past the taskset's end fails its episode).

Each episode runs ``Env.run_episode`` with the episode's model name (pinned to its policy version) and the
generator's endpoint as the provider: every model call of the harness goes through verifiers' interception to the
endpoint, which records its tokens and logprobs. The reward is the trace's weighted reward sum (verifiers'
``Trace.reward``; the mean over the trainable traces of a multi-agent env); an env whose tasks declare no reward
returns None, and the run's reward function scores the final reply. An episode verifiers marks failed (the
harness, a reward or a hook raised, a verifiers deadline) fails the bucketrl episode with verifiers' error.

What is changed from verifiers' defaults, and why: an agent whose ``runtime`` is not set runs in the
``subprocess`` runtime (the default, Prime's remote sandboxes, needs an account and a tunnel); an agent's
``max_turns`` is at most the run's ``episode.max_turns`` (verifiers then ends the trace as truncated, and scores
it, instead of bucketrl failing the episode at the limit); retries are off (a retried attempt's model turns would
already be in the episode's trajectory).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import sys
from typing import Any

from pydantic import ValidationError

from bucketrl import errors
from bucketrl.envs.protocol import EpisodeContext, Row

PREFIX = "verifiers:"
TASK_FROM = ("row", "taskset")
# The endpoint's token reaches verifiers' client through this variable (its configs name a variable, never a key).
# verifiers' subprocess runtime strips variables whose name contains API_KEY from the programs it starts.
TOKEN_VAR = "BUCKETRL_ENDPOINT_API_KEY"


class VerifiersEpisodeError(RuntimeError):
    """verifiers marked the episode failed; the message is its first error."""


def _import_verifiers() -> Any:
    if importlib.util.find_spec("verifiers") is None:
        raise errors.Invalid("verifiers environments need the optional extra: pip install 'bucketrl[verifiers]'")
    import verifiers.v1 as vf

    return vf


def load_verifiers_env(taskset: str, kwargs: dict[str, Any]) -> VerifiersEnv:
    """The environment ``verifiers:<taskset>`` names (``errors.Invalid`` with the reason when it cannot be)."""
    try:
        return VerifiersEnv(taskset, **kwargs)
    except errors.Invalid:
        raise
    except Exception as exc:
        raise errors.Invalid(f"env.name {PREFIX}{taskset}: {_first_line(exc)}") from exc


def module_of(taskset: str) -> str:
    """The module verifiers imports for a taskset id (a hub id's ``owner/`` and ``@version`` dropped)."""
    return taskset.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


# The verifiers plugin group of an ``id`` by the key that holds it (a top-level ``id`` names the env).
_GROUPS = {"": "envs", "harness": "harnesses", "taskset": "tasksets", "judges": "judges"}


def imported_modules(taskset: str, kwargs: dict[str, Any]) -> list[str]:
    """The modules ``verifiers:<taskset>`` with ``kwargs`` makes the generator import: the taskset's, and each
    plugin id's and reward/metric ``fn``'s in its config (what the generator's allow-list must admit). A built-in
    verifiers plugin is ``verifiers.v1.<group>.<name>``."""
    out = [_plugin_module("tasksets", taskset)]

    def walk(node: Any, parent: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "id" and isinstance(value, str) and value:
                    out.append(_plugin_module(_GROUPS.get(parent), value))
                elif key == "fn" and isinstance(value, str) and value:
                    module, sep, _ = value.rpartition(":")
                    out.append(module if sep else value.rpartition(".")[0])
                else:
                    walk(value, str(key))
        elif isinstance(node, list):
            for item in node:
                walk(item, parent)

    walk(kwargs, "")
    return list(dict.fromkeys(out))


def _plugin_module(group: str | None, plugin_id: str) -> str:
    module = module_of(plugin_id)
    if group is not None and importlib.util.find_spec("verifiers") is not None:
        builtin = f"verifiers.v1.{group}.{module}"
        with contextlib.suppress(ImportError, ValueError):
            if importlib.util.find_spec(builtin) is not None:
                return builtin
    return module


def _first_line(exc: BaseException) -> str:

    if isinstance(exc, ValidationError) and exc.errors():
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return f"env.kwargs.{where}: {first['msg']}"[:500]
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:500]


class VerifiersEnv:
    def __init__(self, taskset: str, task_from: str = "row", **config: Any) -> None:
        _import_verifiers()
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import resolve_env_config

        # One INFO line per model call (the interception server's aiohttp access log) and per rollout would drown
        # the generator's log; warnings and errors still show.
        for name in ("aiohttp.access", "verifiers"):
            logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
        if os.getcwd() not in sys.path:  # like reward modules and 'module:Class' envs: the user's module beside them
            sys.path.append(os.getcwd())
        module = module_of(taskset)
        if not module or "." in module:
            raise errors.Invalid(
                f"env.name {PREFIX}{taskset}: a verifiers taskset id names a top-level module (no dots): install the "
                "environment as a package, or put the folder of its module on the generator's path"
            )
        if task_from not in TASK_FROM:
            raise errors.Invalid(f"env.kwargs.task_from {task_from!r} is not one of {', '.join(TASK_FROM)}")
        if importlib.util.find_spec(module) is None and _plugin_module("tasksets", taskset) == module:
            raise errors.Invalid(
                f"env.name {PREFIX}{taskset}: no module {module!r} on this generator: install the environment "
                "(e.g. `prime env install owner/name`) or put the folder of its module on the path"
            )
        self.taskset_id = taskset
        self.task_from = task_from
        data = dict(config)
        data["taskset"] = {**(data.get("taskset") or {}), "id": taskset}
        self.config = resolve_env_config(data)
        updates: dict[str, Any] = {"retries": self.config.retries.model_copy(update={"max_retries": 0, "rules": []})}
        for role, agent in agent_config_fields(self.config).items():
            fix: dict[str, Any] = {"retries": agent.retries.model_copy(update={"max_retries": 0, "rules": []})}
            if "runtime" not in agent.model_fields_set:
                from verifiers.v1.runtimes import SubprocessConfig

                fix["runtime"] = SubprocessConfig()
            updates[role] = agent.model_copy(update=fix)
        self.config = self.config.model_copy(update=updates)
        if task_from == "row":
            self._check_row_data()
        # One served verifiers Env per episode.max_turns value (it is in the agents' configs); made on first use.
        self._envs: dict[int, tuple[Any, contextlib.AsyncExitStack, list[Any] | None]] = {}
        self._lock: asyncio.Lock | None = None

    def _check_row_data(self) -> None:
        from verifiers.v1.utils.loaders import task_type

        data_cls = task_type(self.taskset_id).data_type()
        missing = [n for n, f in data_cls.model_fields.items() if f.is_required() and n not in ("prompt", "answer")]
        if missing:
            raise errors.Invalid(
                f"env.name {PREFIX}{self.taskset_id}: its task data {data_cls.__name__} needs "
                f"{', '.join(missing)}, which a dataset row does not have: set env.kwargs.task_from 'taskset' to "
                "run the taskset's own tasks"
            )

    # -- the protocol ---------------------------------------------------------------------------------

    async def rollout(self, ctx: EpisodeContext) -> float | None:
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        env, tasks = await self._served(ctx.max_turns)
        task = self._task(env, tasks, ctx.row)
        os.environ[TOKEN_VAR] = ctx.client.api_key  # the same token for every episode of this generator
        model = ModelContext(
            model=ctx.model, client=EvalClientConfig(base_url=str(ctx.client.base_url), api_key_var=TOKEN_VAR)
        )
        return self._reward(await env.run_episode(task, model))

    async def aclose(self) -> None:
        """Stop the interception servers of the served envs (the generator's shutdown; tests)."""
        envs, self._envs = self._envs, {}
        for _, stack, _ in envs.values():
            with contextlib.suppress(Exception):
                await stack.aclose()

    # -- helpers --------------------------------------------------------------------------------------

    async def _served(self, max_turns: int) -> tuple[Any, list[Any] | None]:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if max_turns not in self._envs:
                self._envs[max_turns] = await self._serve(max_turns)
            env, _, tasks = self._envs[max_turns]
            return env, tasks

    async def _serve(self, max_turns: int) -> tuple[Any, contextlib.AsyncExitStack, list[Any] | None]:
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import load_environment

        capped = {
            role: agent.model_copy(update={"max_turns": min(agent.max_turns or max_turns, max_turns)})
            for role, agent in agent_config_fields(self.config).items()
        }
        env = load_environment(self.config.model_copy(update=capped))
        tasks = None
        if self.task_from == "taskset":
            if not env.taskset.bounded:
                raise VerifiersEpisodeError(f"taskset {self.taskset_id!r} is infinite: use env.kwargs.task_from 'row'")
            tasks = list(env.taskset)
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(env.serving())
        return env, stack, tasks

    def _task(self, env: Any, tasks: list[Any] | None, row: Row) -> Any:
        if tasks is not None:
            if not 0 <= row.index < len(tasks):
                raise VerifiersEpisodeError(
                    f"row {row.index} has no task: taskset {self.taskset_id!r} has {len(tasks)} (task_from 'taskset' "
                    "takes the row's index as the task's position)"
                )
            return tasks[row.index]
        task_cls = type(env.taskset).task_type()
        data_cls = task_cls.data_type()
        fields: dict[str, Any] = {"idx": row.index, "prompt": row.messages or row.prompt}
        if "answer" in data_cls.model_fields:
            fields["answer"] = row.answer
        if env.taskset.system_prompt is not None:
            fields["system_prompt"] = env.taskset.system_prompt
        return task_cls(data_cls.model_validate(fields), env.taskset.config.task)

    def _reward(self, episode: Any) -> float | None:
        failed = next((e for e in episode.errors), None) or next(
            (e for t in episode.traces for e in t.errors if not t.ok), None
        )
        if not episode.ok or failed is not None:
            why = f"{failed.type}: {failed.message}" if failed is not None else "no error recorded"
            timed_out = episode.is_timeout or any(t.is_timeout for t in episode.traces)
            raise VerifiersEpisodeError(
                f"the verifiers episode failed{' (a verifiers deadline)' if timed_out else ''}: {why}"[:500]
            )
        traces = [t for t in episode.traces if t.agent.trainable] or episode.traces
        if not any(t.rewards for t in traces):
            return None  # no reward declared: the run's reward function scores the final reply
        return sum(t.reward for t in traces) / len(traces)
