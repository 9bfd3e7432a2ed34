"""``bucketrl gateway``: looks like a vLLM server to TRL's ``AsyncGRPOTrainer``; a bucketrl pool behind it.

The HTTP contract, read from TRL 1.16.0's source (``trl/experimental/async_grpo/vllm_client.py``,
``async_rollout_worker.py``, ``async_grpo_trainer.py``), every call TRL makes and what it reads back:

==========================================  ========================================================================
``GET /health``                             polled every 2 s until 200 (``wait_for_server_ready``); body unread.
``GET /v1/models``                          ``raise_for_status``; reads ``json()["data"][0]["max_model_len"]`` (the
                                            default ``token_budget``, only when the config leaves it unset).
``GET /server_info?config_format=json``     ``raise_for_status``; reads ``["vllm_config"]`` and from it
                                            ``lora_config`` (``None``: merged-weight NCCL sync, which a gateway
                                            cannot serve, so it is never ``None`` here), ``lora_config.max_lora_rank``
                                            (>= the adapter's rank), ``lora_config.max_loras`` (>= ``max_staleness
                                            + 2``) and ``parallel_config.data_parallel_size`` (> 1 only warns);
                                            ``get_dtype`` would read ``model_config.dtype`` (the adapter path never
                                            calls it).
``POST /pause?mode=keep``, ``POST /resume`` status must be 200, body unread. Called around every sync.
``POST /v1/load_lora_adapter``              JSON ``{lora_name, lora_path, load_inplace: false}``; 404 is read as
                                            "runtime LoRA updating off" (so the gateway answers a missing directory
                                            400, not vLLM's 404), any status but 200 raises with the body.
                                            TRL names versions ``trl-policy-v{N}`` (N = 1, 2, ...; the first load
                                            happens at train begin, before any completion request).
``POST /v1/unload_lora_adapter``            JSON ``{lora_name}``; response unread ("missing names are not an
                                            error"). TRL unloads ``v{N - max_staleness - 1}`` after loading ``v{N}``.
``GET /get_world_size``                     reads ``json()["world_size"]`` (no status check).
``POST /v1/completions``                    from the rollout worker's aiohttp session (up to ``max_inflight_tasks``
                                            concurrent; retried on transport errors only). JSON ``{model, prompt:
                                            [token ids], max_tokens, temperature, top_p, top_k, repetition_penalty,
                                            n: 1, return_token_ids: true, logprobs: 0, seed[, min_p]}``;
                                            ``raise_for_status``, then reads ``choices[0]["token_ids"]`` and
                                            ``choices[0]["logprobs"]["token_logprobs"]`` (one float per token).
==========================================  ========================================================================

``model`` is ``f"{lora_name}-v{model_version}"`` once an adapter is synced (the base model's
``config._name_or_path`` otherwise). The NCCL weight-transfer routes (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) are used only for merged-weight sync,
which this gateway does not offer (it always reports a ``lora_config``).

What the gateway does with them: an adapter load packs the directory and publishes it as the run's next version
through the proxy (committed in the bucket before 200); a completion request becomes one completion job per
prompt, pinned to that version, queued through the proxy to the generator pool and long-polled for its answer.
Pause and resume are no-ops: versions are immutable and every request is pinned to one, so no replica has to stop.
"""
