"""A whole bucketrl deployment on one machine: Redis, proxy, one trainer per run, N generators, as OS processes.

Everything lives under the run directory, so running again with the same directory resumes::

    <dir>/tokens            role:token pairs generated for this run (mode 600; the proxy's TOKENS_FILE)
    <dir>/run_spec.json     the run spec the trainer creates or confirms
    <dir>/model/            the built-in tiny model (when no --model)
    <dir>/bucket/           the file:// bucket (adapters, rollouts, checkpoints)
    <dir>/redis/            Redis's append-only file (coordination state survives a restart)
    <dir>/logs/<service>.log, <dir>/logs/trainer-audit.jsonl
    <dir>/endpoint.json     the proxy's address while it runs (``bucketrl status --dir <dir>``); with
                            ``--openai-port``, under "openai": gen-0's endpoint for agents (URL, token); with
                            ``--gateway-port``, under "gateway": the gateway's URL (TRL's vllm_server_base_url)
    <dir>/gateway-state.json  the gateway's adapter names -> versions (``--external-trainer``, bucketrl.up.external)
    <dir>/services.json     the pid of each service (the last start of each)
    <dir>/runs/<run>/       with several runs (``--runs N``, ``--run-spec`` repeated; bucketrl.up.runs): each run's
                            run_spec.json, watcher history, summary and plots; its trainer is ``trainer-<run>``
                            (logs/trainer-<run>.log, logs/trainer-<run>-audit.jsonl), with a token scoped to its run

Workers talk to the proxy over HTTP exactly as containers would: each gets only ``BUCKETRL_PROXY_URL``, its
token and the run id. :class:`LocalCluster` is what ``bucketrl up`` and the end-to-end tests drive (they
kill, restart and inspect its services).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import shutil
import signal
import time
from pathlib import Path
from typing import IO, Any

import httpx
from pydantic import ValidationError

from bucketrl import preflight
from bucketrl.client import ProxyClient
from bucketrl.envs.files import merge_json_file
from bucketrl.generator import trust
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.tasks.tiny_model import build_tiny_model
from bucketrl.trainer.trackers import default_report_to
from bucketrl.up import agents, external
from bucketrl.up.config import UpConfig, build_run_spec, max_new_tokens_given, save_options
from bucketrl.up.ports import free_port
from bucketrl.up.processes import (
    Service,
    bucketrl_command,
    port_open,
    redis_server_binary,
    trainer_command,
    wait_until,
)
from bucketrl.up.runs import check_pool_specs
from bucketrl.wire import RunSpec

ROLES = ("admin", "trainer", "generator", "viewer")


class RunDirBusy(RuntimeError):
    pass


def _remove_new(run_dir: Path, made: list[Path], before: set[str]) -> None:
    """Undo a refused ``prepare``. ``made``: the directories it created, the run directory first, then those above
    it (each removed only while empty: another `up` may have put its own run there meanwhile); else the entries of
    ``run_dir`` not in ``before``."""
    if made:
        shutil.rmtree(run_dir, ignore_errors=True)
        for parent in made[1:]:
            try:
                parent.rmdir()
            except OSError:
                break
        return
    for path in run_dir.iterdir():
        if path.name in before:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


class LocalCluster:
    def __init__(self, cfg: UpConfig) -> None:
        self.cfg = cfg
        # Each run's own options (one run: cfg itself); several runs share the generators (bucketrl.up.runs).
        self.run_cfgs = {e.run: cfg.for_run(e) for e in cfg.runs} if cfg.runs is not None else {cfg.run: cfg}
        self.dir = cfg.run_dir
        self.logs = self.dir / "logs"
        self.services: dict[str, Service] = {}
        self.tokens: dict[str, str] = {}
        self.redis_port = free_port()
        self.proxy_port = cfg.port or free_port()
        self.gateway_port = cfg.gateway_port  # a port-0 gateway's actual port once it listens (kept on restarts)
        self.gateway_url: str | None = None
        self.agents = agents.AgentPorts(cfg.openai_port) if cfg.openai_port is not None else None
        self.model_dir: Path | None = None
        self.report: Any = None  # what the preflight found
        self._lock: IO[str] | None = None

    # -- paths and addresses -------------------------------------------------------------------------

    @property
    def proxy_url(self) -> str:
        return f"http://127.0.0.1:{self.proxy_port}"

    @property
    def redis_url(self) -> str:
        return self.cfg.redis_url or f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def bucket_url(self) -> str:
        return self.cfg.bucket_url or f"file://{self.dir / 'bucket'}"

    @property
    def dashboard_url(self) -> str:
        return f"{self.proxy_url}/ui?run={self.runs[0]}#token={self.tokens['viewer']}"

    @property
    def generator_names(self) -> list[str]:
        return [f"gen-{i}" for i in range(self.cfg.generators)]

    @property
    def runs(self) -> list[str]:
        return list(self.run_cfgs)

    def trainer_name(self, run: str | None = None) -> str:
        """The trainer's service (and log) name: ``trainer``, or ``trainer-<run>`` for one of several runs."""
        return "trainer" if self.cfg.runs is None else f"trainer-{run or self.runs[0]}"

    def run_home(self, run: str | None = None) -> Path:
        """Where one run's own files are (spec, watcher history, summary, plots): the directory itself for one run,
        ``<dir>/runs/<run>`` for one of several."""
        return self.dir if self.cfg.runs is None else self.dir / "runs" / (run or self.runs[0])

    def spec_path(self, run: str | None = None) -> Path:
        return self.run_home(run) / "run_spec.json"

    # -- preparation -----------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Lock the run directory, check every run's spec (the preflight; the tiny model built), then create or reuse
        tokens and write the specs. A refusal leaves the directory as it was (house rule: bad input changes nothing):
        what the checks made in it, or the directory itself when it is new, is removed again."""
        if self.cfg.gateway_port:
            external.check_port_free(self.cfg.gateway_port, "--gateway-port")
        if self.cfg.openai_port:  # the agent router binds it
            external.check_port_free(self.cfg.openai_port, "--openai-port")
        missing = [p for p in (self.dir, *self.dir.parents) if not p.exists()]
        before = set() if missing else {p.name for p in self.dir.iterdir()}
        self._lock_dir()
        try:
            specs = self._checked_specs()
        except BaseException:
            self.release()
            _remove_new(self.dir, missing, before)
            raise
        self.logs.mkdir(exist_ok=True)
        self.tokens = self._load_or_create_tokens()
        for run, spec in specs.items():
            self.spec_path(run).parent.mkdir(parents=True, exist_ok=True)
            self.spec_path(run).write_text(json.dumps(spec, indent=2) + "\n")
        save_options(self.cfg)

    def _lock_dir(self) -> None:
        """Create the run directory and hold its lock for the cluster's lifetime (RunDirBusy: another `up` has it)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        lock = open(self.dir / "up.lock", "w")  # noqa: SIM115 - held for the cluster's lifetime
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            lock.close()
            # Nothing is removed: the lock file and the directory are the other `up`'s.
            raise RunDirBusy(f"{self.dir} is in use by another `bucketrl up`; stop it or pass --dir") from exc
        lock.write(str(os.getpid()))
        lock.flush()
        self._lock = lock

    def _checked_specs(self) -> dict[str, dict[str, Any]]:
        """Each run's spec, checked (ValueError, ConfigError, ValidationError) and not yet written."""
        specs: dict[Path | None, dict[str, Any]] = {}  # by run-spec file: `--runs N` copies check one spec
        out: dict[str, dict[str, Any]] = {}
        for run, cfg in self.run_cfgs.items():
            if cfg.run_spec not in specs:
                specs[cfg.run_spec] = self._prepare_spec(cfg, named=self.cfg.runs is not None)
            spec = dict(specs[cfg.run_spec])
            entry = next((e for e in self.cfg.runs or [] if e.run == run), None)
            if entry is not None and entry.share is not None:
                spec["share"] = entry.share
            out[run] = spec
        if self.cfg.runs is not None:
            check_pool_specs(out)
        return out

    def _prepare_spec(self, cfg: UpConfig, *, named: bool = False) -> dict[str, Any]:
        """One run's spec, checked before any process starts (the preflight), with the tiny model built; ``named``:
        one of several runs, whose spec errors say which run (and file) they are in."""
        model_dir = self.dir / "model" if cfg.builtin_model else None
        try:
            spec = build_run_spec(cfg, model_dir)
        except ValidationError as exc:
            if not named:
                raise
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise ValueError(f"run {cfg.run} ({cfg.run_spec}): run spec field {where}: {first['msg']}") from None
        probe = self._probe(spec, cfg)
        examples: list[Any] | None = None
        reward_value = None
        if cfg.preflight:
            # Dataset and reward first: they need no torch, so their mistakes stop `up` in a few seconds.

            # The generators' allow-lists (their environment is this one, plus the cluster's settings): a module
            # they would refuse is refused here, before anything is imported.
            self._check_trust(probe, spec["dataset"]["uri"])
            examples = preflight.check_dataset(probe.dataset)
            reward_value = preflight.check_reward(probe.reward, examples[0], timeout_s=self._reward_timeout_s())
            if probe.env is not None:
                # Imported and built here as each generator does at its start (a wrong --env used to surface
                # only in a generator's log, ~20 s in, after every service had started).
                preflight.check_env(probe.env)
        if model_dir is not None:
            self.model_dir = build_tiny_model(model_dir, warm_start_steps=cfg.warm_start_steps())
        if cfg.preflight:
            report = self._preflight(probe, examples, cfg)
            report.reward_value = reward_value
            self.report = self.report or report  # what `up` prints: the first run's
            spec = build_run_spec(
                cfg,
                self.model_dir,
                vocab_size=report.vocab_size,
                max_new_tokens=report.max_new_tokens if report.chose_max_new_tokens else None,
            )
        return spec

    def _probe(self, spec: dict[str, Any], cfg: UpConfig) -> Any:
        """The spec as the preflight checks it: a dataset to upload is checked as the local file it is now."""

        probe = json.loads(json.dumps(spec))
        upload = cfg.upload_path
        if upload is not None:
            probe["dataset"]["uri"] = str(upload)
        probe["dataset"].setdefault("size", 1)
        return RunSpec.model_validate(probe)

    def _generator_setting(self, field: str) -> str | None:
        """A generator setting as the generators will see it: the cluster's generator, then worker settings, then
        this process's environment (theirs is inherited from it); None when unset (the default applies)."""
        var = f"BUCKETRL_{field.upper()}"
        for source in (self.cfg.generator_env, self.cfg.worker_env, os.environ):
            if var in source:
                return source[var]
        return None

    def _reward_timeout_s(self) -> float:

        given = self._generator_setting("reward_timeout_s")
        return float(given or GeneratorSettings.model_fields["reward_timeout_s"].default)

    def _check_trust(self, probe: Any, dataset_uri: str) -> None:
        """The generators' BUCKETRL_ALLOWED_REWARD_MODULES / _DATASET_LOCATIONS admit the reward, the environment
        and the dataset the generators will read (``dataset_uri``: the run spec's, ``bucket:`` for an upload)."""

        def allowed(field: str) -> str:
            given = self._generator_setting(field)
            return given if given is not None else str(GeneratorSettings.model_fields[field].default)

        modules = allowed("allowed_reward_modules")
        trust.check_reward(probe.reward.name, modules)
        if probe.env is not None:
            trust.check_env(probe.env.name, modules, probe.env.kwargs)
        trust.check_dataset(dataset_uri, allowed("allowed_dataset_locations"))

    def _preflight(self, probe: Any, examples: list[Any] | None, cfg: UpConfig) -> Any:
        """The model checks every worker repeats at its start, here before any process starts (ConfigError)."""

        max_len = self.cfg.generator_env.get("BUCKETRL_MAX_MODEL_LEN") or self.cfg.worker_env.get(
            "BUCKETRL_MAX_MODEL_LEN"
        )
        names = preflight.UP_NAMES
        if cfg.builtin_model:  # "--model has none" would puzzle a user who gave no --model
            names = {**names, "model": "the built-in model (--model chooses another)"}
        elif cfg.model is None:  # the --run-spec file's
            names = {**names, "model": f"base_model (--run-spec {cfg.run_spec})"}
        return preflight.check_run(
            probe,
            names=names,
            max_model_len=int(max_len) if max_len else GeneratorSettings.model_fields["max_model_len"].default,
            choose_max_new_tokens=not max_new_tokens_given(cfg),
            examples=examples,
            reward="skip",  # checked above
        )

    def _load_or_create_tokens(self) -> dict[str, str]:
        path = self.dir / "tokens"
        # Several runs: each trainer's token is scoped to its run ("trainer@<run>:...", bucketrl.proxy.auth).
        wanted = [*ROLES, *(f"trainer@{run}" for run in self.runs if self.cfg.runs is not None)]
        pairs: dict[str, str] = {}
        if path.exists():
            pairs = dict(line.split(":", 1) for line in path.read_text().split() if ":" in line)
            if set(wanted) <= pairs.keys():
                return pairs
            if not set(ROLES) <= pairs.keys():
                pairs = {}
        pairs = {
            role: pairs.get(role) or f"{role[:3]}-{secrets.token_urlsafe(24)}"
            for role in [*pairs, *(w for w in wanted if w not in pairs)]
        }
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(f"{role}:{tok}\n" for role, tok in pairs.items()))
        return pairs

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # -- services ----------------------------------------------------------------------------------------

    def _service(self, name: str, argv: list[str], env: dict[str, str]) -> Service:
        svc = self.services.get(name)
        if svc is None:
            # Children run in the launcher's working directory: relative --dataset paths and module:function
            # rewards resolve as the user typed them.
            svc = Service(name, argv, self.logs / f"{name}.log", env=env, on_start=self._record_pids)
            if name not in ("proxy", "redis"):  # see Service.death_signal
                svc.death_signal = signal.SIGKILL
            self.services[name] = svc
        else:
            svc.argv, svc.env = argv, env
        return svc

    def _record_pids(self) -> None:
        """``<dir>/services.json``: the pid of every service started (operators and tests check them)."""
        pids = {name: svc.pid for name, svc in self.services.items() if svc.pid is not None}
        (self.dir / "services.json").write_text(json.dumps(pids) + "\n")

    def start_redis(self) -> Service:
        if self.cfg.redis_url:
            raise RuntimeError("an external Redis (redis_url) is not started by bucketrl up")
        redis_dir = self.dir / "redis"
        redis_dir.mkdir(exist_ok=True)
        argv = [
            redis_server_binary(),
            "--port", str(self.redis_port),
            "--bind", "127.0.0.1",
            "--dir", str(redis_dir),
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", self.cfg.redis_fsync,
            "--daemonize", "no",
            "--protected-mode", "no",
        ]  # fmt: skip
        svc = self._service("redis", argv, {}).start()
        wait_until(lambda: port_open(self.redis_port), 30, "redis to listen", svc)
        return svc

    def proxy_env(self) -> dict[str, str]:
        return {
            "BUCKETRL_REDIS_URL": self.redis_url,
            "BUCKETRL_BUCKET_URL": self.bucket_url,
            "BUCKETRL_TOKENS_FILE": str(self.dir / "tokens"),
            "BUCKETRL_TOKENS": "",
            "BUCKETRL_HOST": "127.0.0.1",
            "BUCKETRL_PORT": str(self.proxy_port),
            "BUCKETRL_LOG_LEVEL": "warning",
            **self.cfg.proxy_env,
        }

    def start_proxy(self) -> Service:
        svc = self._service("proxy", bucketrl_command("proxy"), self.proxy_env()).start()
        wait_until(self.proxy_ready, 60, "the proxy to be ready", svc, poll_s=0.2)
        # What `bucketrl status --dir <dir>` reads (the token it uses is the viewer's, from <dir>/tokens).
        endpoint = {"proxy_url": self.proxy_url, "run": self.runs[0], "runs": self.runs, "pid": svc.pid}
        # Merged: gen-0's "openai" entry (agents' endpoint, --openai-port) survives a proxy restart.
        merge_json_file(self.endpoint_file, endpoint)
        return svc

    def proxy_ready(self) -> bool:
        try:
            return httpx.get(f"{self.proxy_url}/readyz", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _worker_env(self, role: str, worker_id: str, run: str | None = None) -> dict[str, str]:
        threads = str(self.cfg.threads)
        run = run or self.runs[0]
        return {
            "BUCKETRL_PROXY_URL": self.proxy_url,
            # One of several runs' trainers gets a token scoped to its run (it cannot touch another's).
            "BUCKETRL_TOKEN": self.tokens.get(f"{role}@{run}") or self.tokens[role],
            "BUCKETRL_RUN": run,
            "BUCKETRL_WORKER_ID": worker_id,
            # One process per core at most: oversubscribed BLAS threads make every process slower.
            "OMP_NUM_THREADS": threads,
            "MKL_NUM_THREADS": threads,
            "TOKENIZERS_PARALLELISM": "false",
            **self.cfg.worker_env,
        }

    def start_trainer(self, run: str | None = None) -> Service:
        argv = trainer_command(self.cfg.trainer_procs)
        return self._service(self.trainer_name(run), argv, self.trainer_env(run)).start()

    def trainer_env(self, run: str | None = None) -> dict[str, str]:
        """One run's trainer's environment (the tokens must have been made)."""
        run = run or self.runs[0]
        cfg, name = self.run_cfgs[run], self.trainer_name(run)
        return {
            **self._worker_env("trainer", name, run),
            "BUCKETRL_RUN_SPEC": str(self.spec_path(run)),
            "BUCKETRL_LR": repr(cfg.effective_lr()),
            "BUCKETRL_MAX_STEPS": str(cfg.effective_max_steps()),
            **({"BUCKETRL_LR_SCHEDULE": schedule} if (schedule := cfg.demo_lr_schedule()) else {}),
            "BUCKETRL_SYNC_EVERY": str(cfg.sync_every),
            "BUCKETRL_CHECKPOINT_EVERY": str(cfg.checkpoint_every),
            "BUCKETRL_SEED": str(cfg.seed),
            "BUCKETRL_WORK_DIR": str(self.dir / "work" / name),
            "BUCKETRL_AUDIT_LOG": str(self.logs / f"{name}-audit.jsonl"),
            # --report-to, else the user's own BUCKETRL_REPORT_TO, else TensorBoard event files in
            # <dir>/tensorboard/<run> when tensorboard is installed (`tensorboard --logdir <dir>/tensorboard`).
            "BUCKETRL_REPORT_TO": cfg.report_to or os.environ.get("BUCKETRL_REPORT_TO") or default_report_to(),
            "BUCKETRL_TRACKER_DIR": os.environ.get("BUCKETRL_TRACKER_DIR") or str(self.dir),
            **({"BUCKETRL_DATASET_FILE": str(cfg.upload_path)} if cfg.upload_path is not None else {}),
            **({"BUCKETRL_SHARD_BASE": "true"} if cfg.trainer_shard_base else {}),
            **cfg.trainer_env,
        }

    def start_generator(self, index: int) -> Service:
        name = f"gen-{index}"
        env = {
            **self._worker_env("generator", name),
            "BUCKETRL_ENGINE": self.cfg.engine_of(index),
            "BUCKETRL_METRICS_INTERVAL_S": "2",
            "BUCKETRL_REWARD_WORKERS": "1",
            "BUCKETRL_PROMPT_LEASE_TTL_S": repr(self.cfg.prompt_lease_ttl_s),
            "BUCKETRL_ADAPTER_CACHE_DIR": str(self.dir / "work" / name),
            # Several runs: pool mode, one engine serving every run by its share (bucketrl/generator/pool.py).
            **({"BUCKETRL_RUNS": ",".join(self.runs)} if self.cfg.runs is not None else {}),
            # An external trainer's requests (through the gateway) instead of the run's prompts.
            **({"BUCKETRL_SERVE_COMPLETION_JOBS": "1"} if self.cfg.external_trainer else {}),
            **self.cfg.generator_env,
        }
        if self.agents is not None:  # every generator serves agents, behind the agent router
            env.update(agents.generator_env(self.agents, index))
        if self.model_dir is not None:
            env["BUCKETRL_MODEL_PATH"] = str(self.model_dir)
        return self._service(name, bucketrl_command("generator"), env).start()

    @property
    def endpoint_file(self) -> Path:
        return self.dir / "endpoint.json"

    def start_gateway(self) -> Service:
        """``bucketrl gateway`` for an external trainer; its URL under "gateway" in endpoint.json once it serves."""
        assert self.gateway_port is not None
        url_file = self.dir / external.GATEWAY_URL_FILE
        url_file.unlink(missing_ok=True)
        merge_json_file(self.endpoint_file, {}, drop=("gateway",))
        argv = external.gateway_argv(self.gateway_port, url_file)
        svc = self._service("gateway", argv, external.gateway_env(self)).start()
        # The gateway writes "<url>\n" once it has bound its port.
        wait_until(lambda: url_file.exists() and url_file.read_text().endswith("\n"), 60, "the gateway to listen", svc)
        url = url_file.read_text().strip()
        wait_until(lambda: external.gateway_healthy(url), 60, "the gateway to serve", svc, poll_s=0.2)
        self.gateway_url = url
        self.gateway_port = int(url.rsplit(":", 1)[1])  # a restart binds the same port: TRL keeps its URL
        merge_json_file(self.endpoint_file, {"gateway": {"url": url, "run": self.cfg.run, "pid": svc.pid}})
        return svc

    def start_agent_router(self) -> Service:
        """``bucketrl agent-router`` on --openai-port; its URL under "openai" in endpoint.json once it serves."""
        assert self.agents is not None
        merge_json_file(self.endpoint_file, {}, drop=("openai",))
        env = {"BUCKETRL_OPENAI_TOKEN": self.agents.token}
        return self._service(agents.ROUTER, agents.router_argv(self, self.agents), env).start()

    def start_all(self, on_step: Any = None) -> None:
        """Redis (unless external), proxy, trainer, then the generators; ``on_step(text)`` reports progress.

        With an external trainer, ``up`` creates the run in the trainer's place and the gateway starts last."""
        say = on_step or (lambda _text: None)
        if self.endpoint_file.exists():  # an earlier session's agents' endpoint and gateway are gone
            merge_json_file(self.endpoint_file, {}, drop=("openai", "gateway"))
        if not self.cfg.redis_url:
            say(f"redis      {self.redis_url}  (append-only file in {self.dir / 'redis'})")
            self.start_redis()
        say(f"proxy      {self.proxy_url}  bucket {self.bucket_url}")
        self.start_proxy()
        if self.cfg.external_trainer:
            say("run        created or confirmed from run_spec.json (no bucketrl trainer: yours trains)")
            external.create_run(self)
        else:
            for run in self.runs:
                say(f"{self.trainer_name(run):<10} creates or resumes the run {run}")
                self.start_trainer(run)
        for i in range(self.cfg.generators):
            say(f"gen-{i}      engine {self.cfg.engine_of(i)}")
            self.start_generator(i)
        if self.agents is not None:
            say(f"agents     one URL on port {self.agents.router_port} over {self.cfg.generators} generator(s)")
            self.start_agent_router()
        if self.gateway_port is not None:
            say("gateway    vLLM's routes for TRL's AsyncGRPOTrainer")
            self.start_gateway()

    def restart(self, name: str, *, kill: bool = False) -> Service:
        """Stop (SIGTERM, or SIGKILL with ``kill``) and start one service again with the same settings."""
        svc = self.services[name]
        if kill:
            svc.kill()
        else:
            svc.stop()
        if name == "redis":
            return self.start_redis()
        if name == "proxy":
            return self.start_proxy()
        if name == "gateway":
            return self.start_gateway()
        return svc.start()

    def stop_workers(self, timeout_s: float = 60.0) -> None:
        """SIGTERM every worker at once (generators release their prompts, the trainer checkpoints), then wait."""
        workers = [s for n, s in self.services.items() if n not in ("proxy", "redis")]
        for svc in workers:
            svc.signal(15)
        deadline = time.monotonic() + timeout_s
        for svc in workers:
            svc.stop(max(1.0, deadline - time.monotonic()))

    def stop_all(self) -> None:
        self.stop_workers()
        for name in ("proxy", "redis"):
            if name in self.services:
                self.services[name].stop(15)

    # -- access ---------------------------------------------------------------------------------------------

    def client(self, role: str = "viewer", **kw: Any) -> ProxyClient:
        return ProxyClient(self.proxy_url, self.cfg.run, self.tokens[role], **kw)

    def http(self, role: str = "viewer", timeout_s: float = 10.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.proxy_url, headers={"Authorization": f"Bearer {self.tokens[role]}"}, timeout=timeout_s
        )
