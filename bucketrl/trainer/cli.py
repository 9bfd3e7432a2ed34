"""``bucketrl trainer``: run the GRPO trainer for one run (see ``bucketrl/trainer/worker.py``).

    BUCKETRL_PROXY_URL=http://127.0.0.1:8000 BUCKETRL_TOKEN=t BUCKETRL_RUN=demo \\
    bucketrl trainer --run-spec run.json --max-steps 200

Every setting is a ``BUCKETRL_*`` environment variable (``bucketrl/trainer/settings.py``, each field
documented); the options below override theirs. Exit codes: 0 done or stopped by SIGTERM (checkpointed),
1 proxy/runtime error, 2 bad configuration, 3 fenced by a newer trainer. torch, transformers and peft are
imported only inside the command, so ``bucketrl --help`` stays instant.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer
from pydantic import ValidationError

from bucketrl import errors
from bucketrl.settings import warn_if_proxy_url_unset
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.worker import TrainerWorker


def trainer_command(
    run: Annotated[str | None, typer.Option(help="Run id (BUCKETRL_RUN).")] = None,
    proxy_url: Annotated[str | None, typer.Option(help="Proxy base URL (BUCKETRL_PROXY_URL).")] = None,
    run_spec: Annotated[
        str | None, typer.Option(help="Run spec: JSON file path or inline JSON (BUCKETRL_RUN_SPEC).")
    ] = None,
    max_steps: Annotated[int | None, typer.Option(help="Optimizer steps of the run (BUCKETRL_MAX_STEPS).")] = None,
    sync_every: Annotated[int | None, typer.Option(help="Publish every N steps (BUCKETRL_SYNC_EVERY).")] = None,
    checkpoint_every: Annotated[
        int | None, typer.Option(help="Checkpoint every N steps (BUCKETRL_CHECKPOINT_EVERY).")
    ] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (BUCKETRL_LR).")] = None,
    device: Annotated[str | None, typer.Option(help="auto, cpu, cuda, cuda:N (BUCKETRL_DEVICE).")] = None,
    shard_base: Annotated[
        bool | None,
        typer.Option(
            "--shard-base/--no-shard-base",
            help="Under torchrun: shard the frozen base across the ranks with FSDP2 (BUCKETRL_SHARD_BASE).",
        ),
    ] = None,
) -> None:
    """Train: claim rollouts from the proxy, step GRPO on LoRA, publish adapters, checkpoint."""

    overrides = {
        k: v
        for k, v in {
            "run": run,
            "proxy_url": proxy_url,
            "run_spec": run_spec,
            "max_steps": max_steps,
            "sync_every": sync_every,
            "checkpoint_every": checkpoint_every,
            "lr": lr,
            "device": device,
            "shard_base": shard_base,
        }.items()
        if v is not None
    }
    try:
        settings = TrainerSettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        typer.echo(f"bucketrl trainer: {errors.settings_problems(exc)}", err=True)
        raise typer.Exit(code=2) from exc

    warn_if_proxy_url_unset("trainer", settings)
    raise typer.Exit(code=run_trainer(settings))


def run_trainer(settings: TrainerSettings) -> int:
    """One trainer process: the worker, or under torchrun (``WORLD_SIZE > 1``) one of its ranks, which exits here."""
    world = int(os.environ.get("WORLD_SIZE", "1") or "1")  # torchrun sets it
    where = f" [rank {os.environ.get('RANK', '?')}/{world}]" if world > 1 else ""
    logging.basicConfig(
        level=settings.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s",
        stream=sys.stderr,
    )
    if world > 1:  # torch.distributed is imported only then
        from bucketrl.trainer.distributed import exit_rank
        from bucketrl.trainer.distributed import main as rank_main

        exit_rank(rank_main(settings))
    worker = TrainerWorker(settings)
    worker.install_signal_handlers()
    return worker.run()
