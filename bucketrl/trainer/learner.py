"""One GRPO optimizer step over claimed groups, with no I/O: what the worker and the benchmark both run.

    learner = Learner(run_spec, settings)
    stats = learner.train_step([StepGroup(group, version=3, worker_id="gen-a"), ...], policy_version=4)

A step: advantages per group -> samples -> micro-batches under ``micro_token_budget`` -> for each, forward
(current policy; the reference pass with the adapter disabled when ``kl_coef > 0``), loss normalised by the
step's totals, backward (gradients accumulate) -> clip the global norm -> AdamW at ``lr * lr_factor(step)``.

The proximal logprobs of the decoupled objective are the detached logprobs of this very forward: the
weights have not moved yet, so they are the trainer's logprobs "at the start of the step" for free.

The per-generator mismatch ``mismatch/logprob_abs_diff/{worker}`` (docs/design.md invariant 6) compares behaviour
logprobs with the trainer's under the SAME weights: for samples of the current version from the training
forward (free), for up to ``mismatch_max_samples`` stale ones from a no-grad forward with the weights of
their version swapped in (the worker records each version it publishes with :meth:`remember_version`).

The LR schedule is a pure function of the step number (:meth:`TrainerSettings.lr_factor`), so the
scheduler's state is the step itself and a resumed run cannot drift from the uninterrupted one.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict

import torch

from bucketrl.trainer.advantages import GroupAdvantages, group_advantages
from bucketrl.trainer.batching import MicroBatch, TrainingSample, group_samples, make_micro_batches
from bucketrl.trainer.loss import LossBatch, LossOutput, finalize_stats, grpo_loss
from bucketrl.trainer.model import AdapterSnapshot, PolicyModel
from bucketrl.trainer.ranks import Ranks, shard_groups
from bucketrl.trainer.settings import TrainerSettings
from bucketrl.trainer.sharding import filler_batch
from bucketrl.trainer.step_group import StepGroup
from bucketrl.trainer.token_versions import tally_sample, token_version_stats
from bucketrl.wire.rollouts import Completion, RolloutGroup
from bucketrl.wire.runs import LossSpec, RunSpec

log = logging.getLogger("bucketrl.trainer")

MISMATCH_PREFIX = "mismatch/logprob_abs_diff/"
# Metric names are limited to 128 characters on the wire.
_MAX_WORKER_IN_NAME = 128 - len(MISMATCH_PREFIX)


class Learner:
    """The policy, its AdamW optimizer and the step counter."""

    def __init__(self, spec: RunSpec, settings: TrainerSettings, *, ranks: Ranks | None = None) -> None:
        self.spec = spec
        self.settings = settings
        # Data-parallel ranks (torchrun): each trains its share of the groups, gradients are summed over ranks
        # (bucketrl/trainer/distributed.py). None: one process trains everything.
        self.ranks = ranks
        sharder = None
        if settings.shard_base and ranks is not None:
            from bucketrl.trainer.sharding import BaseSharder

            sharder = BaseSharder(ranks)
        elif settings.shard_base:
            log.info("BUCKETRL_SHARD_BASE has no effect in a single process (it shards across torchrun's ranks)")
        self.policy = PolicyModel(
            spec,
            device=settings.device,
            dtype=settings.dtype,
            seed=settings.seed,
            gradient_checkpointing=settings.gradient_checkpointing,
            shard=sharder,
        )
        self.sharder = sharder
        # A sharded base is all-gathered in every forward and backward (collectives): every rank must run the same
        # number of passes, padded with filler passes (bucketrl/trainer/sharding.py).
        self.lockstep = sharder is not None
        self.params = list(self.policy.trainable_parameters())
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=settings.lr,
            betas=(settings.adam_beta1, settings.adam_beta2),
            eps=settings.adam_eps,
            weight_decay=settings.weight_decay,
        )
        self.step = 0
        # Weights of recently published versions (LoRA only, on CPU): the mismatch check of stale samples.
        self.versions: OrderedDict[int, AdapterSnapshot] = OrderedDict()

    def remember_version(self, version: int, snapshot: AdapterSnapshot) -> None:
        """Record the weights published as ``version`` (the newest max_staleness + 1 are kept)."""
        self.versions[version] = snapshot
        self.versions.move_to_end(version)
        while len(self.versions) > self.spec.max_staleness + 1:
            self.versions.popitem(last=False)

    def lr_for(self, step: int) -> float:
        return self.settings.lr * self.settings.lr_factor(step)

    # -- one step --------------------------------------------------------------------------------------

    def build_samples(
        self, groups: list[StepGroup], policy_version: int | None = None
    ) -> tuple[list[TrainingSample], dict[str, float]]:
        """Advantages and trainable samples of a step, plus the reward/staleness-free group stats.

        ``policy_version`` (the version being trained): a partial rollout's tokens sampled by a version older than
        ``policy_version - max_staleness`` are masked out of the loss, a completion left with none is no sample
        (its group still counts as trained), and the step's per-token version figures are reported
        (:mod:`bucketrl.trainer.token_versions`). None: nothing is masked for its version.

        ``finish_reason`` decides two exclusions. An ABORTED completion (the engine stopped it part-way) is
        partial text: its reward is not evidence about a finished answer, so it is treated like an unscorable
        one (out of its group's mean and std, never trained). A TRUNCATED one (``length``: cut by
        max_new_tokens) is a real sample of the policy, so it stays in the group's statistics; with
        ``mask_truncated_completions`` it is not trained on (TRL's option: its mask is zeroed).
        """
        loss = self.spec.loss
        samples: list[TrainingSample] = []
        zero_var = unscorable = aborted = truncated = episodes = 0
        lengths = 0
        means: list[float] = []
        stds: list[float] = []
        turns: list[int] = []
        multi_turn = False
        env_tokens = 0  # env-segment tokens of the trained samples
        ep_sums: dict[str, float] = {}  # the groups' episode_stats, summed (what the generator measured)
        floor = None if policy_version is None else policy_version - self.spec.max_staleness
        for item in groups:
            comps = item.group.completions
            adv, results, advantages, trainable, group_turns = _episode_advantages(item.group, loss)
            turns += group_turns
            multi_turn = multi_turn or any(c.segments is not None for c in comps)
            for name, value in item.group.episode_stats.items():
                ep_sums[name] = ep_sums.get(name, 0.0) + value
            env_tokens += sum(
                len(c.token_ids) - c.model_tokens() for c, keep in zip(comps, trainable, strict=True) if keep
            )
            zero_var += int(adv.zero_variance)
            unscorable += sum(1 for c in results if c.reward is None and c.finish_reason != "abort")
            aborted += sum(1 for c in results if c.finish_reason == "abort")
            truncated += sum(1 for c in results if c.finish_reason == "length")
            episodes += len(results)
            lengths += sum(len(c.token_ids) for c in comps)
            if adv.reward_mean is not None:
                means.append(adv.reward_mean)
                stds.append(adv.reward_std or 0.0)
            samples += group_samples(
                item.group,
                advantages,
                trainable,
                version=item.version,
                worker_id=item.worker_id,
                eos_token_ids=self.policy.eos_token_ids,
                sampling=item.sampling,
                min_version=floor,
            )
        stats = {
            "sample/groups": float(len(groups)),
            "sample/zero_variance_groups": float(zero_var),
            "sample/unscorable": float(unscorable),
            "sample/aborted": float(aborted),
        }
        if episodes:
            # TRL's names: mean completion length (a multi-turn episode's: every token after its prompts), and
            # the fraction cut by max_new_tokens (or an episode limit).
            stats["completions/mean_length"] = lengths / episodes
            stats["completions/clipped_ratio"] = truncated / episodes
        if means:
            # Like TRL: the mean reward, and the mean of the per-group stds.
            stats["reward"] = sum(means) / len(means)
            stats["reward_std"] = sum(stds) / len(stds)
        # Tokens the step's forward holds (prompts + every segment of the trained samples) vs those trained
        # (``train/tokens``): with multi-turn episodes the environment's tokens are context only.
        stats["train/tokens_context"] = float(sum(s.length for s in samples))
        if multi_turn:
            stats["episodes/turns_mean"] = sum(turns) / len(turns)
            stats["episodes/turns_max"] = float(max(turns))
            stats["episodes/samples_per_episode"] = sum(len(g.group.completions) for g in groups) / episodes
            stats["train/tokens_env"] = float(env_tokens)
        stats.update(_episode_metrics(ep_sums))
        if policy_version is not None:
            stats.update(token_version_stats([tally_sample(s) for s in samples], policy_version))
        return [s for s in samples if s.trained_tokens or not s.stale_masked], stats

    def train_step(self, groups: list[StepGroup], *, policy_version: int) -> dict[str, float]:
        """One optimizer step; ``policy_version`` is the published version equal to the current weights."""
        t0 = time.perf_counter()
        samples, stats = self.build_samples(groups, policy_version)
        if groups:
            staleness = [policy_version - g.version for g in groups]
            stats["sample/staleness_mean"] = sum(staleness) / len(staleness)
            stats["sample/staleness_max"] = float(max(staleness))
        lr = self.lr_for(self.step)
        stats["train/lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if samples:
            if self.ranks is not None:  # this rank's share; the statistics above cover the whole step
                share = shard_groups(groups, self.ranks.world)[self.ranks.rank]
                samples, _ = self.build_samples([groups[i] for i in share], policy_version)
            t_check = time.perf_counter()
            mismatch = self._stale_mismatch(samples, policy_version)
            stats["perf/mismatch_check_s"] = time.perf_counter() - t_check
            stats.update(self._accumulate(samples, policy_version, mismatch))
            stats.update(self._apply(lr, stats.get("train/loss", math.nan)))
        else:
            # Nothing trainable (all groups filtered or unscorable): the step still counts, weights stay put.
            stats.update({"train/loss": 0.0, "train/grad_norm": 0.0, "train/tokens": 0.0, "train/sequences": 0.0})
        self.step += 1
        stats["perf/fwd_bwd_s"] = time.perf_counter() - t0
        if self.policy.device.type == "cuda":  # what bench/gpu_check.py reports
            stats["perf/gpu_peak_gib"] = torch.cuda.max_memory_allocated(self.policy.device) / 2**30
        return stats

    def _stale_mismatch(self, samples: list[TrainingSample], policy_version: int) -> dict[str, list[float]]:
        """|trainer - behaviour| for up to ``mismatch_max_samples`` stale samples, each under the weights of the
        version that generated it (swapped in for a no-grad, eval-mode forward, then swapped back bit-exactly).

        Round-robin over generators, so each one's delivery is checked every step (docs/design.md invariant 6).
        """
        budget = self.settings.mismatch_max_samples
        acc: dict[str, list[float]] = {}  # worker -> [abs diff sum, tokens]
        if budget <= 0:
            return acc
        queues: dict[str, list[TrainingSample]] = {}
        for s in samples:
            if s.version != policy_version and s.version in self.versions:
                queues.setdefault(s.worker_id, []).append(s)
        chosen: list[TrainingSample] = []
        while len(chosen) < budget and any(queues.values()):
            for worker in sorted(queues):
                if queues[worker] and len(chosen) < budget:
                    chosen.append(queues[worker].pop(0))
        plan = {
            version: make_micro_batches(
                [s for s in chosen if s.version == version], self.settings.micro_token_budget, self.policy.pad_id
            )
            for version in sorted({s.version for s in chosen})
        }
        planned = sum(len(micro) for micro in plan.values())
        passes = self.ranks.all_reduce_max(planned) if self.lockstep and self.ranks is not None else planned
        if not passes:
            return acc
        current = self.policy.adapter_snapshot()
        was_training = self.policy.model.training
        self.policy.model.eval()  # like the generators: no dropout (and no RNG drawn)
        try:
            with torch.no_grad():
                for version, micro in plan.items():
                    self.policy.load_adapter_state(self.versions[version].state)
                    for mb in micro:
                        mb.to(self.policy.device)
                        lp, _ = self.policy.token_logprobs(mb)
                        _add_mismatch(acc, lp, mb, version)
                for _ in range(passes - planned):  # sharded lockstep: the others still have forwards to run
                    self.policy.token_logprobs(filler_batch(self.policy.pad_id).to(self.policy.device))
        finally:
            self.policy.load_adapter_state(current.state)
            self.policy.model.train(was_training)
        return acc

    def _accumulate(
        self, samples: list[TrainingSample], policy_version: int, mismatch: dict[str, list[float]]
    ) -> dict[str, float]:
        spec = self.spec.loss
        micro = make_micro_batches(samples, self.settings.micro_token_budget, self.policy.pad_id)
        tokens = float(sum(float(mb.mask.sum()) for mb in micro))
        sequences = float(len(samples))
        passes = len(micro)
        if self.ranks is not None:  # normalise by the whole step's totals, so the ranks' gradients add up
            tokens, sequences = self.ranks.all_reduce_sum([tokens, sequences])
            if self.lockstep:
                passes = self.ranks.all_reduce_max(passes)
        outputs: list[LossOutput] = []
        total_loss = 0.0
        for mb in micro:
            mb.to(self.policy.device)
            fwd = self.policy.forward_logprobs(
                mb, with_entropy=True, with_kl=spec.kl_coef > 0, entropy_grad=spec.entropy_coef > 0
            )
            lp, entropy = fwd.logprobs, fwd.entropy
            ref = self.policy.reference_logprobs(mb) if spec.kl_coef > 0 else None
            batch = LossBatch(
                logprobs=lp,
                kl_logprobs=fwd.kl_logprobs,
                behaviour_logprobs=mb.behaviour,
                advantages=mb.advantages,
                mask=mb.mask,
                proximal_logprobs=lp.detach(),
                ref_logprobs=ref,
                entropy=entropy,
            )
            out = grpo_loss(batch, spec, token_normalizer=tokens, sequence_normalizer=sequences)
            out.loss.backward()
            total_loss += float(out.loss.detach())
            outputs.append(out)
            _add_mismatch(mismatch, lp.detach(), mb, policy_version)
        for _ in range(passes - len(micro)):
            self._filler_pass(with_kl=spec.kl_coef > 0)
        n_micro = float(len(micro))
        if self.ranks is not None:
            self.ranks.all_reduce_grads(self.params)
            mine = ([(o.sums, o.tokens) for o in outputs], total_loss, n_micro, mismatch)
            outputs, total_loss, n_micro, mismatch = _merge_ranks(self.ranks.all_gather(mine))
        stats = finalize_stats(outputs)
        stats["train/loss"] = total_loss
        stats["train/tokens"] = tokens
        stats["train/sequences"] = sequences
        stats["train/micro_batches"] = n_micro
        for worker, (diff, n) in sorted(mismatch.items()):
            if n > 0:
                stats[MISMATCH_PREFIX + (worker or "unknown")[:_MAX_WORKER_IN_NAME]] = diff / n
        return stats

    def _filler_pass(self, *, with_kl: bool) -> None:
        """The calls of one micro-batch (forward, reference, backward) on a filler sequence: the same collectives
        as the other ranks' passes, a gradient of exactly zero (sharded lockstep)."""
        mb = filler_batch(self.policy.pad_id).to(self.policy.device)
        fwd = self.policy.forward_logprobs(mb, with_entropy=True, with_kl=with_kl)
        if with_kl:
            self.policy.reference_logprobs(mb)
        (fwd.logprobs.sum() * 0.0).backward()

    def _apply(self, lr: float, loss: float) -> dict[str, float]:
        max_norm = self.settings.max_grad_norm if self.settings.max_grad_norm > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if not (math.isfinite(grad_norm) and math.isfinite(loss)):
            # A non-finite gradient would destroy the adapter; skip the update, keep the step count.
            log.warning("step %d: loss %r, grad norm %r are not finite; update skipped", self.step, loss, grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
            return {"train/grad_norm": 0.0, "train/skipped": 1.0, "train/loss": 0.0}
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return {"train/grad_norm": grad_norm}


def _merge_ranks(
    parts: list[tuple[list[tuple[dict[str, float], float]], float, float, dict[str, list[float]]]],
) -> tuple[list[LossOutput], float, float, dict[str, list[float]]]:
    """Every rank's loss sums, loss, micro-batch count and mismatch sums as one step's (merged in rank order, so
    every rank computes the same floats)."""
    outputs = [LossOutput(loss=torch.zeros(()), sums=sums, tokens=n) for p in parts for sums, n in p[0]]
    mismatch: dict[str, list[float]] = {}
    for _, _, _, acc in parts:
        for worker, (diff, n) in acc.items():
            slot = mismatch.setdefault(worker, [0.0, 0.0])
            slot[0] += diff
            slot[1] += n
    return outputs, sum(p[1] for p in parts), sum(p[2] for p in parts), mismatch


def _add_mismatch(acc: dict[str, list[float]], lp: torch.Tensor, mb: MicroBatch, weights_version: int) -> None:
    """Per generator: |trainer - behaviour| logprob over the tokens sampled by ``weights_version``, the version
    whose weights computed ``lp``.

    Only there are the weights identical, so any gap is a numerical or delivery problem (docs/design.md invariant
    6), not policy change: from the training forward only tokens of the current version count (a partial
    rollout's older tokens do not), from a stale forward those of the version swapped in.
    """
    versions = mb.token_versions if mb.token_versions is not None else torch.tensor(mb.versions).unsqueeze(-1)
    mask = mb.mask * (versions.to(mb.mask.device) == weights_version).to(mb.mask.dtype)
    diff = ((lp.float() - mb.behaviour.float()).abs() * mask).sum(-1)
    counts = mask.sum(-1)
    for i, worker in enumerate(mb.worker_ids):
        if float(counts[i]) == 0.0:  # no token of this row was sampled by these weights
            continue
        slot = acc.setdefault(worker, [0.0, 0.0])
        slot[0] += float(diff[i])
        slot[1] += float(counts[i])


def _episode_advantages(
    group: RolloutGroup, loss: LossSpec
) -> tuple[GroupAdvantages, list[Completion], list[float], list[bool], list[int]]:
    """The group's advantages per episode, its episodes' results, each completion's advantage and whether it is
    trained, and each episode's turns."""
    comps = group.completions
    # One advantage per EPISODE (a single-turn completion is an episode of one sample); a split
    # episode's samples each get their episode's (docs/design.md "Multi-turn trajectories").
    members = group.episodes()
    results = [comps[m[0]] for m in members]
    rewards = [None if c.finish_reason == "abort" else c.reward for c in results]
    adv = group_advantages(rewards, scale_rewards=loss.scale_rewards, filter_zero_variance=loss.filter_zero_variance)
    advantages = [0.0] * len(comps)
    trainable = [False] * len(comps)
    turns: list[int] = []
    for e, (keep, c) in enumerate(zip(adv.trainable, results, strict=True)):
        keep = keep and not (loss.mask_truncated_completions and c.finish_reason == "length")
        for i in members[e]:
            advantages[i], trainable[i] = adv.advantages[e], keep
        turns.append(sum(comps[i].turns() for i in members[e]))
    return adv, results, advantages, trainable, turns


def _episode_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The step's tool and timing figures from its groups' summed ``episode_stats`` (none when no group
    carried them: single-turn steps, or groups from a generator that does not send them)."""
    n = sums.get("episodes", 0.0)
    if n <= 0:
        return {}
    gen_s, env_s = sums.get("gen_s", 0.0), sums.get("env_s", 0.0)
    out = {
        "episodes/tool_calls_mean": sums.get("tool_calls", 0.0) / n,
        "episodes/tool_errors": sums.get("tool_errors", 0.0),
        "episodes/timeouts": sums.get("timeouts", 0.0),
    }
    if gen_s + env_s > 0:
        out["episodes/env_time_frac"] = env_s / (gen_s + env_s)
    return out
