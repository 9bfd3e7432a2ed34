"""``bucketrl up``'s main loop: start the local cluster, watch and supervise it, stop it, report.

Supervision: a generator, the proxy or Redis that dies is started again (that is what a container
orchestrator would do; the run loses nothing, see docs/design.md section 4); a trainer that fails with exit code 1
is restarted and resumes from its checkpoint; exit 2 (a configuration error, from any worker: its one-line
reason is printed and kept in ``<dir>/stopped.json``) or 3 (fenced trainer) ends the run. A
service is given up on only when it keeps dying quickly (``UpConfig.restart_policy``: 5 deaths within 60 s
by default), never for the number of restarts over a long run. The
run ends when the trainer exits 0 (``max_steps`` reached) or on Ctrl-C / SIGTERM: workers get SIGTERM
first (generators release their prompts, the trainer checkpoints), the proxy and Redis last. With
``--external-trainer`` there is no trainer to finish: ``up`` serves (the gateway supervised like a generator) until
Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live

from bucketrl.preflight import CONFIG_ERROR_PREFIX, EXIT_CONFIG, ConfigError
from bucketrl.status_cli import record_last_up
from bucketrl.up import multiview, report
from bucketrl.up.cluster import LocalCluster
from bucketrl.up.config import UpConfig
from bucketrl.up.live import render, reward_errors
from bucketrl.up.synclatency import measure
from bucketrl.up.watch import RunWatcher

TRAINER_FATAL = {3: "fenced by a newer trainer"}
# Why the last `bucketrl up` of a run directory stopped on a configuration error (`bucketrl status` shows it).
STOPPED_FILE = "stopped.json"
SAVE_EVERY_S = 15.0


class _Stop:
    def __init__(self) -> None:
        self.requested = 0

    def __call__(self, signum: int, _frame: Any) -> None:
        self.requested += 1
        if self.requested > 1:  # a second Ctrl-C: stop waiting for clean exits
            raise KeyboardInterrupt


def run_up(cfg: UpConfig, console: Console | None = None, live: bool | None = None) -> int:
    """Run ``bucketrl up``; returns the process exit code (0 = the trainer finished or Ctrl-C)."""
    console = console or Console()
    live = console.is_terminal if live is None else live
    live = live and not cfg.external_trainer  # its view is of bucketrl's trainer's steps: lines instead
    cluster = LocalCluster(cfg)
    runs = ", ".join(cluster.runs)
    what = f"run [cyan]{runs}[/]" if cfg.runs is None else f"runs [cyan]{runs}[/] on one generator pool"
    console.print(f"[bold]bucketrl up[/] {what} in {cluster.dir}", soft_wrap=True)
    warm = " (its warm start: ~1 min)" if cfg.warm_start_steps() else ""
    console.print(f"  checking   model{warm}, dataset, LoRA targets, context, reward…")
    try:
        cluster.prepare()  # the preflight: a ConfigError here stops before any process starts
    except BaseException:
        cluster.release()
        raise
    (cluster.dir / STOPPED_FILE).unlink(missing_ok=True)
    record_last_up(cluster.dir)  # what `bucketrl status` with no options shows
    if cluster.report is not None:
        for line in cluster.report.lines():
            console.print(f"  {line}", soft_wrap=True)
    stop = _Stop()
    # SIGHUP: the terminal closed. Stop as cleanly as for Ctrl-C (a SIGKILL of `up` itself is covered by the
    # children's parent-death signal, bucketrl.up.processes).
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    # One watcher per run (several runs on one pool: bucketrl.up.multiview shows them side by side).
    watchers = {run: RunWatcher(cluster.proxy_url, run, cluster.tokens["viewer"]) for run in cluster.runs}
    for run, w in watchers.items():
        w.load_history(cluster.run_home(run))
    watcher = watchers[cluster.runs[0]]
    started = time.monotonic()
    code = 0
    try:
        # soft_wrap: an address or a token is never broken over lines (it stays copyable in any width).
        cluster.start_all(lambda text: console.print(f"  starting {text}", soft_wrap=True))
        console.print(f"  dashboard  {cluster.dashboard_url}", soft_wrap=True)
        console.print(f"  logs       {cluster.logs}", soft_wrap=True)
        if cluster.gateway_url is not None:
            console.print(
                f"  gateway    {cluster.gateway_url}  (TRL: vllm_server_base_url; also in {cluster.endpoint_file})",
                soft_wrap=True,
            )
        if cfg.openai_port is not None:
            console.print(
                f"  agents     one OpenAI-compatible URL over every generator: URL and token in "
                f"{cluster.endpoint_file} (written once it serves)",
                soft_wrap=True,
            )
        code = _supervise(cluster, watchers, stop, console, live, started)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted again: killing the services[/]")
        for svc in cluster.services.values():
            svc.kill()
        code = 130
    except ConfigError as exc:  # found once the proxy answers (an external trainer's run spec): one line
        console.print(f"[red]bucketrl up:[/] {exc}", soft_wrap=True)
        code = EXIT_CONFIG
    except Exception as exc:
        console.print(f"[red]bucketrl up failed:[/] {exc}")
        code = 1
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            console.print("stopping workers…")
            cluster.stop_workers()
            if cluster.services.get("proxy") and cluster.services["proxy"].alive:
                for w in watchers.values():
                    w.poll()  # the generators' last pushes
            console.print("stopping proxy and redis…")
            for name in ("proxy", "redis"):
                if name in cluster.services:
                    cluster.services[name].stop(15)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for w in watchers.values():
            w.close()
        cluster.release()
    if cfg.runs is not None:
        multiview.final_report(cluster, watchers, console, time.monotonic() - started, _resume_hint(cluster, code))
    else:
        _final_report(cfg, cluster, watcher, console, code, time.monotonic() - started)
    return code


def _final_report(
    cfg: UpConfig, cluster: LocalCluster, watcher: RunWatcher, console: Console, code: int, wall: float
) -> None:
    """The summary table, summary.json, plots and the final adapter's location, with how to resume."""

    resume = _resume_hint(cluster, code)
    if cfg.external_trainer:
        latest = watcher.status.latest_version if watcher.status is not None else 0
        console.print(f"external trainer: the run's latest version is v{latest}; {resume}", soft_wrap=True)
    elif watcher.pushes and not watcher.trainer_series("perf/step_s"):
        console.print(f"no trainer step was taken (no summary); {resume}", soft_wrap=True)
    elif watcher.pushes:
        sync = measure(cluster.logs, cfg.run)
        figures = report.summarize(watcher, wall, sync)
        figures["adapter"] = multiview.adapter_location(cluster, cluster.cfg.run, figures.get("latest_version"))
        watcher.save(cluster.dir)
        report.write_summary(figures, cluster.dir)
        console.print(report.summary_table(figures, title=f"bucketrl up · run {cfg.run}"))
        try:
            paths = report.plot(watcher, cluster.dir, title=f"(run {cfg.run})")
            console.print("plots: " + ", ".join(str(p) for p in paths), soft_wrap=True)
        except Exception as exc:  # a plot must never hide the summary
            console.print(f"[yellow]plots failed: {exc}[/]")
        console.print(f"summary: {cluster.dir / 'summary.json'}   {resume}", soft_wrap=True)
        if figures.get("adapter"):
            console.print(f"final adapter: {figures['adapter']}", soft_wrap=True)


