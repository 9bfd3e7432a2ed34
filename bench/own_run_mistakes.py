"""How fast `bucketrl up` stops on a user's configuration mistake (issue 11: within 30 s, one line, exit 2).

    .venv/bin/python bench/own_run_mistakes.py

Runs each mistake one at a time (a quiet machine gives the honest figure), in a temp directory holding a
reward module and a dataset, and prints the seconds to exit, the exit code and the last line. Before the
preflight these crash-looped for 50-112 s. Exit code 0 when every case exits 2 within 30 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_S = 30.0
REWARD = """
def raises(completion, answer, *, prompt):
    raise ValueError("boom")


def string(completion, answer, *, prompt):
    return "1.0"
"""
ENV = """
class Echo:
    def __init__(self, hint: str = "") -> None:
        self.hint = hint

    async def rollout(self, ctx):
        return None
"""
CASES = {
    "no such reward module": ["--reward", "nosuchmod:score"],
    "module without the function": ["--reward", "myreward:missing"],
    "reward raises": ["--reward", "myreward:raises"],
    "reward returns a string": ["--reward", "myreward:string"],
    "wrong prompt field": ["--dataset", "questions.jsonl"],
    "completion does not fit the context": ["--max-new-tokens", "600"],
    "missing model path": ["--model", "/nonexistent/model"],
    "bucket: dataset without a file": ["--dataset", "bucket:dataset.jsonl"],
    "no such env module": ["--dataset", "toy:tools", "--env", "nosuchmod:Thing"],
    "env kwargs refused": ["--dataset", "toy:tools", "--env", "myenv:Echo", "--env-kwargs", '{"nope": 1}'],
}


def main() -> int:
    ok = True
    with tempfile.TemporaryDirectory(prefix="bucketrl-mistakes-") as tmp:
        work = Path(tmp)
        (work / "myreward.py").write_text(REWARD)
        (work / "myenv.py").write_text(ENV)
        rows = [json.dumps({"question": f"{i}+1=", "solution": str(i + 1)}) for i in range(5)]
        (work / "questions.jsonl").write_text("\n".join(rows) + "\n")
        print(f"{'case':38} {'seconds':>7} {'exit':>4}  last line")
        for i, (name, args) in enumerate(CASES.items()):
            t0 = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-m", "bucketrl.cli", "up", "--dir", f"runs/{i}", "--no-live", *args],
                cwd=work,
                capture_output=True,
                text=True,
                timeout=600,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            seconds = time.monotonic() - t0
            last = ([line for line in (out.stdout + out.stderr).splitlines() if line.strip()] or [""])[-1]
            ok &= out.returncode == 2 and seconds <= TARGET_S
            print(f"{name:38} {seconds:7.1f} {out.returncode:4}  {last[:150]}")
    print(f"load average: {os.getloadavg()[0]:.1f}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
