"""Does zstd pay on bfloat16 LoRA adapters (issue 32)? Bytes saved against the CPU it costs, on the trainer's own
adapters of a model of a real shape.

    PYTHONPATH=$PWD .venv/bin/python bench/adapter_zstd.py --ranks 8,64 --steps 5 --json /tmp/zstd.json

Builds a randomly initialised Qwen2 of Qwen2-0.5B's shape (``bench/gpu_check.py``'s ``0.5b``; bfloat16 on disk, so
``adapter_dtype: auto`` ships bfloat16), wraps it in the trainer's :class:`~bucketrl.trainer.model.PolicyModel` with
LoRA of each rank on every linear layer, and takes AdamW steps (``--lr``) on a language-model loss over random
tokens: real gradients through the LoRA, so lora_B leaves zero as in training. After step 1 and after ``--steps``
the adapter is written as the trainer publishes it (cast to bfloat16) and compressed with the ``zstd`` command at
each ``--levels`` (one thread), then decompressed; the CPU of both is the children's rusage. The rule the issue
set: ship compression only if it saves >= 10 % of the bytes and its CPU (compress once + decompress once per
region's relay, here counted once each) is under 10 % of the link time it saves at ``--mbit``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHAPE = {"hidden_size": 896, "layers": 24, "intermediate_size": 4864, "kv_heads": 2, "vocab_size": 151936}


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def zstd_figures(path: Path, level: int, mbit: float) -> dict[str, Any]:
    raw = path.stat().st_size
    packed = path.with_suffix(f".zst{level}")
    c0 = _children_cpu()
    subprocess.run(["zstd", "-q", "-f", "-T1", f"-{level}", str(path), "-o", str(packed)], check=True)
    c1 = _children_cpu()
    subprocess.run(["zstd", "-q", "-d", "-f", "-T1", str(packed), "-o", str(path) + ".back"], check=True)
    c2 = _children_cpu()
    size = packed.stat().st_size
    saved = raw - size
    link_saved_s = saved * 8 / (mbit * 1e6)
    cpu = (c1 - c0) + (c2 - c1)
    return {
        "level": level,
        "bytes": raw,
        "zstd_bytes": size,
        "saved_frac": round(saved / raw, 4),
        "compress_cpu_s": round(c1 - c0, 3),
        "decompress_cpu_s": round(c2 - c1, 3),
        "link_saved_s": round(link_saved_s, 4),
        "cpu_over_link_saved": round(cpu / link_saved_s, 3) if link_saved_s > 0 else None,
        "pays": saved / raw >= 0.10 and link_saved_s > 0 and cpu < 0.10 * link_saved_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="8,64")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--levels", default="1,3,9")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--mbit", type=float, default=200.0)
    p.add_argument("--model-dir", type=Path, help="reuse a built model directory")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)

    import torch

    from bucketrl.tasks.tiny_model import build_tiny_model
    from bucketrl.trainer.model import PolicyModel
    from bucketrl.wire import RunSpec

    work = Path(tempfile.mkdtemp(prefix="bucketrl-zstd-"))
    t0 = time.monotonic()
    model_dir = build_tiny_model(args.model_dir or work / "model-0.5b", dtype="bfloat16", **SHAPE)
    print(f"model built in {time.monotonic() - t0:.0f}s", file=sys.stderr)
    results: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for r in [int(x) for x in args.ranks.split(",")]:
        spec = RunSpec.model_validate(
            {
                "base_model": str(model_dir),
                "lora": {"r": r, "alpha": 2.0 * r},
                "reward": {"name": "toy"},
                "dataset": {"uri": "toy:digits", "size": 8},
                "vocab_size": 64,
            }
        )
        policy = PolicyModel(spec, device="cpu", dtype="float32", seed=0)
        assert policy.adapter_dtype == "bfloat16", policy.adapter_dtype
        opt = torch.optim.AdamW(list(policy.trainable_parameters()), lr=args.lr)
        for step in range(1, args.steps + 1):
            ids = torch.randint(0, 151936, (2, 32), generator=gen)
            loss = policy.model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if step in (1, args.steps):
                out = policy.adapter_snapshot().write(work / f"r{r}-s{step}", "bfloat16")
                weights = out / "adapter_model.safetensors"
                for level in [int(x) for x in args.levels.split(",")]:
                    row = {"rank": r, "step": step, **zstd_figures(weights, level, args.mbit)}
                    results.append(row)
                    print(json.dumps(row), flush=True)
        del policy, opt
    out = {
        "shape": "qwen2-0.5b",
        "mbit": args.mbit,
        "lr": args.lr,
        "results": results,
        "cores": os.cpu_count(),
        "load": os.getloadavg()[0],
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