def _resume_hint(cluster: LocalCluster, code: int) -> str:
    # After a configuration error the same command fails the same way: say what a rerun needs.
    if code == EXIT_CONFIG:
        return f"after fixing it: bucketrl up --dir {cluster.dir} <the corrected option> (the other options are kept)"
    return f"resume: bucketrl up --dir {cluster.dir}"


def _states(cluster: LocalCluster) -> dict[str, str]:
    out = {}
    for name, svc in cluster.services.items():
        if svc.alive:
            out[name] = f"running pid {svc.pid}" + (f" (start {svc.starts})" if svc.starts > 1 else "")
        else:
            out[name] = f"exited {svc.returncode}"
    return out


def _supervise(
    cluster: LocalCluster, watchers: dict[str, RunWatcher], stop: _Stop, console: Console, live: bool, started: float
) -> int:

    cfg = cluster.cfg
    watcher = watchers[cluster.runs[0]]
    max_steps = cfg.effective_max_steps()
    note = ""
    last_print = last_save = 0.0

    def view() -> Any:
        if cfg.runs is not None:
            return multiview.render_runs(cluster, watchers, started=started, services=_states(cluster), note=note)
        return render(
            watcher,
            run=cfg.run,
            max_steps=max_steps,
            started=started,
            dashboard=cluster.dashboard_url,
            services=_states(cluster),
            note=note,
        )

    live_ctx: Any = contextlib.nullcontext()
    if live:
        # auto_refresh off: no refresh thread in this process (children are forked from it).
        live_ctx = Live(view(), console=console, auto_refresh=False, transient=False)
    with live_ctx as lv:
        # An external trainer's run ends when `up` is stopped (Ctrl-C / SIGTERM): nothing here knows its end.
        while not stop.requested:
            for w in watchers.values():
                w.poll()
            if cfg.runs is not None:
                multiview.snapshot_shares(watchers)  # every poll: the split while all runs generate
            if not cfg.external_trainer:
                code, said = _check_trainers(cluster, console)
                note = said or note
                if code == 0:
                    for w in watchers.values():
                        w.poll()
                    break
                if code is not None:
                    return code
            code, said = _revive(cluster, console)
            note = said or note
            if code is not None:
                return code
            if time.monotonic() - last_save > SAVE_EVERY_S:
                last_save = time.monotonic()
                for run, w in watchers.items():  # a killed `up` keeps its history for the next one's summary
                    w.save(cluster.run_home(run))
            if live:
                lv.update(view(), refresh=True)
            elif time.monotonic() - last_print > 10:
                last_print = time.monotonic()
                if cfg.runs is not None:
                    multiview.print_lines(console, cluster, watchers)
                else:
                    _print_line(console, watcher, max_steps, external=cfg.external_trainer)
            _sleep(1.0, stop)
    return 0


