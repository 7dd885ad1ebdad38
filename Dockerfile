# syntax=docker/dockerfile:1
# metadata-gate agent image.
#   docker build -t metadata-gate:dev .
#
# Builder: stable Rust for the agent, nightly + rust-src for the eBPF programs (built by
# gate-agent's build.rs for bpfel-unknown-none), bpf-linker 0.10.1, which links with the
# Rust toolchain's own LLVM (0.11+ would need a system LLVM 21-23); `cargo xtask setup`
# installs the same pair.
ARG RUST_VERSION=1.95
FROM docker.io/library/rust:${RUST_VERSION}-bookworm AS builder
RUN rustup toolchain install nightly --profile minimal --component rust-src \
 && cargo install bpf-linker@0.10.1 --locked \
 && rm -rf /usr/local/cargo/registry
WORKDIR /src
COPY . .
# Never the whole workspace: the eBPF crate only builds for its own target, from build.rs.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gate-agent \
 && cp target/release/gate-agent /gate-agent

# Runtime: glibc and libgcc only, no shell. The agent runs as root with a handful of
# capabilities (deploy/base/daemonset.yaml), so the image keeps the default root user.
FROM gcr.io/distroless/cc-debian12
COPY --from=builder /gate-agent /gate-agent
ENTRYPOINT ["/gate-agent"]
