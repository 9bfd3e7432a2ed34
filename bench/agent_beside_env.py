"""Issue 36's run: a slow external agent beside the run's own environment. `bucketrl up --dataset toy:tools
--openai-port 0 --generators 1 --group-size 4 --groups-per-step 2` (the toy task's max_staleness 4 and episode
limits) while one agent (plain `openai` + httpx clients in threads of this process) asks for three groups one after
the other, honouring Retry-After; each group's 4 episodes run at once, two chat calls with a pause between them.
Prints per group the wait from its first ask to its admission, the 429s, its life and the trainer step that
trained it (the trainer's audit log, with the batch objects the bucket held), then the run's stale drops, the
generator's staleness warnings, its `admission/*` metrics and how the run ended.

    .venv/bin/python bench/agent_beside_env.py                # ~20 s groups (pause 18 s), 60 steps
    .venv/bin/python bench/agent_beside_env.py --pause 4 --max-steps 24 --json out.json   # a quicker run

Target (issue 36): all three groups trained, each admitted within one group's life of its first ask, 0 groups
dropped as stale, no staleness warning, the run ends at its max_steps with exit 0. Exit code 0 when met, 1
otherwise.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import openai

GROUPS = 3
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


def open_episode(http: httpx.Client) -> tuple[dict[str, Any], float, int]:
    """An episode after as many 429s as it takes (each waited out as Retry-After says); the seconds from the first
    ask to the episode and the 429s. A 503 (no policy loaded yet, at the start) is waited out, not counted."""
    refusals, asked = 0, None
    while True:
        r = http.post("/v1/episodes", json={"agent": "bench"})
        if r.status_code not in (429, 503):
            return r.raise_for_status().json(), 0.0 if asked is None else time.monotonic() - asked, refusals
        if r.status_code == 429:
            refusals += 1
            asked = asked or time.monotonic()
        time.sleep(float(r.headers.get("retry-after") or 1))


def episode(client: openai.OpenAI, http: httpx.Client, ep: dict[str, Any], pause_s: float, out: list[int]) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": ep["row"]["prompt"]}]
    for turn in range(2):
        if turn:
            time.sleep(pause_s)  # the agent's own work between the model's turns
        msg = client.chat.completions.create(model=ep["model"], messages=messages, tools=TOOLS)  # type: ignore[arg-type]
        messages.append(msg.choices[0].message.model_dump(exclude_none=True, include={"role", "content"}))
        messages.append({"role": "user", "content": "go on"})
    out.append(http.post(f"/v1/episodes/{ep['episode_id']}/finish", json={"reward": 0.5}).status_code)


def agent_groups(url: str, token: str, group_size: int, pause_s: float) -> list[dict[str, Any]]:
    """Three groups one after the other: the first episode waits for admission, the group's others take its free
    slots; the G episodes run at once."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=120)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    rows = []
    for _ in range(GROUPS):
        first, waited, refusals = open_episode(http)
        admitted = time.monotonic()
        eps = [first] + [open_episode(http)[0] for _ in range(group_size - 1)]
        statuses: list[int] = []
        threads = [threading.Thread(target=episode, args=(client, http, e, pause_s, statuses)) for e in eps]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows.append(
            {
                "prompt_id": first["prompt_id"],
                "prompts": sorted({e["prompt_id"] for e in eps}),
                "version": first["version"],
                "wait_s": waited,
                "refusals": refusals,
                "life_s": time.monotonic() - admitted,
                "finish_statuses": statuses,
            }
        )
        print(f"  group {len(rows)}: {json.dumps(rows[-1])}", flush=True)
    return rows


def watch_batches(bucket: Path, into: dict[str, list[str]], stop: threading.Event) -> None:
    """batch id -> its groups' prompt ids, from every batch object that appears (deleted once trained)."""
    while True:
        last = stop.is_set()
        for path in bucket.glob("runs/*/rollouts/*"):
            if path.name in into or path.name.endswith(".done"):
                continue
            try:
                obj = msgpack.unpackb(path.read_bytes(), raw=False)
            except (OSError, ValueError, msgpack.UnpackException):
                continue
            into[obj["batch_id"]] = list(obj["prompt_ids"])
        if last:
            return
        stop.wait(0.05)


def trained_steps(audit: Path, batches: dict[str, list[str]]) -> dict[str, int]:
    """prompt id -> the step that trained its group (the last execution of each step)."""
    out: dict[str, int] = {}
    for line in audit.read_text().splitlines():
        r = json.loads(line)
        if r.get("event") == "step":
            for d in r["deliveries"]:
                batch, _, g = d.rpartition(":")
                if batch in batches:
                    out[batches[batch][int(g)]] = int(r["step"])
    return out