def _check_trainers(cluster: LocalCluster, console: Console) -> tuple[int | None, str]:
    """(exit code for `up`, or None to go on; a note for the view): 0 once every run's trainer has finished (exited
    0); each trainer is restarted by its own policy, and any one's fatal exit ends `up`."""
    note = ""
    finished = 0
    for run in cluster.runs:
        code, said = _check_trainer(cluster, cluster.trainer_name(run), console)
        note = said or note
        if code == 0:
            finished += 1
        elif code is not None:
            return code, note
    return (0 if finished == len(cluster.runs) else None), note


def _check_trainer(cluster: LocalCluster, name: str, console: Console) -> tuple[int | None, str]:
    """(exit code, or None to go on; a note for the view): a trainer that exited 0 finished its run, one that
    failed resumably is started again."""
    policy = cluster.cfg.restart_policy
    trainer = cluster.services[name]
    if trainer.alive:
        return None, ""
    rc = trainer.returncode
    if rc == 0:
        return 0, f"{name} finished"
    if rc == EXIT_CONFIG:
        return _config_stop(cluster, name, console), ""
    looping = rc not in TRAINER_FATAL and trainer.record_death(policy)
    if rc in TRAINER_FATAL or looping:
        why = (TRAINER_FATAL.get(rc) if rc is not None else None) or f"crash loop: {policy.describe()}"
        console.print(f"[red]{name} exited {rc} ({why}):[/]")
        console.print(trainer.log_tail(15))
        return 1, ""
    trainer.start()
    return None, f"{name} exited {rc}: restarting (it resumes from its checkpoint)"


