"""Run by ``tests/deploy/test_skypilot.py`` inside SkyPilot's own virtualenv (``.venv-sky``, locks/skypilot.txt):
load each recipe the way ``sky launch`` / ``sky jobs launch`` does, and print what SkyPilot made of it as JSON.

    echo '[{"path": "deploy/skypilot/run.yaml", "env": {"PROXY_URL": "https://..."}, "secrets": {}}]' |
        .venv-sky/bin/python tests/deploy/skypilot_parse.py

One process for every recipe (importing ``sky`` takes seconds): a JSON list of loads on stdin, a JSON list of
answers on the last line of stdout, each ``{"parsed": ...}`` or ``{"refused": "<SkyPilot's message>"}``.

``sky``'s CLI hands a YAML to ``dag_utils.load_job_group_from_yaml`` when its header says ``execution: parallel``
and to ``dag_utils.load_chain_dag_from_yaml`` otherwise, with ``--env``/``--secret`` as overrides: the same calls
here, so the schema (``sky.utils.schemas``), the null-means-required rule for ``envs`` and the job group's header
checks all apply. Offline: nothing here asks a cloud or a catalog (the optimizer, which would, is not run).
"""

from __future__ import annotations

import json
import sys


def _resources(task) -> list[dict]:  # type: ignore[no-untyped-def]
    out = []
    for r in task.resources:
        out.append(
            {
                "cloud": str(r.cloud) if r.cloud else None,
                "region": r.region,
                "accelerators": r.accelerators,
                "use_spot": r.use_spot,
                "ports": r.ports,
                "disk_size": r.disk_size,
                "job_recovery": r.job_recovery,
            }
        )
    return out


def load(path: str, env: dict[str, str], secrets: dict[str, str]) -> dict:  # type: ignore[type-arg]
    import sky
    from sky.utils import dag_utils

    if dag_utils.is_job_group_yaml(path):
        dag = dag_utils.load_job_group_from_yaml(
            path, env_overrides=list(env.items()), secrets_overrides=list(secrets.items())
        )
    else:
        dag = dag_utils.load_chain_dag_from_yaml(
            path, env_overrides=list(env.items()), secret_overrides=list(secrets.items())
        )
    return {
        "sky_version": sky.__version__,
        "job_group": dag.is_job_group(),
        "name": dag.name,
        "inter_connection": getattr(dag, "inter_connection", None),
        "primary_tasks": getattr(dag, "primary_tasks", None),
        "tasks": [
            {
                "name": t.name,
                "num_nodes": t.num_nodes,
                "envs": t.envs,
                # Inline secrets (given with --secret) and the names left for `--secret` at launch.
                "secret_names": sorted(t.secrets),
                "secrets_with_values": sorted(k for k, v in t.secrets.items() if v.get_secret_value()),
                "required_secrets": sorted(r.name for r in getattr(t, "_managed_secret_refs", [])),
                "workdir": t.workdir,
                "resources": _resources(t),
            }
            for t in dag.tasks
        ],
    }


def main() -> int:
    answers = []
    for job in json.load(sys.stdin):
        try:
            answers.append({"parsed": load(job["path"], job.get("env", {}), job.get("secrets", {}))})
        except Exception as exc:  # SkyPilot's refusal, as the user would read it
            answers.append({"refused": f"{type(exc).__name__}: {exc}"})
    print(json.dumps(answers, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
