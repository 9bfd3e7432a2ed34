"""Slow agents against a real run: `bucketrl up --dataset toy:tools --env external --openai-port 0` (default
max_staleness), driven by agents whose episodes take 1, 10 and 30 s (a pause between an episode's two model calls,
plain `openai` + httpx clients in threads of this process); prints for each the groups dropped as stale (the
proxy's books: refused at submit + dropped at claim), the trainer's steps per second while the agents ran, and
the time agents waited for an episode (429s from admission control, docs/multi-turn.md "Slow agents").

    .venv/bin/python bench/agent_latency.py                      # 1, 10, 30 s episodes, 16 agents, 6 steps each
    .venv/bin/python bench/agent_latency.py --scale 0.2 --steps 4 # a quick run: 0.2, 2, 6 s episodes

Target (issue 26): 0 groups dropped as stale for agents within episode.episode_timeout_s (60 s for toy:tools).
Exit code 0 when met, 1 otherwise.
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

LATENCIES_S = (1.0, 10.0, 30.0)
TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    episodes: int = 0
    refusals: int = 0
    stale_at_finish: int = 0
    wait_s: list[float] = field(default_factory=list)
    first_open: float | None = None
    last_finish: float | None = None


def agent(url: str, token: str, pause_s: float, tally: Tally, stop: threading.Event) -> None:
    """Episodes until ``stop`` (or the run ends under it): 429s waited out as Retry-After says."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=120)
    http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            r = http.post("/v1/episodes")
            while r.status_code == 429 and not stop.is_set():
                with tally.lock:
                    tally.refusals += 1
                stop.wait(float(r.headers.get("retry-after") or 1))
                r = http.post("/v1/episodes")
            if stop.is_set() or r.status_code != 200:
                return
            ep = r.json()
            with tally.lock:
                tally.wait_s.append(time.monotonic() - t0)
                tally.first_open = tally.first_open or time.monotonic()
            messages: list[dict] = [{"role": "user", "content": ep["row"]["prompt"]}]
            for turn in range(2):
                if turn:
                    time.sleep(pause_s)
                msg = client.chat.completions.create(model=ep["model"], messages=messages, tools=TOOLS)  # type: ignore[arg-type]
                messages.append(msg.choices[0].message.model_dump(exclude_none=True, include={"role", "content"}))
                messages.append({"role": "user", "content": "go on"})
            done = http.post(f"/v1/episodes/{ep['episode_id']}/finish", json={"reward": None})
            with tally.lock:
                tally.episodes += 1
                tally.stale_at_finish += int(done.status_code == 409)
                tally.last_finish = time.monotonic()
    except (httpx.HTTPError, openai.APIError):
        return  # the run ended under it


def one_run(pause_s: float, args: argparse.Namespace, root: Path) -> dict[str, float]:
    run_dir = root / f"agents-{pause_s:g}s"
    cmd = [
        sys.executable, "-m", "bucketrl.cli", "up", "--dir", str(run_dir), "--no-live", "--dataset", "toy:tools",
        "--env", "external", "--openai-port", "0", "--generators", "1", "--group-size", str(args.group_size),
        "--groups-per-step", str(args.groups_per_step), "--max-steps", str(args.steps),
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    up = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    endpoint = run_dir / "endpoint.json"
    while up.poll() is None and not (endpoint.exists() and "openai" in json.loads(endpoint.read_text() or "{}")):
        time.sleep(0.5)
    info = json.loads(endpoint.read_text())["openai"]
    tally, stop = Tally(), threading.Event()
    url = info["base_url"].removesuffix("/v1")
    threads = [
        threading.Thread(target=agent, args=(url, info["token"], pause_s, tally, stop), daemon=True)
        for _ in range(args.agents)
    ]
    for t in threads:
        t.start()
    up.wait()
    stop.set()
    for t in threads:
        t.join(5)
    s = json.loads((run_dir / "summary.json").read_text())
    span = (tally.last_finish or 0.0) - (tally.first_open or 0.0)
    return {
        "episode_pause_s": pause_s,
        "steps": s["steps"],
        "stale_dropped": (s.get("rejected_stale_total") or 0) + (s.get("dropped_stale_total") or 0),
        "stale_at_finish": tally.stale_at_finish,
        "steps_per_s": s["steps"] / span if span > 0 else 0.0,
        "step_s_mean": s.get("step_s_mean") or 0.0,
        "episodes": tally.episodes,
        "refusals": tally.refusals,
        "wait_s_mean": sum(tally.wait_s) / max(1, len(tally.wait_s)),
        "wait_s_max": max(tally.wait_s, default=0.0),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=1.0, help="multiply the episode times (1, 10, 30 s) by this")
    p.add_argument("--agents", type=int, default=16, help="agents running episodes at once")
    p.add_argument("--steps", type=int, default=6, help="trainer steps per run")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bucketrl-agent-latency-"))
    rows = [one_run(lat * args.scale, args, root) for lat in LATENCIES_S]
    print()
    print("episode pause  steps  dropped stale  409 at finish  steps/s  episodes  429s  agent wait mean / max")
    for r in rows:
        print(
            f"{r['episode_pause_s']:>11.1f} s {r['steps']:>6} {r['stale_dropped']:>14} {r['stale_at_finish']:>14} "
            f"{r['steps_per_s']:>8.3f} {r['episodes']:>9} {r['refusals']:>5}  "
            f"{r['wait_s_mean']:.2f} / {r['wait_s_max']:.2f} s"
        )
    ok = all(r["stale_dropped"] == 0 and r["stale_at_finish"] == 0 for r in rows)
    print(f"target (0 groups dropped as stale) {'MET' if ok else 'MISSED'}")
    if args.keep:
        print(f"run directories under {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
