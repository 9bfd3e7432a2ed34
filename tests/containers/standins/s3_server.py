"""moto's S3 server with its state kept on disk: the MinIO stand-in of the compose tests.

moto keeps buckets in memory. Its request recorder appends every request to a file; this wrapper records only
the writes (PUT/POST/DELETE) and replays them at start, before it reports ready, so a restarted container (or
`compose down` then `up` on the same volume) serves the bucket it served before. Stand-in only: a real
deployment uses MinIO or a cloud bucket.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--data", type=Path, default=Path("/data"))
    args = parser.parse_args()
    record = args.data / "moto-writes.jsonl"
    ready = Path("/tmp/s3-ready")
    ready.unlink(missing_ok=True)
    os.environ["MOTO_ENABLE_RECORDING"] = "true"
    os.environ["MOTO_RECORDER_FILEPATH"] = str(record)

    from moto.moto_api import recorder
    from moto.server import ThreadedMotoServer

    write_only = recorder._record_request

    def record_writes(request, body=None):  # type: ignore[no-untyped-def]
        if request.method in ("PUT", "POST", "DELETE"):
            write_only(request, body)

    recorder._record_request = record_writes  # reads need not be replayed
    server = ThreadedMotoServer(ip_address="0.0.0.0", port=args.port)
    server.start()
    if record.exists():
        started = time.monotonic()
        n = sum(1 for _ in record.open())
        recorder.replay_recording(target_host=f"http://127.0.0.1:{args.port}")
        print(f"s3 stand-in: replayed {n} writes from {record} in {time.monotonic() - started:.1f}s", flush=True)
    ready.write_text("ok")
    print(f"s3 stand-in: serving on :{args.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop()


if __name__ == "__main__":
    main()
