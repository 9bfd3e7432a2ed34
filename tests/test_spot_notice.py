"""The spot-notice watchers (bucketrl/spot_notice.py, issue 33) against loopback emulations of each cloud's metadata
service (tests/support/cloud_metadata.py), the cloud recognised from DMI files, and ``auto`` on this machine sending
nothing anywhere. The generator processes hearing a notice and draining are in tests/generator/test_spot_notice.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from bucketrl.generator.settings import GeneratorSettings
from bucketrl.spot_notice import AzureWatch, detect_cloud, start_watch
from tests.support.cloud_metadata import CloudMetadata
from tests.support.services import free_port

REPO = Path(__file__).resolve().parents[1]

# What each cloud's machines say about themselves (the DMI files cloud-init and the clouds' docs name).
IDENTITIES = {
    "aws": {"sys_vendor": "Amazon EC2", "product_name": "g5.xlarge", "bios_vendor": "Amazon EC2"},
    "aws-xen": {"sys_vendor": "Xen", "product_name": "HVM domU", "bios_vendor": "Xen", "bios_version": "4.11.amazon"},
    "gcp": {"sys_vendor": "Google", "product_name": "Google Compute Engine", "bios_vendor": "Google"},
    "azure": {
        "sys_vendor": "Microsoft Corporation",
        "product_name": "Virtual Machine",
        "bios_vendor": "Microsoft Corporation",
        "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77",
    },
    # Hyper-V outside Azure: the same vendor and product, not Azure's asset tag.
    "hyperv": {"sys_vendor": "Microsoft Corporation", "product_name": "Virtual Machine", "chassis_asset_tag": "None"},
    "laptop": {"sys_vendor": "LENOVO", "product_name": "21CB0067GE", "bios_vendor": "LENOVO"},
    "qemu": {"sys_vendor": "QEMU", "product_name": "Standard PC (Q35 + ICH9, 2009)", "bios_vendor": "SeaBIOS"},
}


def dmi_dir(root: Path, name: str) -> Path:
    d = root / name
    d.mkdir()
    for file, value in IDENTITIES[name].items():
        (d / file).write_text(value + "\n")
    return d


@pytest.mark.parametrize(
    ("name", "cloud"),
    [
        ("aws", "aws"),
        ("aws-xen", "aws"),
        ("gcp", "gcp"),
        ("azure", "azure"),
        ("hyperv", None),
        ("laptop", None),
        ("qemu", None),
    ],
)
def test_the_cloud_is_recognised_from_the_dmi_files(tmp_path: Path, name: str, cloud: str | None) -> None:
    assert detect_cloud(dmi_dir(tmp_path, name)) == cloud


def test_no_dmi_directory_is_no_cloud(tmp_path: Path) -> None:
    assert detect_cloud(tmp_path / "absent") is None


class Heard:
    def __init__(self) -> None:
        self.got: list[tuple[float, str]] = []
        self.event = threading.Event()

    def __call__(self, notice_s: float, why: str) -> None:
        self.got.append((notice_s, why))
        self.event.set()


@pytest.mark.parametrize(("cloud", "notice_s"), [("aws", 120.0), ("gcp", 30.0), ("azure", 30.0)])
def test_each_watcher_hears_its_clouds_notice_with_the_time_given(cloud: str, notice_s: float) -> None:
    heard, stop = Heard(), threading.Event()
    with CloudMetadata(cloud) as service:
        watch = start_watch(cloud, heard, stop, base_url=service.url, poll_s=0.1)
        assert watch is not None
        time.sleep(0.4)  # a few looks at a quiet service: nothing heard
        assert not heard.got and service.requests
        service.announce(notice_s)
        assert heard.event.wait(2), service.requests
        stop.set()
    got_s, why = heard.got[0]
    assert notice_s - 2 <= got_s <= notice_s, heard.got  # the cloud's time, less what passed since (whole seconds)
    assert cloud in why and len(heard.got) == 1


def test_aws_without_a_token_is_refused_and_the_watcher_exchanges_one() -> None:
    with CloudMetadata("aws") as service:
        assert httpx.get(f"{service.url}/latest/meta-data/spot/instance-action").status_code == 401
        assert httpx.put(f"{service.url}/latest/api/token").status_code == 400  # no TTL header
        heard, stop = Heard(), threading.Event()
        start_watch("aws", heard, stop, base_url=service.url, poll_s=0.1)
        service.announce(120)
        assert heard.event.wait(2)
        stop.set()
        assert service.requests[2:4] == [
            ("PUT", "/latest/api/token"),
            ("GET", "/latest/meta-data/spot/instance-action"),
        ]


def test_gcp_hanging_get_answers_the_change_at_once() -> None:
    heard, stop = Heard(), threading.Event()
    with CloudMetadata("gcp") as service:
        assert httpx.get(f"{service.url}/computeMetadata/v1/instance/preempted").status_code == 403
        start_watch("gcp", heard, stop, base_url=service.url, poll_s=30)  # the poll interval plays no part
        time.sleep(0.5)
        gets = len(service.requests)
        assert gets == 3  # ours, the watcher's first look, then one hanging GET waiting for the change
        t0 = time.monotonic()
        service.announce(30)
        assert heard.event.wait(2)
        assert time.monotonic() - t0 < 0.5 and len(service.requests) == gets
        stop.set()


def test_azure_hears_only_a_preempt_of_this_vm_and_acknowledges_only_when_done() -> None:
    heard, stop = Heard(), threading.Event()
    with CloudMetadata("azure", vm_name="spot-7") as service:
        watch = start_watch("azure", heard, stop, base_url=service.url, poll_s=0.1)
        assert isinstance(watch, AzureWatch)
        service.announce(30, resources=["spot-3"])  # a neighbour in the scale set
        service.announce(600, event_type="Reboot")  # maintenance, not a reclaim
        time.sleep(0.5)
        assert not heard.got
        service.announce(30)
        assert heard.event.wait(2)
        time.sleep(0.3)
        assert not service.acks  # heard, not acknowledged: the worker keeps the whole notice
        watch.done()
        stop.set()
    assert [body for _, body in service.acks] == [{"StartRequests": [{"EventId": watch.event_id}]}]


def test_a_bad_spot_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BUCKETRL_SPOT_NOTICE", "gce")
    with pytest.raises(ValidationError, match="BUCKETRL_SPOT_NOTICE"):
        GeneratorSettings()
    monkeypatch.setenv("BUCKETRL_SPOT_NOTICE", "aws")
    monkeypatch.setenv("BUCKETRL_SPOT_METADATA_URL", "169.254.169.254")
    with pytest.raises(ValidationError, match="BUCKETRL_SPOT_METADATA_URL"):
        GeneratorSettings()
    # As an operator meets it: one line naming the setting, exit 2, before anything is contacted.
    env = {**os.environ, "BUCKETRL_PROXY_URL": "http://127.0.0.1:9", "BUCKETRL_SPOT_NOTICE": "gce"}
    out = subprocess.run([sys.executable, "-m", "bucketrl.cli", "generator"], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "BUCKETRL_SPOT_NOTICE" in lines[0], out.stderr


# Run in a fresh interpreter: an audit hook (PEP 578) sees every socket the process creates, connects or resolves a
# name for, from the moment the worker's settings start the watcher on.
AUDIT = textwrap.dedent(
    """
    import json, sys, threading, time
    from bucketrl.generator.settings import GeneratorSettings
    settings = GeneratorSettings()
    seen = []
    sys.addaudithook(lambda event, args: seen.append([event, repr(args)[:120]]) if event.startswith("socket.")
                     and event != "socket.gethostname" else None)
    watch = settings.spot_watch(lambda notice_s, why: None, threading.Event())
    time.sleep(1.0)
    print(json.dumps({"watch": watch and watch.cloud, "sockets": seen,
                      "threads": [t.name for t in threading.enumerate()]}))
    """
)


def audit(env: dict[str, str]) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BUCKETRL_")}
    out = subprocess.run(
        [sys.executable, "-c", AUDIT], env={**clean, "PYTHONPATH": str(REPO), **env}, capture_output=True,
        text=True, timeout=60, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_auto_on_this_machine_watches_nothing_and_opens_no_socket(tmp_path: Path) -> None:
    assert detect_cloud() is None, "this machine identifies as a cloud VM: the test's premise does not hold"
    got = audit({})  # BUCKETRL_SPOT_NOTICE unset: auto, the real DMI directory
    assert got["watch"] is None and got["sockets"] == [], got
    assert not [t for t in got["threads"] if t.startswith("spot-notice")], got
    # The same process set-up with an EC2 identity does open one, to the metadata URL: the hook would have seen it.
    port = free_port()
    env = {"BUCKETRL_DMI_DIR": str(dmi_dir(tmp_path, "aws")), "BUCKETRL_SPOT_METADATA_URL": f"http://127.0.0.1:{port}"}
    got = audit(env)
    assert got["watch"] == "aws" and any(e == "socket.connect" and str(port) in a for e, a in got["sockets"]), got
