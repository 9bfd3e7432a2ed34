# Stand-in for the redis image compose names (no registry here): Debian bookworm's redis-server and redis-cli,
# laid out like the official image (data in /data, run as the redis user).
ARG BASE_IMAGE=localhost/bucketrl-debian-min:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