def _revive(cluster: LocalCluster, console: Console) -> tuple[int | None, str]:
    """Start again every other service found dead (a crash loop raises); a configuration error stops the run."""
    policy = cluster.cfg.restart_policy
    note = ""
    for name in ("redis", "proxy", *cluster.generator_names, "agent-router", "gateway"):
        svc = cluster.services.get(name)
        if svc is None or svc.alive:
            continue
        if svc.returncode == EXIT_CONFIG and (name.startswith("gen-") or name == "gateway"):
            return _config_stop(cluster, name, console), ""
        if svc.record_death(policy):
            raise RuntimeError(f"{name} keeps exiting ({svc.returncode}; {policy.describe()}); see {svc.log_path}")
        note = f"{name} exited {svc.returncode}: restarting"
        cluster.restart(name)
    return None, note


def config_error_reason(svc: Any) -> str:
    """The one-line reason a worker printed before exiting with EXIT_CONFIG (else its last log line)."""
    lines = svc.log_tail(200).splitlines()
    for line in reversed(lines):
        if CONFIG_ERROR_PREFIX in line:
            return line[line.index(CONFIG_ERROR_PREFIX) + len(CONFIG_ERROR_PREFIX) :].strip()
    return lines[-1].strip() if lines else "(no output)"


def _config_stop(cluster: LocalCluster, name: str, console: Console) -> int:
    """A worker exited with EXIT_CONFIG: print its reason, record it for `bucketrl status`, stop the run."""
    svc = cluster.services[name]
    reason = config_error_reason(svc)
    console.print(f"[red]{name} stopped on a configuration error:[/] {reason}", soft_wrap=True)
    console.print(f"  (log: {svc.log_path})", soft_wrap=True)
    record = {"service": name, "reason": reason, "ts": time.time()}
    (cluster.dir / STOPPED_FILE).write_text(json.dumps(record) + "\n")
    return EXIT_CONFIG


def _print_line(console: Console, watcher: RunWatcher, max_steps: int, *, external: bool = False) -> None:
    """One progress line (--no-live): the step and key figures, or each service's phase while it starts; with an
    external trainer, the versions it published and what each generator holds."""

    s = watcher.status
    if s is None:
        console.print(f"starting: {watcher.waiting_for()}", soft_wrap=True)
        return
    if external:
        workers = ", ".join(f"{w.worker_id}:{w.loaded_versions}" for w in s.workers)
        console.print(f"external trainer  v{s.latest_version}  workers {workers}", soft_wrap=True)
        return
    phases = ", ".join(f"{w.worker_id}: {w.phase}" for w in s.workers if w.phase)
    errors = "; ".join(f"{k}: {m}" for k, m in reward_errors(watcher).items())[:300]
    if s.trainer.step == 0:
        # Before the first step, the generators' first reward errors (a reward that hangs takes its timeout per
        # completion: the first step may be minutes away).
        shown = f"  REWARD ERRORS ({errors})" if errors else ""
        console.print(f"step 0/{max_steps}  v{s.latest_version}  {phases}{shown}", soft_wrap=True)
        return
    reward = watcher.rolling_reward(10)
    shown = "–" if reward is None else f"{reward:.3f}"
    line = (
        f"step {s.trainer.step}/{max_steps}  v{s.latest_version}  reward {shown}"
        f"  queue {s.queue.groups}/{s.queue.capacity}  workers "
        + ", ".join(f"{w.worker_id}:{w.loaded_versions}" for w in s.workers)
    )
    trainer = watcher.trainer_id()
    unscorable = watcher.latest(trainer or "", "reward/unscorable_frac")
    if unscorable:
        line += f"  UNSCORABLE {unscorable:.0%} ({errors})"
    console.print(line, soft_wrap=True)


def _sleep(seconds: float, stop: _Stop) -> None:
    deadline = time.monotonic() + seconds
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.05)


def default_dir(run: str) -> Path:
    return Path("runs") / run
