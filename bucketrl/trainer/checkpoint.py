"""Trainer checkpoints: everything needed for the next step to equal the uninterrupted run's.

A checkpoint is a directory packed as a tar (``PUT /v1/runs/{run}/checkpoints/{step}``):

    state.json                       step, policy version (+ its step), consumed delivery ids, counters, epoch
    adapter/adapter_config.json      the LoRA weights (fp32 safetensors: bit-exact)
    adapter/adapter_model.safetensors
    optimizer.json + .safetensors    AdamW state_dict (moments, step counts): structure + tensors
    rng.json + rng.safetensors       python, numpy, torch (CPU and every CUDA device) RNG states

Nothing in it is a pickle (``tensor_state.py``): a checkpoint comes back from the bucket, and the proxy
refuses one that does not hold exactly these files (``bucketrl.bundles.CHECKPOINT_FILES``).

The LR schedule has no state beyond ``step`` (see :mod:`bucketrl.trainer.learner`).

``consumed_delivery_ids`` are the rollout deliveries trained on since the previous checkpoint. The worker
acknowledges them only AFTER this checkpoint is stored, and a resumed trainer acknowledges them again
(idempotent) before it claims anything (docs/design.md invariant 4): a crash between the two can never train a
group twice against the same checkpointed state, and unacknowledged deliveries come back to be trained
on from exactly the state that has not seen them.

    tar = pack_checkpoint(learner, TrainerState(step=..., policy_version=..., ...))
    snap = snapshot(learner, state)   # on the training thread; snap.pack() later, on any thread
    state = restore_checkpoint(learner, tar)
"""

from __future__ import annotations

import copy
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from bucketrl import bundles
from bucketrl.tarball import pack_dir, unpack
from bucketrl.trainer.model import AdapterSnapshot
from bucketrl.trainer.tensor_state import load_state, save_state

if TYPE_CHECKING:
    from bucketrl.trainer.learner import Learner

# 2: optimizer and RNG state as safetensors + JSON (1 held torch pickles, which are never loaded).
FORMAT_VERSION = 2


@dataclass
class TrainerState:
    step: int
    # The newest version published from this lineage, and the step whose weights it holds
    # (== step when the checkpointed weights are exactly that version).
    policy_version: int
    policy_step: int = -1
    consumed_delivery_ids: list[str] = field(default_factory=list)
    # Deliveries of earlier checkpoints the lineage's ledger remembers (trainer/ledger.py): seeded on resume.
    earlier_delivery_ids: list[str] = field(default_factory=list)
    # Monotonic counters that must survive restarts (e.g. ``sample/dropped_stale_total``).
    counters: dict[str, float] = field(default_factory=dict)
    epoch: int = 0
    run: str = ""
    # What the weights belong to: a checkpoint of another model or LoRA shape is refused on restore.
    base_model: str = ""
    lora: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    format_version: int = FORMAT_VERSION


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the legacy format: the global RandomState is an MT19937 one
    return {
        "python": random.getstate(),
        "numpy": {
            "name": str(np_state[0]),
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state(
        (n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class CheckpointSnapshot:
    """Everything a checkpoint holds, copied at one step: take it on the training thread (cheap clones),
    write or pack it on any thread while training goes on."""

    state: TrainerState
    adapter: AdapterSnapshot
    optimizer: dict[str, Any]
    rng: dict[str, Any]

    def write(self, directory: str | Path) -> Path:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.adapter.write(out / "adapter")
        save_state(self.optimizer, out, "optimizer")
        save_state(self.rng, out, "rng")
        (out / "state.json").write_text(json.dumps(asdict(self.state), indent=2, sort_keys=True) + "\n")
        return out

    def pack(self, scratch: str | Path | None = None) -> bytes:
        with tempfile.TemporaryDirectory(prefix="bucketrl-ckpt-", dir=scratch) as tmp:
            return pack_dir(self.write(tmp))


def snapshot(learner: Learner, state: TrainerState) -> CheckpointSnapshot:
    """Copy the learner's state now (the optimizer's tensors are cloned: the next step updates them in place)."""
    state.step = learner.step
    state.base_model = learner.spec.base_model
    state.lora = learner.spec.lora.model_dump(mode="json")
    state.created_at = state.created_at or time.time()
    return CheckpointSnapshot(
        state=state,
        adapter=learner.policy.adapter_snapshot(),
        optimizer=copy.deepcopy(learner.optimizer.state_dict()),
        rng=rng_state(),
    )


def write_checkpoint_dir(learner: Learner, state: TrainerState, directory: str | Path) -> Path:
    return snapshot(learner, state).write(directory)


def pack_checkpoint(learner: Learner, state: TrainerState) -> bytes:
    return snapshot(learner, state).pack()


def read_state(directory: str | Path) -> TrainerState:
    data = json.loads((Path(directory) / "state.json").read_text())
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint format {data.get('format_version')!r} is not {FORMAT_VERSION} (format 1 held pickled "
            "optimizer state, which bucketrl no longer loads from the bucket): start the run from its latest adapter "
            "in a new run"
        )
    known = set(TrainerState.__dataclass_fields__)
    return TrainerState(**{k: v for k, v in data.items() if k in known})


def restore_checkpoint_dir(learner: Learner, directory: str | Path) -> TrainerState:
    """Load weights, optimizer, RNG and step into ``learner``; return the saved trainer state."""
    root = Path(directory)
    state = read_state(root)
    want_lora = learner.spec.lora.model_dump(mode="json")
    if state.base_model != learner.spec.base_model or state.lora != want_lora:
        raise ValueError(
            f"checkpoint was written for base_model={state.base_model!r} lora={state.lora}, "
            f"not {learner.spec.base_model!r} {want_lora}"
        )
    learner.policy.load_adapter(root / "adapter")
    learner.optimizer.load_state_dict(load_state(root, "optimizer"))
    set_rng_state(load_state(root, "rng"))
    learner.step = state.step
    return state


def restore_checkpoint(learner: Learner, tar_bytes: bytes) -> TrainerState:
    with tempfile.TemporaryDirectory(prefix="bucketrl-ckpt-") as tmp:
        names = unpack(tar_bytes, tmp)
        bundles.check_members(names, bundles.CHECKPOINT_FILES, "the checkpoint")
        return restore_checkpoint_dir(learner, tmp)
