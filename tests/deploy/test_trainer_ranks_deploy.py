"""The data-parallel trainer's deployment (issue 15). Helm: ``trainer.gpu.count`` GPUs per pod, ``trainer.nodes``
pods, started with torchrun (``python -m bucketrl.trainer.launch``); multi-node through a headless Service and a
c10d rendezvous on pod 0. Compose's GPU override: ``TRAINER_GPUS``. Rendered offline, schema-validated, and the
launcher arguments parsed by torchrun's own parser.
"""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from tests.deploy.support import (
    COMPOSE_FILES,
    ENV_EXAMPLE,
    build_settings,
    lint_chart,
    load_compose,
    manifests,
    pod_spec,
    read_env_file,
    render_chart,
)

CASES: dict[str, dict[str, Any]] = {
    "one-pod-4-gpus": {"trainer": {"gpu": {"count": 4}}},
    "job-2-nodes": {"trainer": {"gpu": {"count": 8}, "nodes": 2, "shardBase": True}},
    "statefulset-3-nodes": {"trainer": {"kind": "StatefulSet", "gpu": {"count": 2}, "nodes": 3}},
}


def trainer_objects(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
    docs = manifests(render_chart(values))
    for doc in docs:
        for version in ("1.29", kubernetes_validate.latest_version()):
            if doc["kind"] != "ServiceMonitor":
                kubernetes_validate.validate(doc, version, strict=True)
    comp = [d for d in docs if d["metadata"]["labels"].get("app.kubernetes.io/component") == "trainer"]
    (workload,) = [d for d in comp if d["kind"] in ("Job", "StatefulSet")]
    services = [d for d in comp if d["kind"] == "Service"]
    return workload, (services[0] if services else None), docs


def trainer_settings(env: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """The trainer's settings as it would read them from this environment (its literal BUCKETRL_* values; the run
    spec is a path inside the pod)."""
    from bucketrl.trainer.settings import TrainerSettings

    wanted = {k: str(v) for k, v in env.items() if k.startswith("BUCKETRL_") and k != "BUCKETRL_RUN_SPEC" and v}
    return build_settings(TrainerSettings, wanted, monkeypatch)


def test_default_trainer_is_one_plain_process() -> None:
    workload, service, _ = trainer_objects({})
    (c,) = pod_spec(workload)["containers"]
    assert c["args"] == ["trainer"] and "command" not in c
    assert service is None and workload["spec"]["parallelism"] == 1


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpus_and_nodes_start_torchrun_with_one_rank_per_gpu(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.run import parse_args, parse_min_max_nnodes

    values = CASES[case]
    report = lint_chart(values)
    assert not [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    workload, service, _ = trainer_objects(values)
    t = values["trainer"]
    gpus, nodes = t["gpu"]["count"], t.get("nodes", 1)
    spec = pod_spec(workload)
    (c,) = spec["containers"]
    assert c["command"] == ["python", "-m", "bucketrl.trainer.launch"]
    args = parse_args(c["args"])  # torchrun's own parser: the flags exist and mean what the chart intends
    assert int(args.nproc_per_node) == gpus and parse_min_max_nnodes(args.nnodes) == (nodes, nodes)
    assert args.module and args.training_script == "bucketrl.cli" and args.training_script_args == ["trainer"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["shm"] == "/dev/shm"
    # trainer.shardBase: the base sharded with FSDP2 across the ranks (a setting the trainer reads as true).
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env.get("BUCKETRL_SHARD_BASE") == ("true" if t.get("shardBase") else None)
    if t.get("shardBase"):
        assert trainer_settings(env, monkeypatch).shard_base is True
    name = workload["metadata"]["name"]
    if nodes == 1:
        assert args.standalone
        return
    # Multi-node: the endpoint is pod 0 of this workload under the headless Service, on the port it publishes.
    assert service is not None and service["spec"]["clusterIP"] == "None"
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["publishNotReadyAddresses"] is True
    (port,) = service["spec"]["ports"]
    assert (
        args.rdzv_backend == "c10d" and args.rdzv_endpoint == f"{name}-0.{service['metadata']['name']}:{port['port']}"
    )
    assert args.rdzv_id == "demo"
    assert port["targetPort"] in {p["name"] for p in c["ports"]}
    if workload["kind"] == "Job":
        assert workload["spec"]["completionMode"] == "Indexed"
        assert workload["spec"]["completions"] == workload["spec"]["parallelism"] == nodes
        assert spec["subdomain"] == service["metadata"]["name"]
    else:
        assert workload["spec"]["replicas"] == nodes and workload["spec"]["podManagementPolicy"] == "Parallel"
        assert workload["spec"]["serviceName"] == service["metadata"]["name"]


@pytest.mark.parametrize("gpus", [None, "4"])
def test_compose_gpu_trainer_takes_the_number_of_gpus(gpus: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.run import parse_args

    env = read_env_file(ENV_EXAMPLE)
    env.pop("TRAINER_GPUS", None)
    env.pop("TRAINER_SHARD_BASE", None)
    if gpus is not None:
        env["TRAINER_GPUS"] = gpus
        env["TRAINER_SHARD_BASE"] = "true"
    trainer = load_compose(*COMPOSE_FILES, env=env)["services"]["trainer"]
    want = int(gpus or 1)
    (device,) = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert int(device["count"]) == want and "device_ids" not in device
    argv = trainer["entrypoint"] + trainer["command"]
    assert argv[:3] == ["python", "-m", "bucketrl.trainer.launch"]
    args = parse_args(argv[3:])
    assert int(args.nproc_per_node) == want and args.standalone
    assert args.module and args.training_script == "bucketrl.cli" and args.training_script_args == ["trainer"]
    assert "shm_size" in trainer
    # TRAINER_SHARD_BASE: off by default, on when set (FSDP2 across the ranks).
    assert trainer["environment"]["BUCKETRL_SHARD_BASE"] == ("true" if gpus else "false")
    assert trainer_settings(trainer["environment"], monkeypatch).shard_base is bool(gpus)
