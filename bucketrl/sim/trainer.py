"""A SIMULATED trainer: the real trainer worker around a learner that holds no model.

Everything the trainer does against the proxy is the real :class:`bucketrl.trainer.worker.TrainerWorker`:
registration and fencing, claims one step ahead with ``min_version``/``train_version`` (admission control's
pace), publishes every ``sync_every`` steps from the uploader thread, checkpoints then acks, metric pushes.
Only the learner is simulated (:class:`SimLearner`): a step takes ``BUCKETRL_SIM_STEP_S`` seconds (the time
a GPU step of the stated cost would take) and the adapter is ``BUCKETRL_SIM_ADAPTER_BYTES`` of float32 LoRA
master weights, published through the real cast to the run spec's ``adapter_dtype`` (``auto``: bfloat16, the
simulated GPU model's dtype; a bfloat16 version is half those bytes), so versions and checkpoints move real
adapter-sized objects through the proxy and the bucket. Nothing is learned: rewards and logprobs of the
simulated engine are not a policy's.

    BUCKETRL_PROXY_URL=... BUCKETRL_TOKEN=... BUCKETRL_RUN=sim BUCKETRL_SIM_STEP_S=4 \\
        python -m bucketrl.sim.trainer --report /tmp/trainer.json

``--report`` writes the requests this trainer sent (by method) when it exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import ssl
import sys
import threading
import time
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field

from bucketrl.client import ProxyClient
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.token_versions import tally_completion, token_version_stats
from bucketrl.trainer.worker import TrainerWorker
from bucketrl.wire import RunSpec

log = logging.getLogger("bucketrl.sim.trainer")

# The LoRA tensors' inner dimension (a ~1.5B model's hidden size); only the total size matters.
HIDDEN = 1536


class SimTrainerSettings(TrainerSettings):
    sim_step_s: float = Field(
        2.0, ge=0.0, description="BUCKETRL_SIM_STEP_S: seconds one simulated optimizer step takes."
    )
    sim_adapter_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        description="BUCKETRL_SIM_ADAPTER_BYTES: size of the adapter's float32 master weights (LoRA tensors).",
    )


class _SimPolicy:
    """LoRA-shaped float32 tensors of the stated total size; one element changes per step (a new version)."""

    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, spec: RunSpec, adapter_bytes: int) -> None:
        import torch

        r = spec.lora.r
        # The simulated model is a GPU one in bfloat16: ``auto`` ships bfloat16, as for a real bf16 base.
        self.adapter_dtype = "bfloat16" if spec.adapter_dtype == "auto" else spec.adapter_dtype
        per_pair = 2 * r * HIDDEN * 4  # lora_A (r x H) + lora_B (H x r), float32
        layers = max(1, adapter_bytes // per_pair)
        gen = torch.Generator().manual_seed(0)
        self.state: dict[str, Any] = {}
        for i in range(layers):
            prefix = f"base_model.model.model.layers.{i}.self_attn.q_proj"
            self.state[f"{prefix}.lora_A.weight"] = torch.randn(r, HIDDEN, generator=gen)
            self.state[f"{prefix}.lora_B.weight"] = torch.zeros(HIDDEN, r)
        self.config_json = json.dumps(
            {
                "peft_type": "LORA",
                "r": r,
                "lora_alpha": spec.lora.alpha,
                "target_modules": ["q_proj"],
                "base_model_name_or_path": spec.base_model,
                "bucketrl_simulated": True,
            }
        )

    def touch(self, step: int) -> None:
        first = next(iter(self.state.values()))
        first.view(-1)[step % first.numel()] += 1

    def adapter_snapshot(self) -> Any:
        from bucketrl.trainer.model import AdapterSnapshot

        return AdapterSnapshot({k: v.clone() for k, v in self.state.items()}, self.config_json)


class _SimOptimizer:
    """AdamW's state shape (two fp32 moments per parameter), for checkpoints of realistic size."""

    def __init__(self, policy: _SimPolicy) -> None:
        import torch

        self._moments = {
            i: {"exp_avg": torch.zeros(v.shape), "exp_avg_sq": torch.zeros(v.shape), "step": torch.tensor(0.0)}
            for i, v in enumerate(policy.state.values())
        }

    def state_dict(self) -> dict[str, Any]:
        return {"state": self._moments, "param_groups": [{"params": list(self._moments)}]}


