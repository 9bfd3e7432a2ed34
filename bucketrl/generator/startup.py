"""What a generator waits for before its loop (the run to exist, its dataset to be readable), and the run spec
read again between versions."""

from __future__ import annotations

import logging
import threading

from bucketrl import errors, preflight
from bucketrl.client import ProxyClient
from bucketrl.generator import trust
from bucketrl.generator.engines.base import check_reproducible
from bucketrl.generator.settings import GeneratorSettings
from bucketrl.rollout.example import Example
from bucketrl.wire import RunSpec

# The worker's logger: these lines read as they did when this code was part of the worker.
log = logging.getLogger("bucketrl.generator.worker")


def wait_for_run(client: ProxyClient, stop_event: threading.Event, run: str, proxy_url: str) -> RunSpec | None:
    """The run's spec, polled for until it exists; None if stopped first. One attempt per poll: the client's own
    outage retries would hold a SIGTERM for their stop grace, while nothing is held yet that needs it."""
    delay = 0.5
    while not stop_event.is_set():
        try:
            return client.get_run(retry=False).spec
        except (errors.NotFound, errors.Unavailable) as exc:
            log.info("waiting for run %s on %s: %s", run, proxy_url, exc.message)
        stop_event.wait(delay)
        delay = min(delay * 2, 10.0)
    return None


def load_examples(client: ProxyClient, stop_event: threading.Event, spec: RunSpec) -> list[Example] | None:
    """The run's examples; a ``bucket:`` dataset the trainer has not uploaded yet is waited for."""
    delay = 0.5
    while not stop_event.is_set():
        try:
            examples = preflight.check_dataset(spec.dataset, client, preflight.SPEC_NAMES)
        except (errors.NotFound, errors.Unavailable) as exc:
            log.info("waiting for the run's dataset %s: %s", spec.dataset.uri, exc.message)
            stop_event.wait(delay)
            delay = min(delay * 2, 10.0)
            continue
        if len(examples) < spec.dataset.size:
            raise preflight.ConfigError(
                f"{preflight.SPEC_NAMES['dataset']} {spec.dataset.uri}: {len(examples)} examples but the run was "
                f"created with dataset.size={spec.dataset.size}"
            )
        return examples
    return None


def refreshed_spec(client: ProxyClient, settings: GeneratorSettings) -> RunSpec | None:
    """The run spec as it is now, if this worker admits it (None: keep the current one)."""
    try:
        spec = client.get_run().spec
        check_reproducible(spec.sampling, spec.vocab_size, settings.engine)
        trust.check_spec(spec, settings.allowed_reward_modules, settings.allowed_dataset_locations)
    except preflight.ConfigError as exc:  # a spec change the allow-lists refuse: keep the admitted one
        log.error("keeping the current run spec: %s", exc)
        return None
    except errors.BucketRLError as exc:
        log.warning("keeping the current run spec: %s", exc.message)
        return None
    return spec
