# syntax=docker/dockerfile:1
# The relay as a container image.
#
#   docker build -t outbox-relay .
#   docker run --rm -v "$PWD/relay.toml:/etc/outbox-relay/relay.toml:ro" outbox-relay
#   docker run --rm -v "$PWD/relay.toml:/etc/outbox-relay/relay.toml:ro" outbox-relay migrate --config /etc/outbox-relay/relay.toml
#
# The image ships no configuration: mount one at /etc/outbox-relay/relay.toml (or give
# another path: `... outbox-relay run --config FILE`); any key can be overridden with an
# environment variable OUTBOX_RELAY__SECTION__KEY.
# On SIGTERM the relay waits up to relay.shutdown_timeout (30 s by default) for broker
# confirmations and exits at the latest 20 s later: give `docker stop` longer than
# both (`--time 55`, or stop_grace_period).

FROM rust:1.95-bookworm AS build
WORKDIR /src
# The whole context (.dockerignore leaves out target/ and .git): Cargo reads every
# target the manifest declares, benches and examples included, even to build one binary.
COPY . .
# librdkafka is compiled from source by rdkafka-sys; the rust image already has its
# toolchain (gcc, make, pkg-config, libssl-dev, zlib1g-dev). The caches keep the
# registry and the compiled dependencies between builds.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin outbox-relay \
    && cp target/release/outbox-relay /usr/local/bin/outbox-relay

FROM debian:bookworm-slim
# Unpinned on purpose: pins to exact Debian versions break as soon as a security
# update replaces them; bookworm's stable updates are what the image should get.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libssl3 ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 outbox-relay \
    && useradd --system --uid 10001 --gid outbox-relay --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin outbox-relay \
    && mkdir -p /etc/outbox-relay
COPY --from=build /usr/local/bin/outbox-relay /usr/local/bin/outbox-relay
# Numeric, so that platforms enforcing non-root users can verify it without /etc/passwd.
USER 10001:10001
STOPSIGNAL SIGTERM
ENTRYPOINT ["outbox-relay"]
CMD ["run", "--config", "/etc/outbox-relay/relay.toml"]
