"""The ``bucketrl`` command. Each service keeps its command in its own light ``cli`` module; heavy
libraries (torch, vLLM, FastAPI) are imported only inside the command, so ``--help`` is instant."""

import typer

from bucketrl.export import export_command
from bucketrl.gateway.cli import gateway_command
from bucketrl.generator.cli import generator_command
from bucketrl.proxy.cli import proxy_command
from bucketrl.relay.cli import relay_command
from bucketrl.router.cli import agent_router_command
from bucketrl.sim import engine as sim_engine
from bucketrl.status_cli import status_command
from bucketrl.trainer.cli import trainer_command
from bucketrl.up.cli import up_command

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Asynchronous GRPO with LoRA through a bucket and a REST proxy."
)


def _register() -> None:
    app.command("proxy")(proxy_command)
    app.command("relay")(relay_command)
    app.command("trainer")(trainer_command)
    app.command("generator")(generator_command)
    app.command("gateway")(gateway_command)
    app.command("agent-router")(agent_router_command)
    app.command("up")(up_command)
    app.command("status")(status_command)
    app.command("export")(export_command)
    # BUCKETRL_ENGINE=sim (benchmarks): the simulation adds its engine to the generator's factory.
    sim_engine.register()


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
