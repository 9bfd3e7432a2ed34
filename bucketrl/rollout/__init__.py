"""The rollout domain: the shapes generators, environments, rewards and the trainer share.

- :mod:`bucketrl.rollout.engine`      the inference engine seam (:class:`Engine`) and what it samples
                                      (:class:`SampledCompletion`)
- :mod:`bucketrl.rollout.example`     one dataset row (:class:`Example`)
- :mod:`bucketrl.rollout.reward_kinds` a reward function's result classified (usable, or why not)
- :mod:`bucketrl.rollout.trajectory`  an episode's model turns cut into trainable sequences
- :mod:`bucketrl.rollout.episodes`    episodes and groups of episodes on one generator
- :mod:`bucketrl.rollout.detokenize`  a completion's ids as text, exactly as vLLM makes it (no half characters)

This package sits under every worker: it imports only ``bucketrl.errors`` and ``bucketrl.wire`` (the layer order
is in ``tests/test_layers.py``), never a generator, environment, reward pool or trainer module.
"""
