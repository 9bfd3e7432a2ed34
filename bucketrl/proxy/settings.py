"""Proxy settings (``BUCKETRL_*`` environment variables). Built in ``create_app``, never at import."""

import os
from typing import Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bucketrl.cost import load_prices
from bucketrl.wire.cost import Prices


class ProxySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BUCKETRL_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis for coordination state.")
    bucket_url: str = Field("file:///tmp/bucketrl-bucket", description="file:///abs/dir or s3://bucket/prefix.")
    s3_endpoint_url: str | None = Field(
        None,
        description="S3-compatible endpoint (MinIO, R2, Ceph, a Hugging Face Storage Bucket's "
        "https://s3.hf.co/<namespace>...).",
    )
    s3_addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto",
        description="BUCKETRL_S3_ADDRESSING_STYLE: 'path' (http://host/bucket/key), 'virtual' (http://bucket.host/key) "
        "or 'auto' (path with an endpoint, botocore's own choice on AWS).",
    )
    s3_region: str = Field(
        "", description="BUCKETRL_S3_REGION: the region S3 requests are signed for; empty = boto3's (AWS_REGION...)."
    )
    tokens: str = Field("", description="Comma-separated role:token pairs (admin, trainer, generator, viewer).")
    tokens_file: str | None = Field(None, description="File with one role:token pair a line.")
    host: str = Field("127.0.0.1", description="Bind address of `bucketrl proxy`.")
    port: int = Field(8000, ge=1, le=65535, description="Port of `bucketrl proxy`.")
    tls_cert_file: str = Field(
        "", description="PEM certificate (chain) to serve HTTPS with; empty = plain HTTP. Needs tls_key_file."
    )
    tls_key_file: str = Field("", description="PEM private key of tls_cert_file.")
    allow_anonymous: bool = Field(
        False, description="Run without tokens. Refused unless bound to loopback (embedded mode)."
    )
    insecure_dev_tokens: bool = Field(
        False,
        description="Accept placeholder or short tokens (refused at start otherwise). Refused unless bound to "
        "loopback: for a development proxy only.",
    )
    max_adapter_bytes: int = Field(512 * 1024 * 1024, ge=1, description="Upper bound of an adapter tar.")
    presign_adapters_s: int = Field(
        0,
        ge=0,
        le=7 * 24 * 3600,
        description="S3 buckets: a download asking for it (header X-Bucketrl-Presign: 1, e.g. a regional relay "
        "started with --presigned) is answered 307 to a presigned URL valid this long, so the bytes come straight "
        "from the bucket (BUCKETRL_PRESIGN_ADAPTERS_S; 0 = off).",
    )
    max_checkpoint_bytes: int = Field(4 * 1024**3, ge=1, description="Upper bound of a checkpoint tar.")
    adapter_cache_mb: int = Field(
        256,
        ge=0,
        description="Memory per proxy process for adapter tars recently downloaded (0 = off): after a publish every "
        "generator asks for the same version; one bucket read per version per process answers them all.",
    )
    staging_mb: int = Field(
        256,
        ge=0,
        description="Memory per proxy process for adapter uploads under way that regional relays and generators pull "
        "before their commit (staged publish; on when a relay or generator token is configured; 0 = off): an upload "
        "that does not fit is published unstaged (BUCKETRL_STAGING_MB).",
    )
    max_json_bytes: int = Field(
        8 * 1024 * 1024,
        ge=1,
        description="Upper bound of a JSON/msgpack body other than a rollout batch (the largest legal one, an ack of "
        "100,000 delivery ids, is ~4.3 MB).",
    )
    max_rollout_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1,
        description="Upper bound of a rollout batch body (JSON or msgpack): 64 groups of 16 completions of 1,024 "
        "tokens fit in JSON; the generator's batches are far smaller. Raise it for longer completions.",
    )
    redelivery_timeout_s: float = Field(
        600.0, gt=0, description="Unacked deliveries are handed out again after this long."
    )
    gc_interval_s: float = Field(5.0, gt=0, description="How often the version garbage collector runs.")
    checkpoint_keep: int = Field(
        3,
        ge=0,
        description="Checkpoints kept per run, newest steps first; the maintenance loop deletes older ones "
        "(0 keeps every checkpoint). The latest is never deleted.",
    )
    worker_ttl_s: float = Field(120.0, gt=0, description="Workers silent this long leave the status.")
    prices: str = Field(
        "",
        description="BUCKETRL_PRICES: the prices of the run's cost (docs/cost.md) as JSON, or @path of a JSON file; "
        "fields given replace the defaults (public list prices, estimates), GPU classes merge into the table.",
    )
    _price_table: Prices = PrivateAttr(default_factory=Prices)
    rebuild_on_start: bool = Field(
        True, description="Rebuild runs, versions and checkpoints from bucket manifests if Redis lost them."
    )
    log_level: str = Field("info", description="uvicorn log level.")
    header_timeout_s: float = Field(
        10.0, gt=0, le=300, description="A client must send a request's line and headers within this many seconds."
    )
    max_connections: int = Field(
        2048, ge=1, description="Concurrent connections per proxy process; requests beyond it answer 503 at once."
    )
    shutdown_grace_s: int = Field(
        5,
        ge=1,  # uvicorn reads 0 as "no limit"
        le=300,
        description="On SIGTERM, how long requests in flight may finish before they are cancelled. A long-poll "
        "(an adapter wait, a claim) would otherwise hold the exit for its whole wait, past compose's and "
        "bucketrl up's stop timeouts and into a SIGKILL; its client asks again once the proxy is back.",
    )
    redis_timeout_s: float = Field(5.0, gt=0, description="Redis connect/read timeout; a dead Redis answers 503.")
    redis_max_connections: int = Field(
        1024,
        ge=4,
        description="Redis connections per proxy process; past it a request waits (up to redis_timeout_s) for one. "
        "Each long-polled claim holds one while it blocks.",
    )
    publish_lock_s: float = Field(30.0, gt=0, description="Lease of the per-version write lock (refreshed while held).")
    max_wait_s: float = Field(300.0, gt=0, description="Upper bound of a long-poll's wait_s.")
    pace_slack_versions: int = Field(
        1,
        ge=0,
        le=64,
        description="Versions of slack admission control keeps when it paces prompt leases on the trainer's pace "
        "(state/prompts.py): 1 drops almost no group as stale; 0 queues one more step of work, which matters "
        "with a small max_staleness, at the price of some stale drops.",
    )
    rebuild_gc_grace_s: float = Field(
        300.0, ge=0, description="After a rebuild, no version is garbage-collected for this long (leases died)."
    )
    rebuild_forced: bool = Field(
        False, description="Rebuild every run from the bucket at start (what `bucketrl proxy --rebuild` sets)."
    )

    @field_validator("s3_endpoint_url")
    @classmethod
    def _s3_endpoint(cls, v: str | None) -> str | None:
        if v and not v.startswith(("http://", "https://")):
            raise ValueError(f"BUCKETRL_S3_ENDPOINT_URL must start with http:// or https://, got {v!r}")
        return v

    @field_validator("s3_addressing_style", mode="before")
    @classmethod
    def _s3_style(cls, v: object) -> object:
        if v not in ("auto", "path", "virtual"):
            raise ValueError(f"BUCKETRL_S3_ADDRESSING_STYLE must be auto, path or virtual, got {v!r}")
        return v

    @field_validator("prices")
    @classmethod
    def _valid_prices(cls, v: str) -> str:
        load_prices(v)  # a bad price stops the proxy at start, naming it
        return v

    def model_post_init(self, context: object) -> None:
        self._price_table = load_prices(self.prices)

    def price_table(self) -> Prices:
        return self._price_table

    @model_validator(mode="after")
    def _tls_pair(self) -> "ProxySettings":
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("BUCKETRL_TLS_CERT_FILE and BUCKETRL_TLS_KEY_FILE must be set together (or neither)")
        for name, path in (
            ("BUCKETRL_TLS_CERT_FILE", self.tls_cert_file),
            ("BUCKETRL_TLS_KEY_FILE", self.tls_key_file),
        ):
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}={path} is not a readable file")
        return self
