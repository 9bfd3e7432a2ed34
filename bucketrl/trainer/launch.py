"""torchrun for ``bucketrl trainer``, exiting with the trainer's own exit codes.

    python -m bucketrl.trainer.launch --standalone --nproc-per-node 2 -m bucketrl.cli trainer
    python -m bucketrl.trainer.launch --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint trainer-0.trainer:29400 --rdzv-id run1 -m bucketrl.cli trainer

Takes exactly torchrun's options (it is torchrun's own launcher, ``torch.distributed.run``). The difference:
torchrun exits 1 whatever its ranks exited with, while ``bucketrl up`` and orchestrators act on the trainer's
codes (2 bad configuration: do not restart; 3 fenced by a newer trainer). So a failed job exits with rank 0's code
(every rank exits with it: rank 0 tells the others), else with the lowest failed rank's. On SIGTERM/SIGINT
torchrun forwards the signal to every rank (rank 0 finishes its step and checkpoints, the others follow) and
waits up to 30 s for them; this then exits 128 + the signal number.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as exc:
        codes = {rank: failure.exitcode for rank, failure in exc.failures.items()}
        if codes.get(0, 0) > 0:
            return codes[0]
        positive = [code for _, code in sorted(codes.items()) if code > 0]
        return positive[0] if positive else 1  # killed by a signal: a negative exit code
    except SignalException as exc:
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