class SimLearner:
    """What :class:`TrainerWorker` uses of a learner, with a step that only takes time."""

    def __init__(self, spec: RunSpec, settings: SimTrainerSettings) -> None:
        self.spec = spec
        self.settings = settings
        self.policy = _SimPolicy(spec, settings.sim_adapter_bytes)
        self.optimizer = _SimOptimizer(self.policy)
        self.step = 0
        self.versions: OrderedDict[int, Any] = OrderedDict()

    def remember_version(self, version: int, snapshot: Any) -> None:
        # Only the version numbers matter here (no mismatch check: the samples are simulated).
        self.versions[version] = None
        while len(self.versions) > self.spec.max_staleness + 1:
            self.versions.popitem(last=False)

    def train_step(self, groups: list[Any], *, policy_version: int) -> dict[str, float]:
        t0 = time.perf_counter()
        time.sleep(self.settings.sim_step_s)
        self.policy.touch(self.step)
        self.step += 1
        stats: dict[str, float] = {"sample/groups": float(len(groups)), "train/loss": 0.0}
        if groups:
            staleness = [policy_version - g.version for g in groups]
            stats["sample/staleness_mean"] = sum(staleness) / len(staleness)
            stats["sample/staleness_max"] = float(max(staleness))
            rewards = [c.reward for g in groups for c in g.group.completions if c.reward is not None]
            if rewards:
                stats["reward"] = sum(rewards) / len(rewards)
            # What the real learner reports of the tokens' versions (partial rollouts), every token trained unless
            # older than policy_version - max_staleness.
            floor = policy_version - self.spec.max_staleness
            tallies = [tally_completion(c, g.version, floor) for g in groups for c in g.group.completions]
            stats.update(token_version_stats(tallies, policy_version))
        stats["perf/fwd_bwd_s"] = time.perf_counter() - t0
        return stats


class CountingTransport(httpx.HTTPTransport):
    """Counts requests by method (thread-safe): the trainer's share of the proxy's request rate."""

    def __init__(self, counts: Counter[str], lock: threading.Lock, verify: ssl.SSLContext) -> None:
        super().__init__(verify=verify)
        self.counts, self.lock = counts, lock

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        with self.lock:
            self.counts[request.method] += 1
        return super().handle_request(request)


class SimTrainerWorker(TrainerWorker):
    settings: SimTrainerSettings

    def __init__(self, settings: SimTrainerSettings, **kw: Any) -> None:
        self.request_counts: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        super().__init__(settings, **kw)

    def _new_client(self) -> ProxyClient:
        s = self.settings
        transport = CountingTransport(self.request_counts, self._count_lock, s.security.verify())
        return ProxyClient(
            s.proxy_url, s.run, s.token, timeout_s=s.http_timeout_s, transport=transport, security=s.security
        )

    def _make_learner(self, spec: RunSpec) -> SimLearner:
        return SimLearner(spec, self.settings)

    def _resume(self) -> None:
        # A simulated run always starts fresh: its checkpoints hold no weights worth restoring.
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Simulated trainer (settings from BUCKETRL_* variables).")
    parser.add_argument("--report", type=Path, help="write the requests sent, by method, here at exit")
    args = parser.parse_args(argv)
    settings = SimTrainerSettings()
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would cost more than the step
    worker = SimTrainerWorker(settings)
    worker.install_signal_handlers()
    code = worker.run()
    if args.report:
        steps = getattr(worker.learner, "step", 0)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        report = {"requests": dict(worker.request_counts), "steps": steps, "cpu_s": usage.ru_utime + usage.ru_stime}
        args.report.write_text(json.dumps(report))
    return code


if __name__ == "__main__":
    sys.exit(main())
