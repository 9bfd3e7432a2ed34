"""``up --openai-port``: each generator's endpoint port is chosen once (a generator ``up`` restarts binds the same
one, so the router's list stays right), all generators share one token, and the router is given every one."""

from __future__ import annotations

from pathlib import Path

from bucketrl.up import agents
from bucketrl.up.cluster import LocalCluster
from bucketrl.up.config import UpConfig


def test_generator_ports_are_kept_for_restarts_and_all_reach_the_router(tmp_path: Path) -> None:
    cluster = LocalCluster(UpConfig(dir=tmp_path, dataset="toy:tools", generators=2, openai_port=0))
    assert cluster.agents is not None
    first = [agents.generator_env(cluster.agents, i) for i in range(2)]
    again = [agents.generator_env(cluster.agents, i) for i in range(2)]  # what a restart starts with
    assert first == again
    ports = [int(e["BUCKETRL_OPENAI_PORT"]) for e in first]
    assert len(set(ports)) == 2 and all(p > 0 for p in ports)
    assert {e["BUCKETRL_OPENAI_TOKEN"] for e in first} == {cluster.agents.token}
    argv = agents.router_argv(cluster, cluster.agents)
    assert argv[argv.index("--port") + 1] == str(cluster.agents.router_port) != "0"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--backend"] == [f"http://127.0.0.1:{p}" for p in ports]
    assert LocalCluster(UpConfig(dir=tmp_path / "b", dataset="toy:tools")).agents is None  # no --openai-port
