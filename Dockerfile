# txmq's broker as a container image (docs/container.md). Build it with `make image`, which first builds
# txmq's wheel and a wheelhouse of its dependencies (with the rocketmq extra) on the host: nothing in the
# image build reaches a package index, so the image builds wherever the base image is at hand.
#
#   make image                                  # BASE=debian:bookworm-slim IMAGE=txmq:latest
#   docker run -p 10911:10911 -p 8081:8081 -v txmq-data:/var/lib/txmq txmq
#
# The base must have (or be able to apt-get install) a Python of the wheel's minor version (cp311: Debian
# bookworm's python3, or python:3.11-slim). `make image` checks it is here or can be pulled before building
# anything; without a registry, `make image-base` builds one with debootstrap: make image BASE=txmq-base.
ARG BASE=debian:bookworm-slim

FROM ${BASE} AS runtime
# Debian's python3 + python3-venv where the base lacks them (a debian:bookworm-slim base; this needs its mirror).
RUN if ! python3 -c 'import venv, ensurepip' 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi

FROM runtime AS install
COPY dist/wheelhouse /wheelhouse
RUN python3 -m venv /opt/txmq \
    && /opt/txmq/bin/pip install --no-index --find-links /wheelhouse --no-cache-dir --disable-pip-version-check 'txmq[rocketmq]' \
    && /opt/txmq/bin/pip uninstall -y -q pip setuptools \
    && /opt/txmq/bin/txmq --version

FROM runtime
COPY --from=install /opt/txmq /opt/txmq
# A fixed uid outside the system range (a bind-mounted data directory is chowned to it), so an ordinary account:
# useradd --system warns about a uid above SYS_UID_MAX.
RUN useradd --uid 10001 --user-group --no-log-init --home-dir /var/lib/txmq --no-create-home --shell /usr/sbin/nologin txmq \
    && mkdir -p /var/lib/txmq && chown txmq:txmq /var/lib/txmq
ENV PATH=/opt/txmq/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TXMQ_DATA_DIR=/var/lib/txmq \
    TXMQ_BROKER=127.0.0.1:10911
USER txmq
VOLUME ["/var/lib/txmq"]
# 10911: txmq's native protocol; 8081: RocketMQ 5's gRPC service.
EXPOSE 10911 8081
# The broker answers `txmq broker status` once it serves (TXMQ_BROKER: where it listens, set it with --port;
# TXMQ_AUTH_TOKEN, if set, is the broker's token and the check's).
HEALTHCHECK --interval=3s --timeout=5s --start-period=10s --retries=3 \
    CMD ["txmq", "broker", "status", "-o", "json"]
# Exec form: PID 1 is txmq itself, whose SIGTERM handler (`docker stop`) shuts the broker down cleanly.
# Arguments given to `docker run IMAGE ...` replace CMD and are appended to these (the last --host,
# --port or --rocketmq-port given wins).
ENTRYPOINT ["txmq", "broker", "start", "--data-dir", "/var/lib/txmq", "--rocketmq-port", "8081"]
CMD ["--host", "0.0.0.0"]
