"""Settings every worker shares. Each service adds its own class (``bucketrl.<service>.settings``).

All settings come from ``BUCKETRL_*`` environment variables (pydantic-settings). Settings objects are
built by entry points, never at import time.
"""

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from bucketrl.wire.common import ID_PATTERN


class WorkerSettings(BaseSettings):
    """What a trainer or generator needs: the proxy's address, its own token and the run id."""

    model_config = SettingsConfigDict(env_prefix="BUCKETRL_", extra="ignore")

    proxy_url: str = Field("http://127.0.0.1:8000", description="Base URL of the proxy (BUCKETRL_PROXY_URL).")
    token: str = Field("", description="This worker's bearer token (BUCKETRL_TOKEN); empty = no auth header.")
    run: str = Field("demo", pattern=ID_PATTERN, description="Run id (BUCKETRL_RUN).")
    worker_id: str = Field("", description="Stable worker id; default: hostname-pid (BUCKETRL_WORKER_ID).")
    http_timeout_s: float = Field(30.0, gt=0, description="Per-request HTTP timeout (BUCKETRL_HTTP_TIMEOUT_S).")

    @field_validator("proxy_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("BUCKETRL_PROXY_URL must start with http:// or https://")
        return v.rstrip("/")

    def resolved_worker_id(self, role: str) -> str:
        if self.worker_id:
            return self.worker_id
        import os
        import socket

        host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:60]
        return f"{role}-{host}-{os.getpid()}"
