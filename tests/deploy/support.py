"""Readers for the deployment files, shared by the tests in ``tests/deploy/``.

No Docker engine or cluster exists here, so each file is read the way its tool would read it:

- Dockerfiles: instructions with line continuations, global ``ARG`` defaults substituted into ``FROM``, the stage
  graph (``FROM <stage>``) and the effective ``USER`` of the final stage.
- ``.dockerignore``: Docker's rule (patterns in order, ``!`` re-includes, the last match wins, a pattern that
  matches a directory matches everything under it).
- Compose files: ``${VAR}`` interpolation with Compose's operators (``:-``, ``-``, ``:?``, ``?``, ``:+``, ``+``,
  ``$$``), and the Compose merge rules this project's override relies on.
- Helm: the chart rendered offline by the Helm SDK that ``helm-python-sdk`` embeds (``libhelm_c``, no ``helm``
  binary), and Kubernetes' own ``$(VAR)`` expansion inside container ``env``.
- Settings: the ``BUCKETRL_*`` names each service's pydantic-settings class reads.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "k8s" / "helm" / "bucketrl"
COMPOSE_FILES = (ROOT / "docker-compose.yml", ROOT / "docker-compose.gpu.yml")
# The override for an external trainer (TRL through `bucketrl gateway`): docker compose -f docker-compose.yml -f it.
TRL_COMPOSE = ROOT / "docker-compose.trl.yml"
ENV_EXAMPLE = ROOT / ".env.example"
COMPOSE_SCHEMA = Path(__file__).resolve().parent / "schemas" / "compose-spec.json"
SERVICES = ("proxy", "trainer", "generator")


# ---------------------------------------------------------------------------------------------- settings ----


def settings_class(component: str) -> type:
    """The pydantic-settings class a component's entry point reads (imported lazily: no torch needed)."""
    if component == "proxy":
        from bucketrl.proxy.settings import ProxySettings

        return ProxySettings
    if component == "trainer":
        from bucketrl.trainer.settings import TrainerSettings

        return TrainerSettings
    if component == "generator":
        from bucketrl.generator.settings import GeneratorSettings

        return GeneratorSettings
    raise KeyError(component)


def env_names(cls: type) -> dict[str, str]:
    """``{"BUCKETRL_FIELD": "field"}`` for every field of a settings class (env_prefix + upper-cased name)."""
    prefix = cls.model_config.get("env_prefix", "")  # type: ignore[attr-defined]
    names: dict[str, str] = {}
    for name, info in cls.model_fields.items():  # type: ignore[attr-defined]
        names[(prefix + name).upper()] = name
        alias = info.validation_alias if isinstance(info.validation_alias, str) else None
        if alias:
            names[alias.upper()] = name
    return names


def required_fields(cls: type) -> set[str]:
    return {name for name, info in cls.model_fields.items() if info.is_required()}  # type: ignore[attr-defined]


def build_settings(cls: type, env: dict[str, str], monkeypatch: Any) -> Any:
    """Instantiate ``cls`` from exactly ``env`` (every other BUCKETRL_* variable of this process removed)."""
    import os

    for key in list(os.environ):
        if key.upper().startswith("BUCKETRL_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return cls(_env_file=None)


# ------------------------------------------------------------------------------------------- Dockerfiles ----


@dataclass
class Stage:
    base: str  # the FROM argument after ARG substitution
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, instruction: str) -> list[str]:
        return [a for ins, a in self.instructions if ins == instruction]


@dataclass
class Dockerfile:
    path: Path
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage | None:
        return next((s for s in self.stages if s.name == name), None)

    def chain(self, stage: Stage) -> list[Stage]:
        """The stage and the stages it builds FROM, nearest first."""
        out = [stage]
        while (parent := self.stage(out[-1].base)) is not None:
            out.append(parent)
        return out

    def effective_user(self, stage: Stage) -> str:
        for s in self.chain(stage):
            users = s.args("USER")
            if users:
                return users[-1]
        return "root"  # an image without USER runs as root (true of every base used here)

    def effective(self, stage: Stage, instruction: str) -> str | None:
        for s in self.chain(stage):
            found = s.args(instruction)
            if found:
                return found[-1]
        return None


def _logical_lines(text: str) -> list[str]:
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#"):
            continue  # comments (and parser directives) never continue an instruction
        if raw.rstrip().endswith("\\"):
            current += raw.rstrip()[:-1] + " "
            continue
        current += raw
        if current.strip():
            lines.append(current.strip())
        current = ""
    if current.strip():
        lines.append(current.strip())
    return lines


