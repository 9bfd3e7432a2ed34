"""``s3://bucket/prefix``: AWS S3 or any S3-compatible store (MinIO, Ceph RGW, Cloudflare R2, moto).

Configuration, all standard:
    BUCKETRL_S3_ENDPOINT_URL   endpoint of an S3-compatible store (or pass ``endpoint_url``); unset = AWS.
                               boto3 also honours AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL on its own. It may carry
                               a path: a Hugging Face Storage Bucket's is ``https://s3.hf.co/<namespace>``.
    BUCKETRL_S3_ADDRESSING_STYLE  ``path`` (``http://host/bucket/key``), ``virtual`` (``http://bucket.host/key``)
                               or ``auto`` (the default: path with an endpoint, botocore's own choice on AWS).
    BUCKETRL_S3_REGION         the region requests are signed for; unset = boto3's chain (AWS_REGION, ...).
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_PROFILE, AWS_DEFAULT_REGION / AWS_REGION
                               credentials and region, read by boto3's usual chain (env, config files, IAM role).

A Hugging Face Storage Bucket through its S3-compatible gateway, as its docs give the settings:
``BUCKETRL_BUCKET_URL=s3://<bucket>/<prefix>``, ``BUCKETRL_S3_ENDPOINT_URL=https://s3.hf.co/<namespace>``,
``BUCKETRL_S3_ADDRESSING_STYLE=path``, ``BUCKETRL_S3_REGION=us-east-1`` and the ``HFAK...`` key pair in
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``.

Atomicity comes from S3 itself: an object written by one PUT, or by a multipart upload, is invisible
until the PUT returns / the upload is completed. Objects up to ``multipart_threshold`` go up in a single
PUT; bigger ones use boto3's managed multipart upload (parts in parallel, aborted on failure), streaming
from the file object so a large checkpoint is never held whole in memory.

With a custom endpoint the client uses path-style addressing unless told otherwise (``http://host/bucket/key``:
MinIO, moto and Hugging Face's gateway need it; a store that serves only virtual-hosted names, such as CoreWeave's,
takes ``virtual``) and only sends the checksums a request requires (several S3-compatible stores, Hugging Face's
gateway among them, reject the newer default CRC headers).

botocore errors are translated here and nowhere else: a missing key -> :class:`errors.NotFound`; an
unreachable endpoint, missing bucket, bad credentials, throttling or a 5xx -> :class:`errors.Unavailable`
with a message naming the setting to check.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from typing import IO, Any

import boto3
import boto3.exceptions
import boto3.s3.transfer
import botocore.config
import botocore.exceptions

from bucketrl import errors
from bucketrl.storage.paths import normalize_prefix, validate_key

DEFAULT_MULTIPART_THRESHOLD = 16 * 1024 * 1024
DEFAULT_MULTIPART_CHUNKSIZE = 16 * 1024 * 1024  # S3's minimum part size is 5 MiB; s3transfer raises smaller ones
DELETE_BATCH = 1000  # the DeleteObjects limit
ADDRESSING_STYLES = ("auto", "path", "virtual")
_NOT_FOUND_CODES = {"NoSuchKey", "404", "NotFound"}
_CREDENTIAL_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "403"}


class S3Store:
    """A bucket (or a prefix inside one) on an S3-compatible object store."""

    delete_batch: int = DELETE_BATCH
    list_page_size: int = 1000

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        addressing_style: str | None = None,
        region: str | None = None,
        multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD,
        multipart_chunksize: int = DEFAULT_MULTIPART_CHUNKSIZE,
        max_concurrency: int = 4,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_attempts: int = 3,
    ) -> None:
        self.bucket = bucket
        self.prefix = normalize_prefix(prefix)  # "" or "some/prefix/"
        self.endpoint_url = endpoint_url or os.environ.get("BUCKETRL_S3_ENDPOINT_URL") or None
        self.addressing_style = addressing_style or os.environ.get("BUCKETRL_S3_ADDRESSING_STYLE") or "auto"
        self.region = region or os.environ.get("BUCKETRL_S3_REGION") or None
        self._check_options()
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.multipart_threshold = multipart_threshold
        self.transfer_config = boto3.s3.transfer.TransferConfig(
            multipart_threshold=multipart_threshold,
            multipart_chunksize=multipart_chunksize,
            max_concurrency=max_concurrency,
        )
        self._client = self._make_client(connect_timeout_s, read_timeout_s, attempts=max_attempts)
        # The readiness probe must answer fast when the endpoint is down: one attempt, short timeouts.
        self._probe_client = self._make_client(2.0, 5.0, attempts=1)

    def _check_options(self) -> None:
        """Refused at once, naming the setting: nothing would reach the store otherwise."""
        if self.endpoint_url and not self.endpoint_url.startswith(("http://", "https://")):
            raise errors.Invalid(
                f"BUCKETRL_S3_ENDPOINT_URL must start with http:// or https://, got {self.endpoint_url!r}"
            )
        if self.addressing_style not in ADDRESSING_STYLES:
            raise errors.Invalid(
                f"BUCKETRL_S3_ADDRESSING_STYLE must be one of {', '.join(ADDRESSING_STYLES)}, "
                f"got {self.addressing_style!r}"
            )

    def _make_client(self, connect_timeout_s: float, read_timeout_s: float, attempts: int) -> Any:
        options: dict[str, Any] = {
            "connect_timeout": connect_timeout_s,
            "read_timeout": read_timeout_s,
            "retries": {"max_attempts": attempts, "mode": "standard"},
            "max_pool_connections": 32,  # the proxy calls the store from a thread pool
        }
        style = self.addressing_style
        if style == "auto" and self.endpoint_url:
            style = "path"
        if style != "auto":
            options["s3"] = {"addressing_style": style}
        if self.endpoint_url:
            options["request_checksum_calculation"] = "when_required"
            options["response_checksum_validation"] = "when_required"
        # A session per store: boto3's default session is shared global state and not thread-safe to create.
        session = boto3.session.Session()
        config = botocore.config.Config(**options)
        return session.client("s3", endpoint_url=self.endpoint_url, region_name=self.region, config=config)

    def _full(self, key: str) -> str:
        return self.prefix + validate_key(key)

    @contextlib.contextmanager
    def _translate(self, what: str, key: str | None = None) -> Iterator[None]:
        """The one place botocore errors become bucketrl errors."""
        where = f"{self.url} at {self.endpoint_url or 'AWS'}"
        try:
            yield
        except botocore.exceptions.ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _NOT_FOUND_CODES and key is not None:
                raise errors.NotFound(f"no object {key!r} in {self.url}") from exc
            if code == "NoSuchBucket":
                raise errors.Unavailable(
                    f"bucket {self.bucket!r} does not exist ({where}); check BUCKETRL_BUCKET_URL"
                ) from exc
            if code in _CREDENTIAL_CODES:
                raise errors.Unavailable(
                    f"access to {where} denied ({code}) while trying to {what}; check AWS_ACCESS_KEY_ID, "
                    "AWS_SECRET_ACCESS_KEY and the bucket policy"
                ) from exc
            raise errors.Unavailable(f"S3 error {code or '?'} while trying to {what} on {where}: {exc}") from exc
        except (botocore.exceptions.BotoCoreError, boto3.exceptions.Boto3Error) as exc:
            raise errors.Unavailable(
                f"cannot {what} on {where}: {exc}; check BUCKETRL_S3_ENDPOINT_URL, BUCKETRL_S3_ADDRESSING_STYLE "
                "and the AWS_* credentials"
            ) from exc

    # -- writes --------------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes) -> None:
        full = self._full(key)
        with self._translate(f"write {key!r}", key):
            self._client.put_object(Bucket=self.bucket, Key=full, Body=data)

    def put_file(self, key: str, fileobj: IO[bytes], size: int | None = None) -> None:
        if size is not None and size < self.multipart_threshold:
            # Small: one PUT. Reading it is bounded by the threshold, and avoids botocore seeking the caller's stream.
            self.put_bytes(key, fileobj.read())
            return
        full = self._full(key)
        with self._translate(f"upload {key!r}", key):
            # Managed transfer: single PUT below the threshold, else parallel parts; aborts the upload on failure.
            self._client.upload_fileobj(fileobj, self.bucket, full, Config=self.transfer_config)

    # -- reads ---------------------------------------------------------------------------------
    def get_bytes(self, key: str) -> bytes:
        full = self._full(key)
        with self._translate(f"read {key!r}", key):
            return self._client.get_object(Bucket=self.bucket, Key=full)["Body"].read()

    def iter_chunks(self, key: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        full = self._full(key)
        with self._translate(f"read {key!r}", key):
            body = self._client.get_object(Bucket=self.bucket, Key=full)["Body"]
        return self._chunks(body, key, chunk_size)  # the GET happened above: NotFound is raised by this call

    def _chunks(self, body: Any, key: str, chunk_size: int) -> Iterator[bytes]:
        try:
            with self._translate(f"read {key!r}", key):
                yield from body.iter_chunks(chunk_size)
        finally:
            body.close()

    def presign_get(self, key: str, expires_s: int) -> str:
        """A URL that reads ``key`` without credentials for ``expires_s`` (signed here, no request made)."""
        params = {"Bucket": self.bucket, "Key": self._full(key)}
        with self._translate(f"presign {key!r}", key):
            return str(self._client.generate_presigned_url("get_object", Params=params, ExpiresIn=expires_s))

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            with self._translate(f"look up {key!r}", key):
                self._client.head_object(Bucket=self.bucket, Key=full)
        except errors.NotFound:
            return False
        return True

    def list_keys(self, prefix: str) -> list[str]:
        full_prefix = self.prefix + normalize_prefix(prefix)
        keys: list[str] = []
        with self._translate(f"list {prefix!r}"):
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(
                Bucket=self.bucket, Prefix=full_prefix, PaginationConfig={"PageSize": self.list_page_size}
            ):
                for obj in page.get("Contents", ()):
                    name: str = obj["Key"]
                    if not name.endswith("/"):  # "folder" markers some consoles create are not objects
                        keys.append(name[len(self.prefix) :])
        return sorted(keys)

    # -- deletes -------------------------------------------------------------------------------
    def delete(self, keys: Iterable[str]) -> None:
        fulls = [self._full(k) for k in keys]
        for start in range(0, len(fulls), self.delete_batch):
            batch = fulls[start : start + self.delete_batch]
            with self._translate(f"delete {len(batch)} objects"):
                resp = self._client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True}
                )
            failed = [e for e in resp.get("Errors", ()) if e.get("Code") not in _NOT_FOUND_CODES]
            if failed:
                first = failed[0]
                raise errors.Unavailable(
                    f"could not delete {len(failed)} objects from {self.url}, e.g. {first.get('Key')!r}: "
                    f"{first.get('Code')} {first.get('Message', '')}"
                )

    def delete_prefix(self, prefix: str) -> int:
        keys = self.list_keys(prefix)
        self.delete(keys)
        return len(keys)

    # -- readiness -----------------------------------------------------------------------------
    def check(self) -> None:
        probe = self.prefix + ".bucketrl-check"
        with self._translate("write a probe object"):
            self._probe_client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok")
            self._probe_client.delete_object(Bucket=self.bucket, Key=probe)