def run(args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", "--dataset", "toy:tools",
        "--openai-port", "0", "--generators", "1", "--group-size", str(args.group_size),
        "--groups-per-step", str(args.groups_per_step), "--max-steps", str(args.max_steps),
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    up = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    endpoint = run_dir / "endpoint.json"
    while up.poll() is None and not (endpoint.exists() and "openai" in json.loads(endpoint.read_text() or "{}")):
        time.sleep(0.5)
    info = json.loads(endpoint.read_text())["openai"]
    batches: dict[str, list[str]] = {}
    admission: dict[str, float] = {}
    stop = threading.Event()
    watchers = [
        threading.Thread(target=watch_batches, args=(run_dir / "bucket", batches, stop), daemon=True),
        threading.Thread(target=watch_admission, args=(run_dir, admission, stop), daemon=True),
    ]
    for t in watchers:
        t.start()
    groups = agent_groups(info["base_url"].removesuffix("/v1"), info["token"], args.group_size, args.pause)
    code = up.wait()
    stop.set()
    for t in watchers:
        t.join(10)
    summary = json.loads((run_dir / "summary.json").read_text())
    steps = trained_steps(run_dir / "logs" / "trainer-audit.jsonl", batches)
    for g in groups:
        g["trained_at_step"] = steps.get(g["prompt_id"])
    gen_log = (run_dir / "logs" / "gen-0.log").read_text()
    return {
        "exit_code": code,
        "steps": summary["steps"],
        "max_steps": args.max_steps,
        "stale_dropped": (summary.get("rejected_stale_total") or 0) + (summary.get("dropped_stale_total") or 0),
        "staleness_warnings": sum("too stale" in line or "staleness window" in line for line in gen_log.splitlines()),
        "groups": groups,
        "admission": admission,
    }


def watch_admission(run_dir: Path, into: dict[str, float], stop: threading.Event) -> None:
    """The generator's admission/* metrics as the proxy's status shows them (the run's viewer token, from
    <dir>/tokens), the last seen before the run ended."""
    info = json.loads((run_dir / "endpoint.json").read_text())
    url = f"{info['proxy_url']}/v1/runs/{info['run']}/status"
    tokens = dict(line.split(":", 1) for line in (run_dir / "tokens").read_text().split() if ":" in line)
    headers = {"Authorization": f"Bearer {tokens.get('viewer', '')}"}
    while not stop.wait(2.0):
        try:
            metrics = httpx.get(url, headers=headers, timeout=5).json()["metrics"].get("gen-0") or {}
        except (httpx.HTTPError, ValueError, KeyError):
            continue
        into.update({k: v for k, v in metrics.items() if k.startswith("admission/")})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pause", type=float, default=18.0, help="seconds between an episode's two model calls")
    p.add_argument("--max-steps", type=int, default=60, help="long enough to train the third group after it ends")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bucketrl-agent-beside-env-"))
    r = run(args, root / "run")
    print()
    print("group  first ask -> admitted  429s  life     trained at step  finishes")
    for i, g in enumerate(r["groups"], 1):
        print(
            f"{i:>5}  {g['wait_s']:>19.1f} s {g['refusals']:>5}  {g['life_s']:>5.1f} s  "
            f"{g['trained_at_step'] if g['trained_at_step'] is not None else 'NOT TRAINED':>15}  {g['finish_statuses']}"
        )
    print(f"run: exit {r['exit_code']}, {r['steps']} of {r['max_steps']} steps, dropped as stale {r['stale_dropped']}, "
          f"staleness warnings {r['staleness_warnings']}")  # fmt: skip
    for k, v in sorted(r["admission"].items()):
        print(f"  {k} = {v:.3f}")
    life = max(g["life_s"] for g in r["groups"])
    ok = (
        all(g["trained_at_step"] is not None and g["wait_s"] <= life for g in r["groups"])
        and r["stale_dropped"] == 0
        and r["staleness_warnings"] == 0
        and r["exit_code"] == 0
        and r["steps"] == r["max_steps"]
    )
    print(f"target (3 groups trained, each admitted within a group's life, 0 dropped, no warning, exit 0) "
          f"{'MET' if ok else 'MISSED'}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))
    if args.keep:
        print(f"run directory {root / 'run'}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
