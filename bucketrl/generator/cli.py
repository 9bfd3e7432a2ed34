"""``bucketrl generator``: run one generator worker until SIGTERM (exit 0).

Settings come from ``BUCKETRL_*`` variables (:class:`bucketrl.generator.settings.GeneratorSettings`);
the options below override them. Heavy libraries (torch, transformers, vLLM) load only inside the
command, so ``bucketrl generator --help`` is instant.

    BUCKETRL_PROXY_URL=http://127.0.0.1:8000 BUCKETRL_TOKEN=gen-token BUCKETRL_RUN=demo \\
        bucketrl generator --engine vllm --model-path /models/qwen
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from bucketrl import errors, preflight
from bucketrl.generator.pool import PoolGenerator
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.generator.worker import GeneratorWorker
from bucketrl.settings import warn_if_proxy_url_unset


def generator_command(
    engine: Annotated[
        str | None, typer.Option(help="vllm, transformers or sim (no model: benchmarks) (BUCKETRL_ENGINE).")
    ] = None,
    model_path: Annotated[
        str | None, typer.Option(help="Local base model path, overrides the run spec (BUCKETRL_MODEL_PATH).")
    ] = None,
    run: Annotated[str | None, typer.Option(help="Run id (BUCKETRL_RUN).")] = None,
    runs: Annotated[
        str | None, typer.Option(help="Pool mode: serve these comma-separated runs from one engine (BUCKETRL_RUNS).")
    ] = None,
    proxy_url: Annotated[str | None, typer.Option(help="Proxy base URL (BUCKETRL_PROXY_URL).")] = None,
    prompts_per_request: Annotated[
        int | None, typer.Option(help="Prompts per engine call (BUCKETRL_PROMPTS_PER_REQUEST).")
    ] = None,
    max_groups: Annotated[
        int | None, typer.Option(help="Exit after submitting this many groups (BUCKETRL_MAX_GROUPS).")
    ] = None,
    log_level: Annotated[str | None, typer.Option(help="Python log level (BUCKETRL_LOG_LEVEL).")] = None,
    serve_completion_jobs: Annotated[
        bool | None,
        typer.Option(
            "--serve-completion-jobs/--no-serve-completion-jobs",
            help="Serve an external trainer's completion jobs instead of the run's prompts "
            "(BUCKETRL_SERVE_COMPLETION_JOBS).",
        ),
    ] = None,
) -> None:
    """Generate rollouts for a run: lease the latest adapter, sample G completions per prompt, score, submit."""

    overrides: dict[str, Any] = {
        k: v
        for k, v in {
            "engine": engine,
            "model_path": model_path,
            "run": run,
            "runs": runs,
            "proxy_url": proxy_url,
            "prompts_per_request": prompts_per_request,
            "max_groups": max_groups,
            "log_level": log_level,
            "serve_completion_jobs": serve_completion_jobs,
        }.items()
        if v is not None
    }
    try:
        settings = GeneratorSettings(**overrides)
    except ValidationError as exc:
        typer.echo(f"bucketrl generator: {errors.settings_problems(exc)}", err=True)
        raise typer.Exit(code=2) from exc
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"
    )

    warn_if_proxy_url_unset("generator", settings)
    worker: GeneratorWorker | PoolGenerator = PoolGenerator(settings) if settings.runs else GeneratorWorker(settings)
    worker.install_signal_handlers()
    try:
        code = worker.run()
    except preflight.ConfigError as exc:
        # One line, exit 2: `bucketrl up` stops the run on it and shows this reason; status shows the note.
        typer.echo(f"bucketrl generator: {preflight.CONFIG_ERROR_PREFIX}{exc}", err=True)
        worker.announce("stopped: configuration error", {"config_error": str(exc)[:1000]})
        raise typer.Exit(code=preflight.EXIT_CONFIG) from None
    except errors.BucketRLError as exc:
        typer.echo(f"generator: {exc.code}: {exc.message}", err=True)
        raise typer.Exit(code=1) from exc
    raise typer.Exit(code=code)
