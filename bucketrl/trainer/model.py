"""The policy: a transformers base model wrapped in a peft LoRA adapter built from the run's ``LoraSpec``.

Only the LoRA parameters train. Logprobs of sampled tokens go through
:func:`bucketrl.logprobs.sampled_token_logprobs` with the temperature / top-k / top-p each group was sampled
with (its batch records them), exactly as the generators compute behaviour logprobs (docs/design.md invariant 6), so at
identical weights ``ratio`` is 1.
The reference pass for the KL term runs the same model with the adapter disabled (no second model); the KL
compares temperature-only logprobs (TRL's), never the top-k/top-p processed ones.

The adapter is saved as ``adapter_model.safetensors`` + ``adapter_config.json`` (what ``PeftModel.from_pretrained``
and vLLM's ``LoRARequest`` load), with ``target_modules`` written as a sorted list of module-name suffixes so the
same weights always give the same bytes (and the same sha256).

    policy = PolicyModel(run_spec, device="cpu", dtype="float32", seed=0)
    lp, entropy = policy.token_logprobs(micro_batch, with_entropy=True)   # [B, T] each
    out = policy.forward_logprobs(micro_batch, with_kl=True)                # + out.kl_logprobs (temperature only)
    tar = policy.adapter_tar()                                              # PUT /adapters/{N}
    snap = policy.adapter_snapshot(); threading.Thread(target=lambda: put(snap.tar())).start()  # off the loop
    snap.tar(dtype=policy.adapter_dtype)                                    # as published: the run's adapter_dtype

The LoRA parameters are float32 master weights whatever the base's dtype (peft's default), and so are the
checkpoints (a resume is exact); only the published tar is cast, to ``adapter_dtype`` (the run spec's, ``auto``
resolved from the base model's own dtype by :func:`resolve_adapter_dtype`).
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bucketrl.logprobs import process_logits, sampled_token_logprobs
from bucketrl.preflight import linear_types
from bucketrl.tarball import pack_dir
from bucketrl.trainer.batching import MicroBatch
from bucketrl.wire.runs import RunSpec

# Trainer logprobs below this are clamped: a sampled token that the trainer's top-k/top-p would exclude
# (a tie at the boundary) gets a tiny but finite probability instead of -inf (which poisons KL and stats).
LOGPROB_FLOOR = -1e4

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Shards a base model in place onto a device, leaving the given (trainable) parameters alone
# (bucketrl/trainer/sharding.py's BaseSharder).
Sharder = Callable[[torch.nn.Module, set[torch.nn.Parameter], torch.device], None]


def resolve_adapter_dtype(requested: str, base_model: str) -> str:
    """The run spec's ``adapter_dtype`` with ``auto`` resolved: bfloat16 when the base model's own dtype (its
    config's ``torch_dtype``, whatever dtype this process loads it in) is bfloat16, float32 otherwise."""
    if requested != "auto":
        return requested
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_model)
    own = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return "bfloat16" if str(own).removeprefix("torch.") == "bfloat16" else "float32"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def all_linear_targets(model: torch.nn.Module) -> list[str]:
    """Suffixes of every linear layer (``nn.Linear``, GPT-2's ``Conv1D``) except the output head: peft's
    ``all-linear``, spelled out."""

    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head is not None else None
    linear = linear_types()
    names = {
        name.rsplit(".", 1)[-1]
        for name, mod in model.named_modules()
        if isinstance(mod, linear) and mod is not head and name
    }
    if not names:
        raise ValueError("the base model has no linear layers for LoRA to target")
    return sorted(names)