def substitute(text: str, values: dict[str, str]) -> str:
    """Dockerfile/Compose-style ``$X`` / ``${X}`` / ``${X:-default}`` substitution (unknown names -> empty)."""

    def repl(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(3)
        default = m.group(2)
        value = values.get(name)
        if not value and default is not None:
            return default
        return value or ""

    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", repl, text)


def parse_dockerfile(path: Path, build_args: dict[str, str] | None = None) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path.read_text()):
        instruction, _, rest = line.partition(" ")
        instruction, rest = instruction.upper(), rest.strip()
        if instruction == "ARG" and not stages:
            name, _, default = rest.partition("=")
            global_args[name] = default.strip('"')
            continue
        if instruction == "FROM":
            resolved = dict(global_args)
            resolved.update(build_args or {})
            parts = rest.split()
            parts = [p for p in parts if not p.startswith("--platform")]
            base = substitute(parts[0], resolved)
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else None
            stages.append(Stage(base=base, name=name))
            continue
        if not stages:
            raise ValueError(f"{path}: {instruction} before the first FROM")
        stages[-1].instructions.append((instruction, rest))
    return Dockerfile(path=path, global_args=global_args, stages=stages)


def exec_form(value: str) -> list[str]:
    """The JSON (exec) form of CMD/ENTRYPOINT/HEALTHCHECK CMD; a shell-form string is an error."""
    parsed = json.loads(value)
    if not isinstance(parsed, list) or not all(isinstance(x, str) for x in parsed):
        raise ValueError(f"not an exec-form array: {value}")
    return parsed


def copy_sources(value: str) -> tuple[list[str], bool]:
    """Sources of a COPY/ADD instruction, and whether it copies from another stage (--from)."""
    words = shlex.split(value)
    from_stage = any(w.startswith("--from") for w in words)
    plain = [w for w in words if not w.startswith("--")]
    return plain[:-1], from_stage


# ----------------------------------------------------------------------------------------- .dockerignore ----


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    # Go filepath.Match semantics per path segment, plus "**" for any number of segments.
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if pattern.startswith("/", i):
                out += "/?"
                i += 1
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(f"^{out}$")


def dockerignore_excludes(rules_text: str, rel_path: str) -> bool:
    """True when Docker would leave ``rel_path`` (POSIX, relative to the context) out of the build context."""
    excluded = False
    parts = rel_path.split("/")
    for raw in rules_text.splitlines():
        rule = raw.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule[1:].strip() if negate else rule
        pattern = pattern.strip("/")
        regex = _pattern_regex(pattern)
        # A pattern matching a parent directory matches everything under it.
        if any(regex.match("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


# ----------------------------------------------------------------------------------------------- Compose ----

_INTERP = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?+])((?:[^{}]|\{[^{}]*\})*))?\}|\$(\w+)")


class InterpolationError(ValueError):
    pass


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation of one string (``$$`` -> ``$``)."""

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        op, arg = m.group(2), m.group(3) or ""
        present = name in env
        value = env.get(name, "")
        if op is None:
            return value
        unset_or_empty = not present or (op.startswith(":") and value == "")
        if op in (":-", "-"):
            return interpolate(arg, env) if unset_or_empty else value
        if op in (":?", "?"):
            if unset_or_empty:
                raise InterpolationError(f"required variable {name} is missing a value: {arg}")
            return value
        if op in (":+", "+"):
            return "" if unset_or_empty else interpolate(arg, env)
        raise InterpolationError(f"unknown operator {op}")

    return _INTERP.sub(repl, text)


def referenced_variables(text: str) -> dict[str, str | None]:
    """``{name: operator}`` of every ``${...}`` / ``$NAME`` in raw Compose text (``$$`` escapes skipped)."""
    found: dict[str, str | None] = {}
    for m in _INTERP.finditer(text):
        if m.group(0) == "$$":
            continue
        found.setdefault(m.group(1) or m.group(4), m.group(2))
    return found


def interpolate_tree(node: Any, env: dict[str, str]) -> Any:
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, list):
        return [interpolate_tree(x, env) for x in node]
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    return node


def with_secrets(env: dict[str, str]) -> dict[str, str]:
    """``env`` with every ``change-me`` placeholder replaced by a fresh secret, as an operator's ``.env`` has
    them (the proxy refuses placeholder tokens at start)."""
    import secrets

    return {k: (f"t-{secrets.token_urlsafe(18)}" if v.startswith("change-me") else v) for k, v in env.items()}


def read_env_file(path: Path) -> dict[str, str]:
    env: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ValueError(f"{path}: {raw!r} is not KEY=VALUE")
        env[key.strip()] = value.strip()
    return env


def load_compose(*paths: Path, env: dict[str, str]) -> dict[str, Any]:
    """The effective model of ``docker compose -f a -f b``: each file interpolated, then merged."""
    merged: dict[str, Any] = {}
    for path in paths:
        merged = merge_compose(merged, interpolate_tree(yaml.safe_load(path.read_text()), env))
    return merged


def _mount_target(entry: Any) -> str:
    if isinstance(entry, dict):
        return str(entry["target"])
    parts = str(entry).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def merge_compose(base: Any, override: Any, key: str = "") -> Any:
    """Compose's merge: mappings merge key by key, volumes merge by mount target, other sequences are replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = dict(base)
        for k, v in override.items():
            out[k] = merge_compose(base[k], v, k) if k in base else v
        return out
    if key == "volumes" and isinstance(base, list) and isinstance(override, list):
        by_target = {_mount_target(e): e for e in base}
        by_target.update({_mount_target(e): e for e in override})
        return list(by_target.values())
    return override


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """``{container path: host path}`` of a service's bind mounts (host paths relative to the repo root)."""
    out: dict[str, Path] = {}
    for entry in service.get("volumes") or []:
        if isinstance(entry, str):
            source, _, rest = entry.partition(":")
            if source.startswith((".", "/")):
                out[rest.split(":")[0]] = (ROOT / source).resolve()
        elif entry.get("type") == "bind":
            out[entry["target"]] = (ROOT / entry["source"]).resolve()
    return out


