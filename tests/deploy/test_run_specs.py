"""The run specs this repo ships for deployment are real run specs, and their datasets load.

    .venv/bin/python -m pytest -q tests/deploy/test_run_specs.py

``services/compose/run-spec.{cpu,gpu}.json`` (mounted into the compose trainer) and the chart's default
``run.spec`` (rendered into the trainer's ConfigMap) are validated as :class:`RunSpec`, and their built-in toy
datasets are generated with the same loader the trainer and generators use.
"""

from __future__ import annotations

import json

from tests.deploy.support import ROOT
from tests.deploy.test_chart import merged_values


def test_shipped_run_specs_are_valid_and_their_datasets_load() -> None:
    """The compose run specs and the chart's default spec are real run specs; their toy datasets exist."""

    from bucketrl.datasets import load_examples
    from bucketrl.wire.runs import RunSpec

    specs = {p.name: json.loads(p.read_text()) for p in sorted((ROOT / "services" / "compose").glob("run-spec.*.json"))}
    specs["values.yaml"] = merged_values({})["run"]["spec"]
    assert len(specs) == 3
    for where, data in specs.items():
        spec = RunSpec.model_validate(data)
        assert spec.dataset.uri.startswith("toy:"), f"{where}: the shipped examples use the built-in task"
        examples = load_examples(spec.dataset)
        assert len(examples) == spec.dataset.size and examples[0].prompt, where


def test_compose_cpu_spec_is_the_measured_demo_spec() -> None:
    """`docker compose up` trains exactly what `bucketrl up` trains (settings measured to learn on CPU)."""
    from bucketrl.tasks.toy import default_run_spec
    from bucketrl.wire.runs import RunSpec

    shipped = RunSpec.model_validate_json((ROOT / "services" / "compose" / "run-spec.cpu.json").read_text())
    assert shipped == default_run_spec(shipped.base_model)


def test_compose_cpu_trainer_uses_the_demo_learning_settings() -> None:
    from bucketrl.tasks.toy import DEMO_LR, DEMO_MAX_STEPS
    from tests.deploy.support import ENV_EXAMPLE, load_compose, read_env_file, service_env

    env = service_env(load_compose(ROOT / "docker-compose.yml", env=read_env_file(ENV_EXAMPLE))["services"]["trainer"])
    assert float(env["BUCKETRL_LR"]) == DEMO_LR and int(env["BUCKETRL_MAX_STEPS"]) == DEMO_MAX_STEPS
