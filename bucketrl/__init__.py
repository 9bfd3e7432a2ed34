"""bucketrl: asynchronous GRPO with LoRA through an object-storage bucket and a REST proxy.

Package map (one folder per process role, shared pieces at the top):

- ``bucketrl.wire``      pydantic models of everything on the wire (imports without torch)
- ``bucketrl.storage``   bucket backends (``file://``, ``s3://``) behind one protocol (proxy only)
- ``bucketrl.client``    the HTTP client workers use to talk to the proxy
- ``bucketrl.proxy``     the FastAPI control plane over Redis and the bucket
- ``bucketrl.generator`` rollout workers (vLLM or transformers engines, rewards, datasets)
- ``bucketrl.trainer``   the GRPO trainer (torch + peft)
- ``bucketrl.tasks``     the built-in tiny model and toy task used by the demo and the tests
"""

__version__ = "0.1.0"
