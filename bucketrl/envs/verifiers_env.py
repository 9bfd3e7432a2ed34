"""``verifiers`` environments as bucketrl environments (the ``verifiers`` extra: ``pip install 'bucketrl[verifiers]'``).

    "env": {"name": "verifiers", "kwargs": {"taskset": "my_taskset"}}    # bucketrl up --env verifiers ...

verifiers (0.4, its ``v1`` stack) composes a *taskset* (tasks + their ``@vf.reward`` scoring), the *agents* that
play it and a *harness* (the program an agent runs, whose every model call goes through verifiers' interception
server to the model's endpoint). This adapter loads the taskset's environment (``load_environment``: its own
``Env``, else ``SingleAgentEnv``) with the agent in the local subprocess runtime, and runs one verifiers episode
per bucketrl episode: task ``row.index`` (modulo the taskset's size: make the run's dataset one row per task),
against this generator's endpoint with the episode's model name, so every model call is pinned, recorded and
trained like any other turn. The reward is the mean of the episode's traces' rewards; a failed verifiers episode
(its errors, or a trace's: a reward function that raised) is a failed bucketrl episode.

Harness: ``"chat"`` (default) is :class:`ChatHarness`, an in-process chat loop that needs nothing installed (one
model turn per harness segment; verifiers' own harnesses launch programs with ``uv``, which needs network access);
``"taskset"`` keeps the harness verifiers would pick (the taskset's exported one, else ``bash``), whose program
verifiers launches with ``uv``: it installs ``uv`` (``pip install --user``) and the program's dependencies when
missing, so it needs network access and writes to ``~/.local`` and ``~/.cache/uv``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import types
from typing import Any

from bucketrl import errors
from bucketrl.envs.protocol import EpisodeContext

KEY_VAR = "BUCKETRL_VERIFIERS_ENDPOINT_KEY"  # verifiers reads API keys from a variable


def _vf() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise errors.Invalid(
            "env bucketrl.envs.verifiers_env:VerifiersEnv needs verifiers: pip install 'bucketrl[verifiers]'"
        ) from exc
    return vf


CHAT_HARNESS_ID = "bucketrl_verifiers_chat"


def chat_harness_config() -> Any:
    """The in-process chat harness's config. verifiers loads a harness by importing the module its id names; the
    module is registered here (built on first use: verifiers is optional)."""
    _vf()
    from verifiers.v1.configs.harness import HarnessConfig
    from verifiers.v1.harness import Harness
    from verifiers.v1.runtimes import ProgramResult

    if CHAT_HARNESS_ID in sys.modules:
        return sys.modules[CHAT_HARNESS_ID].ChatHarnessConfig(id=CHAT_HARNESS_ID)

    class ChatHarnessConfig(HarnessConfig):
        pass

    class ChatHarness(Harness[ChatHarnessConfig]):
        """One model turn on the conversation so far, through the interception endpoint."""

        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def setup(self, runtime: Any) -> None:
            return None

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):  # type: ignore[no-untyped-def]
            import openai

            system_prompt, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
            messages += prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt or ""}]
            async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
                await client.chat.completions.create(model=ctx.model, messages=messages)
            return ProgramResult(exit_code=0, stdout="", stderr="")

    module = types.ModuleType(CHAT_HARNESS_ID, "bucketrl's in-process chat harness for verifiers")
    module.ChatHarness, module.ChatHarnessConfig = ChatHarness, ChatHarnessConfig  # type: ignore[attr-defined]
    module.__all__ = ["ChatHarness"]  # type: ignore[attr-defined]
    sys.modules[CHAT_HARNESS_ID] = module
    return ChatHarnessConfig(id=CHAT_HARNESS_ID)


class VerifiersEnv:
    def __init__(self, taskset: str, harness: str = "chat", taskset_config: dict[str, Any] | None = None) -> None:
        vf = _vf()
        from verifiers.v1.utils.loaders import load_environment

        if harness not in ("chat", "taskset"):
            raise errors.Invalid(f"env.kwargs.harness must be 'chat' or 'taskset', not {harness!r}")
        agent = {"runtime": vf.SubprocessConfig()}
        if harness == "chat":
            agent["harness"] = chat_harness_config()  # every seat plays with it (not verifiers' programs)
        config = vf.SingleAgentEnvConfig(
            taskset=vf.TasksetConfig(id=taskset, **(taskset_config or {})), agent=vf.AgentConfig(**agent)
        )
        try:
            self.env = load_environment(config)
            self.tasks = list(self.env.taskset)
        except Exception as exc:
            raise errors.Invalid(f"verifiers taskset {taskset!r}: {type(exc).__name__}: {exc}") from exc
        if not self.tasks:
            raise errors.Invalid(f"verifiers taskset {taskset!r} has no tasks")
        self._serving: contextlib.AsyncExitStack | None = None
        self._lock: asyncio.Lock | None = None

    async def _ensure_serving(self) -> None:
        """verifiers' serving resources (its interception server) live as long as the generator."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._serving is None:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.env.serving())
                self._serving = stack

    async def rollout(self, ctx: EpisodeContext) -> float:
        vf = _vf()
        await self._ensure_serving()
        os.environ[KEY_VAR] = ctx.client.api_key
        model = vf.ModelContext(
            model=ctx.model,
            client=vf.EvalClientConfig(base_url=str(ctx.client.base_url).rstrip("/"), api_key_var=KEY_VAR),
        )
        episode = await self.env.run_episode(self.tasks[ctx.row.index % len(self.tasks)], model)
        # An episode's own errors, or a trace's (a reward function that raised scores 0.0 there, flagged not ok):
        # never trained as if the score were real.
        failures = [*episode.errors, *(e for t in episode.traces for e in (getattr(t, "errors", None) or []))]
        if failures or not episode.traces or not all(getattr(t, "ok", True) for t in episode.traces):
            why = f"{failures[0].type}: {failures[0].message}" if failures else "a trace is not ok"
            raise RuntimeError(f"verifiers episode failed: {why}")
        ctx.state["verifiers_episode"] = episode
        return sum(t.reward for t in episode.traces) / len(episode.traces)
