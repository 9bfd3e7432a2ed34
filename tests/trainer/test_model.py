"""The policy model: LoRA-only training, logprobs equal to a generator's, adapter files peft loads."""

from __future__ import annotations

import json
import random
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from bucketrl.bundles import ADAPTER_FILES
from bucketrl.logprobs import process_logits
from bucketrl.tarball import unpack
from bucketrl.tasks.tiny_model import VOCAB_SIZE
from bucketrl.trainer.batching import collate, group_samples
from bucketrl.trainer.model import PolicyModel
from bucketrl.wire.rollouts import Completion, RolloutGroup
from bucketrl.wire.runs import LoraSpec, SamplingSpec
from tests.trainer.helpers import tiny_spec


def perturb_adapter(policy: PolicyModel, seed: int = 1, scale: float = 0.5) -> None:
    """LoRA B starts at 0 (adapter = identity); give it weights so the adapter changes the logprobs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def test_only_lora_parameters_train_and_all_linear_is_spelled_out(tiny_model_dir: Path) -> None:
    policy = PolicyModel(tiny_spec(tiny_model_dir), device="cpu")
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    frozen = [n for n, p in policy.model.named_parameters() if not p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    assert any("embed_tokens" in n for n in frozen)
    cfg = policy.model.peft_config["default"]
    assert sorted(cfg.target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert policy.eos_token_ids == {1, 3} and policy.pad_id == 0  # <|endoftext|> and <|im_end|>


def policy_and_generator(model_dir: Path, sampling: SamplingSpec) -> tuple[PolicyModel, torch.nn.Module]:
    """A trainer policy with a non-trivial adapter, and a "generator": a fresh base model with that adapter
    saved and loaded back, the way engines load it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = PolicyModel(tiny_spec(model_dir, sampling=sampling), device="cpu")
    perturb_adapter(policy)
    with tempfile.TemporaryDirectory() as tmp:
        policy.save_adapter(tmp)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        gen = PeftModel.from_pretrained(base, tmp).eval()
    return policy, gen


