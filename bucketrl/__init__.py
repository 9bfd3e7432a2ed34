"""bucketrl: asynchronous GRPO with LoRA through an object-storage bucket and a REST proxy.

Package map (one folder per process role, shared pieces at the top):

- ``bucketrl.wire``      pydantic models of everything on the wire (imports without torch)
- ``bucketrl.rollout``   the shapes generators, environments, rewards and the trainer share (samples, examples,
                         episodes, the engine seam, reward classification)
- ``bucketrl.storage``   bucket backends (``file://``, ``s3://``) behind one protocol (proxy only)
- ``bucketrl.client``    the HTTP client workers use to talk to the proxy
- ``bucketrl.proxy``     the FastAPI control plane over Redis and the bucket
- ``bucketrl.envs``      multi-turn environments and the generator's OpenAI-compatible endpoint
- ``bucketrl.generator`` rollout workers (vLLM or transformers engines, rewards, datasets)
- ``bucketrl.trainer``   the GRPO trainer (torch + peft)
- ``bucketrl.tasks``     the built-in tiny model and toy task used by the demo and the tests
- ``bucketrl.sim``       the SIMULATION harness for benchmarks (a GPU model, a simulated engine and trainer)

Which package may import which: the layer order in ``tests/test_layers.py``.
"""

__version__ = "0.1.0"
