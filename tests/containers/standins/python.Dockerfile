# Stand-in for python:3.11-slim-bookworm, which cannot be pulled here (no registry): the locally bootstrapped
# Debian bookworm base plus bookworm's own Python 3.11, at the path the official image has it.
ARG BASE_IMAGE=localhost/bucketrl-debian-min:bookworm
FROM ${BASE_IMAGE}
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv python3-pip ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s /usr/bin/python3 /usr/local/bin/python
CMD ["python"]
