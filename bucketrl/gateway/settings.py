"""Gateway settings (``BUCKETRL_*`` environment variables, ``bucketrl gateway`` options override them)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="BUCKETRL_", extra="ignore")

    proxy_url: str = Field("http://127.0.0.1:8000", description="The bucketrl proxy.")
    token: str = Field("", description="A trainer-role token: the gateway publishes versions and queues jobs.")
    run: str = Field("default", description="The run whose versions the gateway publishes (it must exist).")
    host: str = Field("127.0.0.1", description="Bind address: beside the TRL trainer, loopback by default.")
    port: int = Field(8100, ge=0, le=65535, description="Port (0: any free one; the bound URL is printed).")
    run_spec: Path | None = Field(
        None,
        description="A run spec JSON file: the gateway creates the run from it, or confirms it, before serving "
        "(what bucketrl's trainer does with BUCKETRL_RUN_SPEC; a deployment with an external trainer has no other "
        "creator). Unset: the run must exist.",
    )
    lease_token: str = Field(
        "",
        description="A generator-role token of the run: with it the gateway leases every version a loaded name "
        "maps to, so GC keeps what TRL may still request past the run's max_staleness (empty: no leases).",
    )
    gateway_state: Path | None = Field(
        None,
        description="JSON file of adapter name -> version (default ~/.cache/bucketrl/gateway/<run>.json): a "
        "restarted gateway still answers the names it published.",
    )
    served_model_names: list[str] = Field(
        default_factory=list,
        description="Names that mean the base model (besides the run spec's base_model), like vLLM's "
        "--served-model-name: TRL sends its model's config._name_or_path.",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="What /v1/models reports (default: the run spec's episode.max_episode_tokens)."
    )
    max_lora_rank: int | None = Field(
        None, ge=1, description="What /server_info reports (default: the run spec's lora.r)."
    )
    completion_timeout_s: float = Field(
        600.0, gt=0, description="A completion job unanswered by then fails with 504 (TRL's request_timeout: 600)."
    )
    job_wait_s: float = Field(20.0, gt=0, le=60, description="Long-poll of one wait for a job's result.")
    max_connections: int = Field(1024, ge=1, description="Connections to the proxy (each waiting job holds one).")
    log_level: str = Field("info")

    def state_path(self) -> Path:
        return self.gateway_state or Path.home() / ".cache" / "bucketrl" / "gateway" / f"{self.run}.json"
