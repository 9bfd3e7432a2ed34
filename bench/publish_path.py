"""Where a publish's time goes (issue 32): the trainer's tar and upload, the proxy's phases, into moto's S3.

    PYTHONPATH=$PWD .venv/bin/python bench/publish_path.py --adapter-mb 37 --versions 6 --tls --json /tmp/pub.json

The scale simulation's backends (:class:`bucketrl.sim.backends.SimBackends`: ``redis-server``, moto behind the slow
S3 front, ``bucketrl proxy``, HTTPS with a throwaway CA under ``--tls``) and, in this process, what the trainer
worker does to publish: an :class:`~bucketrl.trainer.model.AdapterSnapshot` of ``--adapter-mb`` float32 LoRA
tensors cast to ``--adapter-dtype`` and tarred (``tar``), then ``ProxyClient.publish_adapter`` (``put``: its
sha256 and the HTTP PUT until the proxy answered). The proxy logs each publish's phases (``bucketrl.proxy.
versions``): ``body`` (the upload, hashed and spooled as it arrives), ``check`` (the tar is a PEFT adapter in the
run's dtype), ``scan`` (every member validated and hashed for the manifest), ``writes`` (the tar and its members
into the bucket: at the same time for a body over 4 MiB), ``manifest``, ``bucket`` (all of the bucket's part, with
the clean-up of a crashed attempt's leftovers), ``commit`` (the Redis script). Medians over ``--versions``.
No network emulation: the home side of ``bench/wan.py``'s publish, on this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_PHASES = re.compile(r"published \S+ v(\d+) \((\d+) bytes, (\w+)\): (.*)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter-mb", type=float, default=37.0, help="float32 master weights (MiB)")
    p.add_argument("--adapter-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--versions", type=int, default=6)
    p.add_argument("--tls", action="store_true")
    p.add_argument("--s3-latency-ms", type=float, default=20.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    from bucketrl.client import ProxyClient
    from bucketrl.sim.backends import TOKENS, SimBackends
    from bucketrl.sim.pki import make_pki
    from bucketrl.sim.trainer import _SimPolicy
    from bucketrl.wire import RunSpec

    work = Path(tempfile.mkdtemp(prefix="bucketrl-publish-"))
    spec = RunSpec.model_validate(
        {
            "base_model": "sim/no-model",
            "lora": {"r": 16},
            "adapter_dtype": args.adapter_dtype,
            "reward": {"name": "toy"},
            "dataset": {"uri": "toy:sim", "size": 1000},
            "vocab_size": 32000,
        }
    )
    policy = _SimPolicy(spec, int(args.adapter_mb * 1024 * 1024))
    tls = make_pki(work / "pki") if args.tls else None
    trainer: dict[str, list[float]] = {"tar_s": [], "put_s": [], "publish_s": []}
    with SimBackends(work / "backends", s3_latency_ms=args.s3_latency_ms, tls=tls, proxy_log_level="info") as b:
        os.environ.update(b.client_env)
        with ProxyClient(b.proxy_url, "pub", TOKENS["trainer"], timeout_s=120.0) as client:
            client.put_run(spec)
            client.register_trainer("bench")
            for v in range(1, args.versions + 1):
                policy.touch(v)
                snap = policy.adapter_snapshot()
                t0 = time.perf_counter()
                tar = snap.tar(work, policy.adapter_dtype)
                t1 = time.perf_counter()
                client.publish_adapter(v, tar)
                t2 = time.perf_counter()
                trainer["tar_s"].append(t1 - t0)
                trainer["put_s"].append(t2 - t1)
                trainer["publish_s"].append(t2 - t0)
        time.sleep(0.5)  # the proxy's last log line
        log = (work / "backends" / "logs" / "proxy.log").read_text(errors="replace")
    proxy: dict[str, list[float]] = {}
    size = 0
    for m in _PHASES.finditer(log):
        size = int(m.group(2))
        for part in m.group(4).split():
            k, _, val = part.partition("=")
            proxy.setdefault(k, []).append(float(val))
    med = {k: round(statistics.median(v), 3) for k, v in {**trainer, **proxy}.items() if v}
    out: dict[str, Any] = {
        "adapter_mb": args.adapter_mb,
        "adapter_dtype": args.adapter_dtype,
        "tar_bytes": size,
        "tls": args.tls,
        "versions": args.versions,
        "p50_s": med,
        "load": os.getloadavg()[0],
        "cores": os.cpu_count(),
    }
    print(f"publish of {size / 1e6:.1f} MB ({args.adapter_dtype}, tls={args.tls}), p50 over {args.versions} versions:")
    for k, v in med.items():
        print(f"  {k:>10} {v:7.3f} s")
    print(f"({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