# -------------------------------------------------------------------------------------------------- Helm ----


def render_chart(
    values: dict[str, Any] | None = None, *, namespace: str = "ml", release: str = "rel"
) -> dict[str, str]:
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        return chart.render(values=values, name=release, namespace=namespace, is_install=True)


def lint_chart(values: dict[str, Any] | None = None) -> dict[str, Any]:
    import helm_python as helm

    return helm.lint(str(CHART), values, strict=True, namespace="ml")


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for name, text in sorted(rendered.items()):
        if not name.endswith((".yaml", ".yml")):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def pod_spec(doc: dict[str, Any]) -> dict[str, Any] | None:
    if doc["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
        return doc["spec"]["template"]["spec"]
    return None


def secret_data(doc: dict[str, Any]) -> dict[str, str]:
    import base64

    data = {k: str(v) for k, v in (doc.get("stringData") or {}).items()}
    data.update({k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()})
    return data


def expand_k8s_env(
    container: dict[str, Any], resolve_ref: Any, pod_name: str = "rel-bucketrl-generator-7d9f-x2x"
) -> dict[str, str]:
    """A container's environment as the kubelet builds it: secret/configMap/field refs resolved through
    ``resolve_ref(kind, name, key)``, then ``$(VAR)`` expanded from variables defined earlier in the list."""
    env: dict[str, str] = {}
    for item in container.get("env") or []:
        if "value" in item:
            value = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(item["value"]))
        else:
            ref = item["valueFrom"]
            if "secretKeyRef" in ref:
                value = resolve_ref("Secret", ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
            elif "configMapKeyRef" in ref:
                value = resolve_ref("ConfigMap", ref["configMapKeyRef"]["name"], ref["configMapKeyRef"]["key"])
            elif "fieldRef" in ref:
                assert ref["fieldRef"]["fieldPath"] == "metadata.name", ref
                value = pod_name
            else:
                raise AssertionError(f"unsupported valueFrom {ref}")
        env[item["name"]] = value
    return env


def fnmatch_any(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


# -------------------------------------------------------------------------------------- service processes ----


class ServiceProcess:
    """A bucketrl entry point run as a real process (``python -c <prelude> ... main()``), ended by its pid."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path, prelude: str = "") -> None:
        import os
        import subprocess
        import sys

        code = prelude + f"import sys\nsys.argv = ['bucketrl', *{args!r}]\nfrom bucketrl.cli import main\nmain()\n"
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("BUCKETRL_", "AWS_"))}
        self.log_path = cwd / f"{args[0]}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], env={**clean, **env}, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT
        )

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()[-4000:]

    def stop(self, timeout_s: float = 30.0) -> int:
        import signal
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def wait_http_ok(url: str, proc: ServiceProcess, timeout_s: float = 40.0) -> None:
    import time

    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        assert proc.proc.poll() is None, f"exited {proc.proc.returncode}:\n{proc.output()}"
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text[:200]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{url}: {last}\n{proc.output()}")


def compose_proxy_env(compose: dict[str, Any], redis_url: str, s3_endpoint: str, port: int) -> dict[str, str]:
    """The compose proxy's environment with its service addresses swapped for this machine's test servers."""
    env = service_env(compose["services"]["proxy"])
    env.update(
        BUCKETRL_REDIS_URL=redis_url,
        BUCKETRL_S3_ENDPOINT_URL=s3_endpoint,
        AWS_ACCESS_KEY_ID="testing",  # moto accepts any key; the compose key pair is MinIO's
        AWS_SECRET_ACCESS_KEY="testing",
        BUCKETRL_PORT=str(port),
    )
    return env


def compose_proxy_args(compose: dict[str, Any], port: int) -> list[str]:
    args = list(compose["services"]["proxy"]["command"])
    args[args.index("--port") + 1] = str(port)
    args[args.index("--host") + 1] = "127.0.0.1"  # never listen beyond loopback in a test
    return args
