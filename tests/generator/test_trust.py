"""The generator operator's allow-lists (issue 12's trust model): a run spec set by a trainer token cannot make
this generator import a module or read a location the operator did not allow. Before: any ``module:function``
was imported and any local path read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bucketrl.generator.trust import check_spec
from bucketrl.generator.worker import GeneratorWorker
from bucketrl.preflight import ConfigError
from bucketrl.wire import DatasetSpec, RewardSpec
from tests.generator.worker_support import create_run, worker_settings
from tests.proxy.harness import ProxyHarness, make_spec, running
from tests.support.services import RedisServer


@pytest.fixture()
def proxy_file(redis_server: RedisServer, tmp_path: Path) -> Iterator[ProxyHarness]:
    with running(redis_server.url, f"file://{tmp_path / 'bucket'}") as h:
        yield h


def spec(reward: str, uri: str):  # type: ignore[no-untyped-def]
    return make_spec(reward={"name": reward}, dataset={"uri": uri, "size": 4})


def test_allow_lists_admit_exactly_what_they_name(tmp_path: Path) -> None:
    data = tmp_path / "data"
    # Defaults ('*'): trainers are trusted, as before.
    check_spec(spec("evil_module:run", "/etc/passwd.jsonl"), "*", "*")
    # Built-ins, toy: and bucket: are always admitted.
    check_spec(spec("math", "bucket:dataset.jsonl"), "", "")
    check_spec(spec("toy", "toy:digits"), "", "")
    check_spec(spec("my_rewards.sub:score", f"{data}/train.jsonl"), "my_rewards", f"{data}/")
    for reward, uri, problem in (
        ("os:system", "toy:digits", "BUCKETRL_ALLOWED_REWARD_MODULES"),
        ("my_rewards_evil:score", "toy:digits", "BUCKETRL_ALLOWED_REWARD_MODULES"),
        ("math", "/etc/passwd.jsonl", "BUCKETRL_ALLOWED_DATASET_LOCATIONS"),
        ("math", f"{data}/../secrets/x.jsonl", "BUCKETRL_ALLOWED_DATASET_LOCATIONS"),
        ("math", "someone/dataset", "BUCKETRL_ALLOWED_DATASET_LOCATIONS"),
    ):
        with pytest.raises(ConfigError, match=problem):
            check_spec(spec(reward, uri), "my_rewards", f"{data}/,openai/")
    check_spec(spec("math", "openai/gsm8k"), "", "openai/")


def test_a_generator_refuses_a_run_outside_its_allow_lists_before_importing_anything(
    proxy_file: ProxyHarness, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = tmp_path / "adapter"  # never read: the worker stops at the allow-list
    create_run(
        proxy_file,
        "t1",
        tiny_model_dir,
        _tiny_adapter(tiny_model_dir, adapter),
        reward=RewardSpec(name="tests.generator.reward_fixtures:length_reward"),
        dataset=DatasetSpec(uri="bucket:dataset.jsonl", prompt_field="question", answer_field="solution", size=4),
    )
    worker = GeneratorWorker(worker_settings(proxy_file, "t1", "gen-t", allowed_reward_modules="my_rewards"))
    with pytest.raises(ConfigError, match=r"tests\.generator\.reward_fixtures.*BUCKETRL_ALLOWED_REWARD_MODULES"):
        worker.run()
    assert worker.engine is None  # stopped before any model or engine was loaded


def _tiny_adapter(model_dir: Path, out: Path) -> Path:
    from tests.generator.helpers import make_adapter

    return make_adapter(model_dir, out, seed=0)


def test_environment_modules_pass_the_reward_allow_list() -> None:
    def with_env(name: str):  # type: ignore[no-untyped-def]
        return make_spec(reward={"name": "toy"}, dataset={"uri": "toy:tools", "size": 4}, env={"name": name})

    check_spec(with_env("evil_envs:Env"), "*", "")  # the default trusts trainers
    check_spec(with_env("toy:tools"), "", "")  # built-ins always
    check_spec(with_env("external"), "", "")
    check_spec(with_env("my_envs.sub:Env"), "my_envs", "")
    with pytest.raises(ConfigError, match=r"env.name 'evil_envs:Env'.*BUCKETRL_ALLOWED_REWARD_MODULES"):
        check_spec(with_env("evil_envs:Env"), "my_envs", "")


def test_a_verifiers_env_needs_its_taskset_and_every_plugin_it_names_allowed() -> None:
    def with_env(name: str, **kwargs: object):  # type: ignore[no-untyped-def]
        env = {"name": name, "kwargs": kwargs}
        return make_spec(reward={"name": "toy"}, dataset={"uri": "toy:digits", "size": 4}, env=env)

    check_spec(with_env("verifiers:evil_taskset"), "*", "")
    check_spec(with_env("verifiers:my-taskset"), "my_taskset", "")  # verifiers imports 'my-taskset' as my_taskset
    with pytest.raises(ConfigError, match=r"module 'evil_taskset' is not in .*BUCKETRL_ALLOWED_REWARD_MODULES"):
        check_spec(with_env("verifiers:evil_taskset"), "my_taskset", "")
    # The kwargs' plugins are imported too: a harness (built-in: verifiers.v1.harnesses.<id>), a reward function.
    harness = {"agent": {"harness": {"id": "null"}}}
    with pytest.raises(ConfigError, match=r"module 'verifiers.v1.harnesses.null' is not in"):
        check_spec(with_env("verifiers:my_taskset", **harness), "my_taskset", "")
    check_spec(with_env("verifiers:my_taskset", **harness), "my_taskset,verifiers", "")
    check_spec(with_env("verifiers:my_taskset", **harness), "my_taskset,verifiers.v1.harnesses.null", "")
    fn = {"taskset": {"task": {"rewards": {"r": {"fn": "evil.scores:steal"}}}}}
    with pytest.raises(ConfigError, match=r"module 'evil.scores' is not in"):
        check_spec(with_env("verifiers:my_taskset", **fn), "my_taskset,verifiers", "")
