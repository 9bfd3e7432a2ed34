"""``bucketrl up --openai-port PORT``: one URL for agents over every generator (docs/multi-turn.md "Many
generators").

Every generator exposes its endpoint on a loopback port of its own, chosen once per ``up`` so that a generator
``up`` restarts comes back on the same port (the router's list of generators never goes stale), all with one token.
``bucketrl agent-router`` listens on PORT (0: a free one, also kept for its restarts), spreads new episodes over
the generators and keeps each episode's calls on the generator that handed it out; it writes its URL and the
token under "openai" in <dir>/endpoint.json once a generator answers through it. An agent reads that entry as
before: one base URL and one token, whatever the number of generators.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING

from bucketrl.up.ports import free_port
from bucketrl.up.processes import bucketrl_command

if TYPE_CHECKING:
    from bucketrl.up.cluster import LocalCluster

ROUTER = "agent-router"


class AgentPorts:
    """The ports and the token of one ``up`` session's agent endpoints."""

    def __init__(self, router_port: int) -> None:
        self.router_port = router_port or free_port()
        self.token = secrets.token_urlsafe(24)
        self.generators: dict[int, int] = {}

    def generator_port(self, index: int) -> int:
        return self.generators.setdefault(index, free_port())

    def backends(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for _, port in sorted(self.generators.items())]


def generator_env(ports: AgentPorts, index: int) -> dict[str, str]:
    """What makes generator ``index`` expose its endpoint for the router (its own port, the shared token)."""
    return {"BUCKETRL_OPENAI_PORT": str(ports.generator_port(index)), "BUCKETRL_OPENAI_TOKEN": ports.token}


def router_argv(cluster: LocalCluster, ports: AgentPorts) -> list[str]:
    """``bucketrl agent-router`` over the generators started so far (their ports are fixed before they bind)."""
    run_dir_file = str(cluster.endpoint_file)
    argv = bucketrl_command(
        ROUTER, "--port", str(ports.router_port), "--endpoint-file", run_dir_file, "--run", cluster.cfg.run
    )
    return argv + [a for url in ports.backends() for a in ("--backend", url)]
