"""``python -m bucketrl.sim.netlab up|check|sweep|drop``: hold a lab for a benchmark, measure what a lab's links
really do on this machine, clean up by hand, cut a link of a running lab."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from typing import Any

from bucketrl.sim.netlab import cleanup
from bucketrl.sim.netlab.drop import drop_ends, restore_ends
from bucketrl.sim.netlab.topology import HOME, Lab, uniform


def _up(args: argparse.Namespace) -> None:
    regions = [r for r in args.regions.split(",") if r]
    # Ctrl-C and SIGTERM both end the hold through the same finally (the lab's own SIGTERM hook is not needed).
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    with Lab(uniform(regions, args.rtt_ms, args.mbit)) as lab:
        for spec in args.expose:
            listen, _, target = spec.partition(":")
            for r in regions:
                lab.expose(r, int(target or listen), listen_port=int(listen))
        info = lab.describe()
        info["exec_prefix"] = {role: lab.exec_prefix(role) for role in [HOME, *regions]}
        info["swept"] = lab.swept
        print(json.dumps(info, indent=2), flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            print("closing", file=sys.stderr)


def _check(args: argparse.Namespace) -> None:
    # The probes run in the namespaces as real clients of a real server through the real relay: the same path a
    # benchmark's traffic takes, so its figures say what the lab delivers under this machine's current load.
    probe = [sys.executable, "-m", "bucketrl.sim.netlab.probe"]
    regions = [r for r in args.regions.split(",") if r]
    with Lab(uniform(regions, args.rtt_ms, args.mbit)) as lab:
        server = lab.popen(HOME, [*probe, "serve"], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[1])
        report: dict[str, Any] = {"set": {"rtt_ms": args.rtt_ms, "mbit": args.mbit, "bytes": args.bytes}}
        for r in regions:
            addr = lab.expose(r, port).address
            res = {}
            for what, extra in (("rtt", ["--count", "20"]), ("bulk", ["--bytes", str(args.bytes)])):
                out = subprocess.run(
                    [*lab.exec_prefix(r), *probe, what, "--addr", addr, *extra],
                    capture_output=True,
                    text=True,
                    check=True,
                    timeout=300,
                )
                res[what] = json.loads(out.stdout)
            report[r] = {
                "rtt_median_ms": round(res["rtt"]["median_ms"], 2),
                "rtt_max_ms": round(max(res["rtt"]["rtt_ms"]), 2),
                "download_mbit": round(res["bulk"]["mbit"], 1),
            }
        print(json.dumps(report), flush=True)


def _drop(args: argparse.Namespace) -> None:
    # Works on a lab held by another process (``up``): the ends are found by the namespace names it printed.
    ends = [(args.home_ns, f"to-{args.region}"), (args.region_ns, HOME)]
    drop_ends(ends, args.mode)
    try:
        time.sleep(args.seconds)
    finally:
        restore_ends(ends, args.mode)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bucketrl.sim.netlab", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("up", help="build a lab, print it as JSON, hold it until Ctrl-C")
    p.add_argument("--regions", default="a,b")
    p.add_argument("--rtt-ms", type=float, default=100.0)
    p.add_argument("--mbit", type=float, default=200.0)
    p.add_argument(
        "--expose",
        action="append",
        default=[],
        metavar="PORT[:TARGET]",
        help="a delay relay per region on home's link address :PORT to home's 127.0.0.1:TARGET (default PORT)",
    )
    p = sub.add_parser("check", help="build a lab, measure each link's RTT and download rate, print JSON, close")
    p.add_argument("--regions", default="a")
    p.add_argument("--rtt-ms", type=float, default=100.0)
    p.add_argument("--mbit", type=float, default=200.0)
    p.add_argument("--bytes", type=int, default=20_000_000)
    sub.add_parser("sweep", help="delete the namespaces of labs whose owner is gone")
    p = sub.add_parser("drop", help="drop one link of a running lab for N seconds")
    p.add_argument("--home-ns", required=True)
    p.add_argument("--region-ns", required=True)
    p.add_argument("--region", required=True)
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--mode", choices=["blackhole", "down"], default="blackhole")
    args = ap.parse_args(argv)
    if args.cmd == "up":
        _up(args)
    elif args.cmd == "check":
        _check(args)
    elif args.cmd == "sweep":
        print(json.dumps(cleanup.sweep()))
    else:
        _drop(args)


if __name__ == "__main__":
    main()