def sample_like_a_generator(model: torch.nn.Module, prompt: list[int], n_new: int, sampling: SamplingSpec, seed: int):
    """Incremental decoding with a KV cache, sampling from the processed distribution: how an engine works."""
    g = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    logprobs: list[float] = []
    past = None
    cur = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n_new):
            out = model(input_ids=cur, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logp = torch.log_softmax(
                process_logits(out.logits[0, -1], sampling.temperature, sampling.top_k, sampling.top_p), dim=-1
            )
            tok = int(torch.multinomial(logp.exp(), 1, generator=g))
            tokens.append(tok)
            logprobs.append(float(logp[tok]))
            if tok == 1:
                break
            cur = torch.tensor([[tok]])
    return tokens, logprobs


@pytest.mark.parametrize(
    "sampling",
    [SamplingSpec(temperature=1.0), SamplingSpec(temperature=0.7, top_k=20, top_p=0.9)],
    ids=["t1.0", "t0.7-k20-p0.9"],
)
def test_trainer_logprobs_equal_generator_behaviour_logprobs(tiny_model_dir: Path, sampling: SamplingSpec) -> None:
    policy, gen = policy_and_generator(tiny_model_dir, sampling)
    rng = random.Random(0)
    groups = []
    for i in range(3):
        prompt = [rng.randrange(3, 64) for _ in range(2 + 3 * i)]
        comps = []
        for j in range(3):
            toks, lps = sample_like_a_generator(gen, prompt, 6 + 2 * j, sampling, seed=10 * i + j)
            comps.append(Completion(token_ids=toks, logprobs=lps, reward=float(j)))
        groups.append(RolloutGroup(prompt_id=f"0-{i}", prompt_index=i, prompt_token_ids=prompt, completions=comps))
    samples = []
    for g in groups:
        samples += group_samples(g, [0.0] * 3, [True] * 3, version=1, worker_id="w", eos_token_ids={1})
    mb = collate(samples, policy.pad_id)  # one padded batch: different prompt and completion lengths
    lp, entropy = policy.token_logprobs(mb, with_entropy=True)
    diff = ((lp.detach() - mb.behaviour).abs() * mb.mask).max().item()
    assert diff < 1e-3, diff
    assert entropy is not None and bool(torch.isfinite(entropy).all())
    # The adapter matters (so the check above is not vacuous): the base model's logprobs differ.
    ref = policy.reference_logprobs(mb)
    assert ((ref - mb.behaviour).abs() * mb.mask).max().item() > 1e-2


def test_each_row_is_recomputed_with_the_sampling_it_was_generated_with(tiny_model_dir: Path) -> None:
    """One micro-batch mixing groups sampled at different settings (the run's changed mid-run): every row's
    logprobs match its own behaviour logprobs, and the loss still gets gradients through all of them."""
    run_sampling = SamplingSpec(temperature=1.0)
    policy, gen = policy_and_generator(tiny_model_dir, run_sampling)
    settings: list[SamplingSpec | None] = [None, SamplingSpec(temperature=0.4), SamplingSpec(temperature=0.7, top_k=9)]
    samples = []
    for i, sampling in enumerate(settings):
        prompt = [5 + i, 9, 11 + 2 * i]
        toks, lps = sample_like_a_generator(gen, prompt, 7, sampling or run_sampling, seed=i)
        group = RolloutGroup(
            prompt_id=f"0-{i}",
            prompt_index=i,
            prompt_token_ids=prompt,
            completions=[Completion(token_ids=toks, logprobs=lps, reward=1.0)],
        )
        samples += group_samples(group, [1.0], [True], version=1, worker_id="w", eos_token_ids={1}, sampling=sampling)
    mb = collate(samples, policy.pad_id)
    assert mb.samplings == settings
    lp, entropy = policy.token_logprobs(mb, with_entropy=True)
    diff = ((lp.detach() - mb.behaviour).abs() * mb.mask).max().item()
    assert diff < 1e-3, diff
    # Not vacuous: at the run's temperature the rows sampled at 0.4 / 0.7 would not match.
    flat = policy.token_logprobs(collate([*(replace(s, sampling=None) for s in samples)], policy.pad_id))[0]
    assert ((flat.detach() - mb.behaviour).abs() * mb.mask)[1:].max().item() > 1e-2
    assert entropy is not None and bool(torch.isfinite(entropy).all())
    (lp * mb.mask).sum().backward()
    grads = [p.grad for n, p in policy.model.named_parameters() if "lora_A" in n]
    assert any(g is not None and float(g.abs().sum()) > 0 for g in grads)


def test_reference_pass_is_the_base_model(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    policy = PolicyModel(tiny_spec(tiny_model_dir), device="cpu")
    perturb_adapter(policy)
    rng = random.Random(1)
    group = RolloutGroup(
        prompt_id="0-0",
        prompt_index=0,
        prompt_token_ids=[5, 6, 7],
        completions=[Completion(token_ids=[rng.randrange(3, 64) for _ in range(5)], logprobs=[-1.0] * 5, reward=1.0)],
    )
    mb = collate(group_samples(group, [1.0], [True], version=1, worker_id="w", eos_token_ids={1}), 0)
    ref = policy.reference_logprobs(mb)
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = base(input_ids=mb.input_ids).logits[0, 2:7]
    want = torch.log_softmax(logits, -1).gather(-1, mb.completion_ids[0].unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(ref[0], want, atol=1e-5)
    assert policy.model.training, "the reference pass must restore train mode"


def test_adapter_tar_holds_exactly_the_peft_files_and_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    spec = tiny_spec(tiny_model_dir, lora=LoraSpec(r=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    policy = PolicyModel(spec, device="cpu")
    perturb_adapter(policy, seed=3)
    tar = policy.adapter_tar()
    assert tar == policy.adapter_tar(), "same weights must give the same bytes (and sha256)"
    names = unpack(tar, tmp_path / "a")
    assert sorted(names) == sorted(ADAPTER_FILES)
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["target_modules"] == ["q_proj", "v_proj"]
    assert cfg["base_model_name_or_path"] == str(tiny_model_dir)
    # peft loads the directory directly and gets the trainer's weights.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "a"))
    x = torch.tensor([[3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, policy.model.eval()(input_ids=x).logits, atol=1e-6)
    # load_adapter round-trips into a fresh policy.
    other = PolicyModel(spec, device="cpu", seed=9)
    other.load_adapter(tmp_path / "a")
    for k, v in policy.adapter_state().items():
        assert torch.equal(v, other.adapter_state()[k]), k


def test_vocab_larger_than_the_model_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        PolicyModel(tiny_spec(tiny_model_dir, vocab_size=VOCAB_SIZE + 1), device="cpu")
