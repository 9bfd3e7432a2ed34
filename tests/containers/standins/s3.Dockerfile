# Stand-in for MinIO (no registry here): moto's S3 server, made durable by s3_server.py (it replays the
# writes recorded in /data at start), so `compose down` then `up` finds the bucket as it was left.
ARG PYTHON_IMAGE=localhost/bucketrl-python-standin:3.11-bookworm
FROM ${PYTHON_IMAGE}
ARG MOTO_VERSION=5.2.5
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --no-cache-dir "moto[server]==${MOTO_VERSION}" \
 && mkdir -p /data && chown 10002:10002 /data
COPY s3_server.py /opt/s3_server.py
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
USER 10002:10002
WORKDIR /data
EXPOSE 9000
CMD ["python", "/opt/s3_server.py", "--port", "9000", "--data", "/data"]
