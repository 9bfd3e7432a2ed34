"""The SkyPilot recipes in ``deploy/skypilot/`` as SkyPilot and the workers would take them.

    .venv/bin/python -m pytest -q tests/deploy/test_skypilot.py

- **SkyPilot's own parser and schema**: each recipe is loaded by the pinned ``skypilot`` (locks/skypilot.txt) in
  its own virtualenv ``.venv-sky`` (its pins clash with ours: click < 8.2, uvicorn < 0.36), through the calls its
  CLI makes (``tests/deploy/skypilot_parse.py``), offline; a misspelt field is refused by the same check.
- **Real settings**: every ``BUCKETRL_*`` name a recipe sets or exports is a field of the settings class of the
  process it runs (proxy, relay, trainer, generator).
- **Run here**: each recipe's exact ``setup`` and ``run`` text runs in bash on this machine, with the environment
  SkyPilot would give it (its ``envs``, ``--env``/``--secret`` values, ``SKYPILOT_*``; the repository stands in for
  ``~/sky_workdir``), against a local S3 server (moto): the control plane (its own Redis with the append-only file,
  the proxy over TLS with a certificate from ``certs.sh``), a relay, a generator that picks that relay by its
  cloud/region, and a trainer that trains and, started again, resumes from the bucket. Only environment and
  secrets differ from a cloud VM: loopback addresses and ports, CPU, the tiny model.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from bucketrl.up.ports import free_port
from tests.deploy.support import ROOT, env_names, settings_class
from tests.support.services import MotoServer

RECIPES = ROOT / "deploy" / "skypilot"
SKY_PYTHON = ROOT / ".venv-sky" / "bin" / "python"
SKY_PIN = re.search(r"^skypilot==(\S+)$", (ROOT / "locks" / "skypilot.txt").read_text(), re.M)
# What each recipe launches (a job group's tasks by their name's prefix).
ROLE = {"control-plane": "proxy", "relay": "relay", "trainer": "trainer", "generator": "generator"}
PROXY_URL = "https://203.0.113.7:8443"  # documentation address (RFC 5737): nothing is dialled while parsing
# The secrets each recipe is launched with (deploy/skypilot/up.sh, docs/across-clouds.md).
LAUNCH_SECRETS = {
    "control-plane": ("BUCKETRL_TOKENS", "TLS_CERT_PEM", "TLS_KEY_PEM", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"),
    "relay": ("CA_PEM", "RELAY_CERT_PEM", "RELAY_KEY_PEM", "RELAY_STAGING_TOKEN"),
    "run": ("TRAINER_TOKEN", "GENERATOR_TOKEN", "CA_PEM"),
    "trainer": ("TRAINER_TOKEN", "CA_PEM"),
    "generator": ("GENERATOR_TOKEN", "CA_PEM"),
}
TOKENS = {role: f"{role}-token-{'x' * 20}" for role in ("admin", "trainer", "generator", "viewer", "relay")}
OPTIONAL_SECRETS = {"relay": ["RELAY_STAGING_TOKEN"]}  # declared empty: a launch may leave them out


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _tasks() -> dict[str, dict[str, Any]]:
    """Every task of every recipe, by "file" or "file:task" (the job group's)."""
    out = {}
    for path in sorted(RECIPES.glob("*.yaml")):
        docs = _docs(path)
        if len(docs) == 1:
            out[path.stem] = docs[0]
        else:
            out.update({f"{path.stem}:{d['name']}": d for d in docs[1:]})
    return out


def _role(key: str) -> str:
    name = key.split(":")[-1]
    return next(role for prefix, role in ROLE.items() if name.startswith(prefix.split("-")[0]))


# ------------------------------------------------------------------------------------------ SkyPilot parse ----


def _sky(loads: list[dict[str, Any]], home: Path) -> list[dict[str, Any]]:
    """SkyPilot's answer to each load (``{"parsed": ...}`` or ``{"refused": message}``), in one process."""
    if not SKY_PYTHON.exists():
        pytest.fail(
            f"{SKY_PYTHON} is missing: SkyPilot's own virtualenv, built by scripts/setup.sh "
            "(python3 -m venv .venv-sky && .venv-sky/bin/pip install -c locks/skypilot.txt skypilot)"
        )
    env = {"PATH": os.environ["PATH"], "HOME": str(home)}  # SkyPilot writes ~/.sky: not the developer's
    proc = subprocess.run(
        [str(SKY_PYTHON), str(ROOT / "tests" / "deploy" / "skypilot_parse.py")],
        input=json.dumps(loads),
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_recipes_load_through_skypilots_parser_and_schema(tmp_path: Path) -> None:
    """Each recipe loads as `sky launch` / `sky jobs launch` would load it, with the --env values its comment
    names; the job group is one (parallel, no inter-connection, the trainer primary) and keeps spot where it
    belongs; launched with up.sh's --secret names, no secret is left unresolved (SkyPilot refuses a launch that
    leaves one); a required --env left out and a misspelt field are refused by the same check."""
    assert SKY_PIN, "locks/skypilot.txt pins no skypilot"
    env = {"PROXY_URL": PROXY_URL, "BUCKETRL_BUCKET_URL": "s3://my-bucket/rl"}
    recipes = sorted(RECIPES.glob("*.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text((RECIPES / "trainer.yaml").read_text().replace("  accelerators:", "  acelerators:", 1))
    loads = [{"path": str(r), "env": env} for r in recipes]
    loads += [{"path": str(RECIPES / "trainer.yaml")}, {"path": str(broken), "env": env}]
    # As launched (up.sh, the docs): with its --secret values, no secret is left for SkyPilot to ask for.
    loads += [{"path": str(RECIPES / f"{n}.yaml"), "env": env, "secrets": dict.fromkeys(LAUNCH_SECRETS[n], "x")}
              for n in sorted(LAUNCH_SECRETS)]  # fmt: skip
    # A relay launched by hand without the optional staging token: nothing left to ask for either.
    certs_only = dict.fromkeys(("CA_PEM", "RELAY_CERT_PEM", "RELAY_KEY_PEM"), "x")
    loads += [{"path": str(RECIPES / "relay.yaml"), "env": env, "secrets": certs_only}]
    replies = _sky(loads, tmp_path / "home")
    answers, (missing, refused), launched, (tokenless,) = (
        replies[: len(recipes)],
        replies[len(recipes) : len(recipes) + 2],
        replies[len(recipes) + 2 : -1],
        replies[-1:],
    )
    (relay_task,) = tokenless["parsed"]["tasks"]
    assert relay_task["required_secrets"] == [] and relay_task["secrets_with_values"] == sorted(certs_only)
    for name, answer in zip(sorted(LAUNCH_SECRETS), launched, strict=True):
        assert [t["required_secrets"] for t in answer["parsed"]["tasks"]] in ([[]], [[], [], []]), (name, answer)
        for secret in LAUNCH_SECRETS[name]:
            assert f"--secret {secret}" in (RECIPES / "up.sh").read_text(), f"up.sh does not pass {secret}"
    for recipe, answer in zip(recipes, answers, strict=True):
        assert "parsed" in answer, f"SkyPilot refused {recipe.name}: {answer['refused']}"
    seen = {r.stem: a["parsed"] for r, a in zip(recipes, answers, strict=True)}
    assert {p["sky_version"] for p in seen.values()} == {SKY_PIN.group(1)}

    group = seen["run"]
    assert group["job_group"] and group["inter_connection"] is False and group["primary_tasks"] == ["trainer"]
    tasks = {t["name"]: t for t in group["tasks"]}
    assert set(tasks) == {"trainer", "generators-aws", "generators-gcp"}
    assert [r["use_spot"] for r in tasks["trainer"]["resources"]] == [False]
    generators = [t for n, t in tasks.items() if n.startswith("generators")]
    assert sum(t["num_nodes"] for t in generators) == 8
    assert {r["cloud"] for t in generators for r in t["resources"]} == {"AWS", "GCP"}
    assert all(r["use_spot"] for t in generators for r in t["resources"])
    standalone = seen["generator"]["tasks"][0]
    assert all(r["use_spot"] for r in standalone["resources"])
    assert len({(r["cloud"], r["region"]) for r in standalone["resources"]}) >= 3
    control = seen["control-plane"]["tasks"][0]["resources"]
    assert [(r["use_spot"], r["ports"]) for r in control] == [(False, ["8443"])]
    # Secrets are names to fill at launch (`--secret NAME`), never values in a file; an optional one is empty.
    for name, parsed in seen.items():
        for task in parsed["tasks"]:
            assert task["secrets_with_values"] == [], f"{name}: a secret has a value in the YAML"
            assert task["secret_names"] == OPTIONAL_SECRETS.get(name, []), name
    launched_relay = launched[sorted(LAUNCH_SECRETS).index("relay")]["parsed"]["tasks"][0]
    assert "RELAY_STAGING_TOKEN" in launched_relay["secrets_with_values"]  # up.sh's --secret fills it
    assert {"TRAINER_TOKEN", "CA_PEM"} <= set(tasks["trainer"]["required_secrets"])
    assert "TRAINER_TOKEN" not in standalone["required_secrets"]

    assert "'PROXY_URL' is None" in missing.get("refused", ""), missing
    assert "acelerators" in refused.get("refused", ""), refused


FAKE_SKY = """#!/usr/bin/env bash
# Stands in for `sky`: records each call's arguments and the secrets it would read from the environment.
python3 -c 'import json, os, sys; print(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k, "")
    for k in ("BUCKETRL_TOKENS", "RELAY_STAGING_TOKEN")}}))' "$@" >> "$SKY_CALLS"
if [ "$1" = status ]; then echo 127.0.0.1; fi
"""


def test_up_sh_gives_each_relay_a_relay_token_of_the_control_plane(tmp_path: Path) -> None:
    """up.sh, run with a stand-in `sky`: it mints a relay token (also into a tokens.env from before it had one),
    puts it in the control plane's BUCKETRL_TOKENS as the `relay` role and hands it to every relay as the secret
    RELAY_STAGING_TOKEN, through the environment only (never on a command line)."""
    sky, calls, certs = tmp_path / "sky", tmp_path / "calls.jsonl", tmp_path / "certs"
    sky.write_text(FAKE_SKY)
    sky.chmod(0o755)
    certs.mkdir(mode=0o700)
    # A tokens.env from before the relays had a token: the rerun adds one and keeps the others.
    (certs / "tokens.env").write_text("".join(f"{r.upper()}_TOKEN={t}\n" for r, t in TOKENS.items() if r != "relay"))
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "SKY": str(sky), "SKY_CALLS": str(calls),
           "CERTS": str(certs), "BUCKETRL_BUCKET_URL": "s3://b/rl", "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s"}  # fmt: skip
    proc = subprocess.run([str(RECIPES / "up.sh")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    minted = dict(line.split("=", 1) for line in (certs / "tokens.env").read_text().split())
    token = minted["RELAY_TOKEN"]
    assert len(token) >= 32 and minted["TRAINER_TOKEN"] == TOKENS["trainer"]
    made = [json.loads(line) for line in calls.read_text().splitlines()]
    execs = [c for c in made if c["argv"][:1] == ["exec"]]
    control = [c for c in execs if "control-plane.yaml" in " ".join(c["argv"])]
    relays = [c for c in execs if "relay.yaml" in " ".join(c["argv"])]
    assert len(control) == 1 and len(relays) == 2, made
    assert f"relay:{token}" in control[0]["env"]["BUCKETRL_TOKENS"].split(",")
    for call in relays:
        assert call["env"]["RELAY_STAGING_TOKEN"] == token and "RELAY_STAGING_TOKEN" in call["argv"], call
    assert not [c for c in made if token in " ".join(c["argv"])], "a token on a command line"


# ------------------------------------------------------------------------------------------- variables ----


def _known(role: str) -> set[str]:
    if role == "relay":
        from bucketrl.relay.settings import RelaySettings

        # The relay's upstream link is checked like a worker's (TransportSecurity.from_env).
        return set(env_names(RelaySettings)) | {"BUCKETRL_CA_FILE", "BUCKETRL_INSECURE_HTTP"}
    return set(env_names(settings_class(role)))


def test_every_bucketrl_variable_a_recipe_sets_is_a_setting() -> None:
    """A misspelt BUCKETRL_* name would be dropped in silence by pydantic-settings: each task's names (its envs,
    secrets and what its run exports) are fields of the settings class of the process it starts."""
    tasks = _tasks()
    assert len(tasks) == 7
    for key, task in tasks.items():
        text = yaml.safe_dump({k: task.get(k) for k in ("envs", "secrets", "run")})
        names = set(re.findall(r"\bBUCKETRL_[A-Z0-9_]*[A-Z0-9]\b", text))
        unknown = sorted(names - _known(_role(key)))
        assert not unknown, f"deploy/skypilot/{key}: {unknown} is no setting of the {_role(key)}"


def test_the_job_groups_tasks_are_the_standalone_recipes() -> None:
    """run.yaml repeats trainer.yaml's and generator.yaml's setup, run and envs (YAML anchors do not cross
    documents): they must not drift, so the local run of the standalone recipes covers the group's."""
    tasks = _tasks()
    pairs = {"run:trainer": "trainer", "run:generators-aws": "generator", "run:generators-gcp": "generator"}
    for key, source in pairs.items():
        for field in ("setup", "run", "envs", "secrets", "workdir"):
            assert tasks[key][field] == tasks[source][field], f"{key}.{field} differs from {source}.yaml"


# ------------------------------------------------------------------------------------------ run here ----


@dataclass
class Machine:
    """One VM of the recipe, here: its own HOME, the recipe's envs + --env + --secret + SkyPilot's variables."""

    name: str
    recipe: dict[str, Any]
    env: dict[str, str]

    def script(self, part: str) -> list[str]:
        return ["bash", "-c", self.recipe[part]]


def _machine(tmp: Path, name: str, *, env: dict[str, str], secrets: dict[str, str], cloud: str = "AWS",
             region: str = "us-east-1") -> Machine:  # fmt: skip
    recipe = _docs(RECIPES / f"{name}.yaml")[0]
    home = tmp / name
    home.mkdir()
    given = {k: str(v) for k, v in (recipe.get("envs") or {}).items() if v is not None}
    skypilot = {
        "SKYPILOT_TASK_ID": f"sky-managed-2026-12-06_{name}_1-0",
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NUM_GPUS_PER_NODE": "1",
        "SKYPILOT_CLUSTER_INFO": json.dumps({"cluster_name": name, "cloud": cloud, "region": region, "zone": None}),
    }
    base = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
        "HOME": str(home),
        "LANG": "C.UTF-8",
        # The recipes' VENV default is ~/bucketrl-venv; here it is this suite's environment (the setup's no-op case)
        # with this checkout first on the path.
        "VENV": sys.prefix,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
    }
    return Machine(name, recipe, {**base, **given, **skypilot, **env, **secrets})


@contextmanager
def _started(machine: Machine, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """The recipe's run in the background, as SkyPilot runs it on its VM; ended by its process group (the bash
    and everything it started: this test's own processes, by id)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            machine.script("run"), cwd=ROOT, env=machine.env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _setup(machine: Machine) -> str:
    proc = subprocess.run(
        machine.script("setup"), cwd=ROOT, env=machine.env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"{machine.name} setup:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _ready(url: str, trust: ssl.SSLContext, proc: subprocess.Popen[bytes], log: Path, path: str = "/readyz") -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + path, verify=trust, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url}{path} not ready:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_recipes_setup_and_run_here_and_train(tmp_path: Path, moto_server: MotoServer, tiny_model_dir: Path) -> None:
    """The control plane, a relay, a generator and the trainer, each from its recipe's exact setup and run text:
    the trainer trains 2 steps over HTTPS (the generator through the relay of its region), then, run again on a
    fresh machine, resumes from the bucket's checkpoint; Redis kept its append-only file on the machine's disk."""
    from bucketrl.tasks.toy import default_run_spec

    certs = tmp_path / "certs"
    issue = [str(RECIPES / "certs.sh")]
    subprocess.run([*issue, "ca", str(certs)], check=True)
    subprocess.run([*issue, "server", str(certs), "proxy", "127.0.0.1"], check=True)
    subprocess.run([*issue, "server", str(certs), "relay", "127.0.0.1"], check=True)
    pem = {p.name: p.read_text() for p in certs.iterdir()}
    trust = ssl.create_default_context(cafile=certs / "ca.pem")
    moto_server.create_bucket("skypilot-run")
    spec = tmp_path / "spec.json"
    spec.write_text(default_run_spec(tiny_model_dir).model_dump_json())
    proxy_port, relay_port = free_port(), free_port()
    proxy_url, relay_url = f"https://127.0.0.1:{proxy_port}", f"https://127.0.0.1:{relay_port}"
    machines = tmp_path / "machines"
    machines.mkdir()
    # A job group's tasks all receive every --secret (SkyPilot applies them group-wide).
    group_secrets = {"TRAINER_TOKEN": TOKENS["trainer"], "GENERATOR_TOKEN": TOKENS["generator"]}
    group_secrets["CA_PEM"] = pem["ca.pem"]

    control = _machine(
        machines, "control-plane",
        env={"BUCKETRL_BUCKET_URL": "s3://skypilot-run/rl", "BUCKETRL_S3_ENDPOINT_URL": moto_server.endpoint,
             "BUCKETRL_HOST": "127.0.0.1", "BUCKETRL_PORT": str(proxy_port), "REDIS_PORT": str(free_port())},
        secrets={"BUCKETRL_TOKENS": ",".join(f"{r}:{t}" for r, t in TOKENS.items()),
                 "TLS_CERT_PEM": pem["proxy.pem"], "TLS_KEY_PEM": pem["proxy.key"],
                 "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"},
    )  # fmt: skip
    relay = _machine(
        machines, "relay", cloud="GCP", region="us-central1",
        env={"PROXY_URL": proxy_url, "BUCKETRL_RELAY_HOST": "127.0.0.1", "BUCKETRL_RELAY_PORT": str(relay_port)},
        secrets={"CA_PEM": pem["ca.pem"], "RELAY_CERT_PEM": pem["relay.pem"], "RELAY_KEY_PEM": pem["relay.key"],
                 "RELAY_STAGING_TOKEN": TOKENS["relay"]},
    )  # fmt: skip
    generator = _machine(
        machines, "generator", cloud="GCP", region="us-central1",
        env={"PROXY_URL": proxy_url, "RELAY_URLS": f"aws/us-east-2=https://192.0.2.1:1 gcp/us-central1={relay_url}",
             "BUCKETRL_ENGINE": "transformers", "BUCKETRL_DEVICE": "cpu"},
        secrets=group_secrets,
    )  # fmt: skip
    trainer_env = {"PROXY_URL": proxy_url, "BUCKETRL_RUN_SPEC": str(spec), "BUCKETRL_DEVICE": "cpu",
                   "BUCKETRL_DTYPE": "float32", "BUCKETRL_LR": "3e-3", "BUCKETRL_MAX_STEPS": "2",
                   "BUCKETRL_CHECKPOINT_EVERY": "1", "BUCKETRL_FINAL_EVAL_WAIT_S": "0"}  # fmt: skip
    trainer = _machine(machines, "trainer", env=trainer_env, secrets=group_secrets)

    for machine in (control, relay, generator, trainer):
        assert "is in" in _setup(machine), f"{machine.name}: setup installed instead of finding bucketrl"

    logs = tmp_path / "logs"
    logs.mkdir()
    try:
        _run_all(control, relay, generator, trainer, logs, machines, trust, proxy_url, relay_url)
    except BaseException:
        for log in sorted(logs.iterdir()):  # pytest prints this with the failure
            print(f"----- {log.name}\n{log.read_text()[-3000:]}")
        raise


def _run_all(control: Machine, relay: Machine, generator: Machine, trainer: Machine, logs: Path, machines: Path,
             trust: ssl.SSLContext, proxy_url: str, relay_url: str) -> None:  # fmt: skip
    with _started(control, logs / "control.log") as cp:
        _ready(proxy_url, trust, cp, logs / "control.log")
        # The relay first, as up.sh does: a generator that finds it down starts on the home proxy, its fallback.
        with _started(relay, logs / "relay.log") as rl:
            _ready(relay_url, trust, rl, logs / "relay.log", "/relay/stats")
            with _started(generator, logs / "generator.log") as gen:
                stats, second = _train(trainer, logs, machines, trust, relay_url, gen)
        headers = {"Authorization": f"Bearer {TOKENS['viewer']}"}
        status = httpx.get(f"{proxy_url}/v1/runs/rl-1/status", headers=headers, verify=trust, timeout=30).json()

    assert status["trainer"]["step"] == 2 and status["latest_version"] == 3, status["trainer"]
    assert "resumed from checkpoint step 2" in second.stdout + second.stderr, second.stderr[-3000:]
    # The generator dialled its region's relay (and fetched every adapter version through it); the relay pulled
    # versions before their commit with its staging token (up.sh's wiring: relay:<token> at the control plane).
    assert stats["staged_fetches"] >= 1, stats
    assert f"gcp/us-central1: {relay_url},{proxy_url}" in (logs / "generator.log").read_text()
    aof = list((machines / "control-plane" / "bucketrl-data" / "redis").rglob("*.aof"))
    assert aof and any(p.stat().st_size > 0 for p in aof), aof


def _train(trainer: Machine, logs: Path, machines: Path, trust: ssl.SSLContext, relay_url: str,
           gen: subprocess.Popen[bytes]) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:  # fmt: skip
    """The trainer's recipe twice: 2 steps, then again on a fresh machine (a recovered job), which resumes."""
    first = subprocess.run(trainer.script("run"), cwd=ROOT, env=trainer.env, capture_output=True, text=True,
                           timeout=240)  # fmt: skip
    gen_log = (logs / "generator.log").read_text()[-3000:]
    assert first.returncode == 0, f"trainer:\n{first.stderr[-4000:]}\ngenerator:\n{gen_log}"
    # A recovered trainer job runs the same script on a new machine (a fresh HOME): it resumes from the
    # bucket's checkpoint, here the last one, so it has nothing left to train.
    (machines / "trainer").rename(machines / "trainer-before")
    (machines / "trainer").mkdir()
    second = subprocess.run(trainer.script("run"), cwd=ROOT, env=trainer.env, capture_output=True, text=True,
                            timeout=240)  # fmt: skip
    assert second.returncode == 0, f"trainer, restarted:\n{second.stderr[-4000:]}"
    stats = httpx.get(relay_url + "/relay/stats", verify=trust, timeout=30).json()
    # Still serving, or gone with exit 0 once the trainer declared the run finished (generation/finish).
    assert gen.poll() in (None, 0), (logs / "generator.log").read_text()[-3000:]
    return stats, second