def eos_token_ids(model: torch.nn.Module) -> set[int]:
    """Every id that ends a completion: the generation config's and the model config's."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return ids


@dataclass(frozen=True)
class AdapterSnapshot:
    """Adapter weights frozen at one step, and the config: what ``PeftModel.save_pretrained`` writes.

    Written without peft's README model card (rendering it costs more than the weights of a small adapter,
    and the trainer publishes every ``sync_every`` steps); same state dict, same safetensors metadata.
    """

    state: dict[str, torch.Tensor]
    config_json: str

    def write(self, directory: str | Path, dtype: str | None = None) -> Path:
        """The PEFT files; ``dtype`` (``bfloat16``...): the weights cast to it (round to nearest even), as shipped."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        state = self.state
        if dtype is not None:
            state = {k: v.to(DTYPES[dtype]) for k, v in state.items()}
        save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(self.config_json)
        return out

    def tar(self, scratch: str | Path | None = None, dtype: str | None = None) -> bytes:
        """The deterministic tar of the two files (weights cast to ``dtype`` if given), written through a temporary
        directory under ``scratch``."""
        with tempfile.TemporaryDirectory(prefix="bucketrl-adapter-", dir=scratch) as tmp:
            return pack_dir(self.write(tmp, dtype))


@dataclass
class TokenLogprobs:
    """Per completion token, [B, T] each, zero on masked positions."""

    # Under the processed distribution each row was sampled from (temperature, top-k, top-p), floored at
    # LOGPROB_FLOOR: what the behaviour logprobs are compared with (ratio, mismatch).
    logprobs: torch.Tensor
    entropy: torch.Tensor | None = None
    # Under temperature only (no top-k/top-p): what the KL term uses.
    kl_logprobs: torch.Tensor | None = None


class PolicyModel:
    """Base model + one trainable LoRA adapter (named ``default``)."""

    def __init__(
        self,
        spec: RunSpec,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        seed: int = 0,
        gradient_checkpointing: bool = False,
        shard: Sharder | None = None,
    ) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        self.spec = spec
        self.device = resolve_device(device)
        self._config_cache: str | None = None
        # What published versions hold (the master weights below stay float32).
        self.adapter_dtype = resolve_adapter_dtype(spec.adapter_dtype, spec.base_model)
        base = AutoModelForCausalLM.from_pretrained(spec.base_model, dtype=DTYPES[dtype])
        vocab = base.get_output_embeddings().weight.shape[0]
        if vocab < spec.vocab_size:
            raise ValueError(f"run spec vocab_size {spec.vocab_size} exceeds the model's output vocabulary {vocab}")
        self.eos_token_ids = eos_token_ids(base)
        pad = getattr(base.config, "pad_token_id", None)
        self.pad_id = int(pad) if isinstance(pad, int) else (min(self.eos_token_ids) if self.eos_token_ids else 0)
        targets = spec.lora.target_modules
        if targets == "all-linear":
            targets = all_linear_targets(base)
        if gradient_checkpointing:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            base.enable_input_require_grads()
        config = LoraConfig(
            r=spec.lora.r,
            lora_alpha=spec.lora.alpha,  # type: ignore[arg-type]  # peft types it int; it scales by alpha / r
            lora_dropout=spec.lora.dropout,
            target_modules=list(targets),
            task_type="CAUSAL_LM",
            base_model_name_or_path=spec.base_model,
        )
        # LoRA A is initialised randomly (B = 0, so the initial adapter is the identity): seed it.
        torch.manual_seed(seed)
        self.model = get_peft_model(base, config)
        self.model.train()
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if not names or any("lora_" not in n for n in names):
            raise RuntimeError(f"expected only LoRA parameters to train, got {names[:5]}")
        self.sharded = shard is not None
        if shard is None:
            self.model.to(self.device)
        else:
            # The sharder moves the base to the device one shard at a time (the whole base need never fit it);
            # the adapter stays whole and replicated, moved here.
            keep = {p for p in self.model.parameters() if p.requires_grad}
            for p in keep:
                p.data = p.data.to(self.device)
            shard(self.model.get_base_model(), keep, self.device)

    # -- parameters ----------------------------------------------------------------------------------

    def trainable_parameters(self) -> Iterator[torch.nn.Parameter]:
        return (p for p in self.model.parameters() if p.requires_grad)

    def adapter_state(self) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model).items()}

    # -- forward passes ------------------------------------------------------------------------------

    def _logits(self, mb: MicroBatch) -> torch.Tensor:
        out = self.model(
            input_ids=mb.input_ids.to(self.device),
            attention_mask=mb.attention_mask.to(self.device),
            logits_to_keep=mb.logits_to_keep,
            use_cache=False,
        )
        logits = out.logits  # [B, K, V]
        index = mb.logit_index.to(self.device).unsqueeze(-1).expand(-1, -1, logits.shape[-1])
        return logits.gather(1, index)  # [B, T, V]: row t predicts completion token t

    def token_logprobs(self, mb: MicroBatch, *, with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs, entropy)`` of :meth:`forward_logprobs` (the processed logprobs, with grad)."""
        out = self.forward_logprobs(mb, with_entropy=with_entropy)
        return out.logprobs, out.entropy

    def forward_logprobs(
        self, mb: MicroBatch, *, with_entropy: bool = False, with_kl: bool = False, entropy_grad: bool = False
    ) -> TokenLogprobs:
        """log pi_theta of each completion token (with grad) and, optionally, the per-token entropy (with grad
        when ``entropy_grad``: the loss's entropy bonus, ``loss.entropy_coef``; a detached stat otherwise).

        Each row is processed with the sampling settings it was generated with (``mb.samplings``; None: the
        run's), so a group sampled before the run's settings changed keeps its own temperature / top-k / top-p.

        ``with_kl`` adds ``kl_logprobs`` from the same forward: the TEMPERATURE-ONLY logprobs (no top-k/top-p
        masking, no floor), what the KL term uses (as TRL's). The processed logprobs can be -inf (floored to
        -1e4) for a sampled token outside the current nucleus, and a KL between two such values is either
        infinite or ~1e4; the ratio against the behaviour logprobs needs the processed ones, the KL must not.
        """
        logits = self._logits(mb)
        completion = mb.completion_ids.to(self.device)
        mask = mb.mask.to(self.device)
        rows = self._rows_by_sampling(mb)
        lp, entropy = self._per_setting(
            logits, completion, rows, with_entropy or entropy_grad, processed=True, entropy_grad=entropy_grad
        )
        lp = lp.clamp(min=LOGPROB_FLOOR)
        lp = torch.where(mask > 0, lp, torch.zeros_like(lp))
        if not with_kl:
            return TokenLogprobs(lp, entropy)
        if all(top_k <= 0 and top_p >= 1.0 for _, top_k, top_p in rows):
            kl_lp = lp  # no truncation anywhere: the processed logprobs ARE the temperature-only ones
        else:
            kl_lp, _ = self._per_setting(logits, completion, rows, False, processed=False)
            kl_lp = torch.where(mask > 0, kl_lp, torch.zeros_like(kl_lp))
        return TokenLogprobs(lp, entropy, kl_lp)

    def _per_setting(
        self,
        logits: torch.Tensor,
        completion: torch.Tensor,
        rows: dict[tuple[float, int, float], list[int]],
        with_entropy: bool,
        *,
        processed: bool,
        entropy_grad: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs (and entropy) of each row under its own setting; ``processed=False`` drops top-k/top-p."""

        def one(
            setting: tuple[float, int, float], lg: torch.Tensor, comp: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor | None]:
            temperature, top_k, top_p = setting
            s = (temperature, top_k, top_p) if processed else (temperature, -1, 1.0)
            return _logprobs_and_entropy(lg, comp, s, with_entropy, entropy_grad=entropy_grad)

        if len(rows) == 1:
            ((setting, _),) = rows.items()
            return one(setting, logits, completion)
        lp = torch.zeros(completion.shape, dtype=torch.float32, device=self.device)
        entropy = torch.zeros_like(lp) if with_entropy else None
        for setting, idx in rows.items():
            index = torch.tensor(idx, device=self.device)
            part, part_entropy = one(setting, logits[index], completion[index])
            lp = lp.index_put((index,), part)
            if entropy is not None and part_entropy is not None:
                entropy = entropy.index_put((index,), part_entropy)  # out of place: autograd keeps both parts
        return lp, entropy

    def _rows_by_sampling(self, mb: MicroBatch) -> dict[tuple[float, int, float], list[int]]:
        """Row indices per distinct (temperature, top_k, top_p), in first-seen order."""
        rows: dict[tuple[float, int, float], list[int]] = {}
        samplings = mb.samplings or [None] * mb.size
        for i, sampling in enumerate(samplings):
            s = sampling or self.spec.sampling
            rows.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
        return rows

    @torch.no_grad()
    def reference_logprobs(self, mb: MicroBatch) -> torch.Tensor:
        """Temperature-only logprobs under the base model (the adapter disabled), for the KL term: the same
        distribution as ``forward_logprobs(..., with_kl=True).kl_logprobs``, so a token outside either nucleus gives a
        finite, truthful KL."""
        was_training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter():
                lp = self.forward_logprobs(mb, with_kl=True).kl_logprobs
        finally:
            self.model.train(was_training)
        assert lp is not None
        return lp.detach()

    # -- adapter files -------------------------------------------------------------------------------

    def adapter_snapshot(self) -> AdapterSnapshot:
        """A copy of the adapter weights (cheap: a clone) that can be written out later, on any thread."""
        from peft import get_peft_model_state_dict

        state = {
            k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(self.model).items()
        }
        return AdapterSnapshot(state=state, config_json=self._config_json())

    def _config_json(self) -> str:
        """``adapter_config.json`` as peft writes it (``inference_mode`` true), target_modules sorted."""
        if self._config_cache is None:
            config = copy.deepcopy(self.model.peft_config["default"])
            config.inference_mode = True
            with tempfile.TemporaryDirectory(prefix="bucketrl-cfg-") as tmp:
                config.save_pretrained(tmp)  # peft's own config writer
                cfg = json.loads((Path(tmp) / "adapter_config.json").read_text())
            if isinstance(cfg.get("target_modules"), list):
                cfg["target_modules"] = sorted(cfg["target_modules"])
            self._config_cache = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
        return self._config_cache

    def save_adapter(self, directory: str | Path) -> Path:
        """Write exactly ``adapter_config.json`` + ``adapter_model.safetensors`` into ``directory``."""
        return self.adapter_snapshot().write(directory)

    def adapter_tar(self) -> bytes:
        """The adapter directory as the deterministic tar the proxy stores (``PUT /adapters/{N}``)."""
        return self.adapter_snapshot().tar()

    def load_adapter(self, directory: str | Path) -> None:
        """Load adapter weights saved by :meth:`save_adapter` into the trainable adapter (in place)."""
        from safetensors.torch import load_file

        self.load_adapter_state(load_file(str(Path(directory) / "adapter_model.safetensors")))

    def load_adapter_state(self, state: dict[str, torch.Tensor]) -> None:
        """Copy adapter weights (as in :meth:`adapter_snapshot`) into the parameters, in place: the optimizer
        keeps pointing at the same tensors."""
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.model, state)
        unexpected = getattr(result, "unexpected_keys", None)
        if unexpected:
            raise ValueError(f"adapter has keys this model does not: {unexpected[:5]}")


def _logprobs_and_entropy(
    logits: torch.Tensor,
    completion: torch.Tensor,
    setting: tuple[float, int, float],
    with_entropy: bool,
    *,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of the sampled tokens (with grad) under one sampling setting, and the entropy (with grad only
    when ``entropy_grad``)."""

    temperature, top_k, top_p = setting
    lp = sampled_token_logprobs(logits, completion, temperature, top_k, top_p)
    if not with_entropy:
        return lp, None
    if entropy_grad:
        return lp, _entropy(logits, setting)
    with torch.no_grad():
        return lp, _entropy(logits.detach(), setting)


def _entropy(logits: torch.Tensor, setting: tuple[float, int, float]) -> torch.Tensor:
    """-sum p log p of the processed distribution. A token top-k/top-p removed has p = 0 and log p = -inf: its
    log p is replaced by 0 before the product, not after, or the backward pass would multiply 0 by inf (nan)."""
    logp = torch.log_softmax(process_logits(logits, *setting), dim=-1)
    p = logp.exp()
    return -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
