# syntax=docker/dockerfile:1
# metadata-gate agent image.
#   docker build -t metadata-gate:dev .
#
# Builder: stable Rust for the agent, nightly + rust-src for the eBPF programs (built by
# gate-agent's build.rs for bpfel-unknown-none), bpf-linker 0.10.1, which links with the
# Rust toolchain's own LLVM (0.11+ would need a system LLVM 21-23); `cargo xtask setup`
# installs the same pair.
ARG RUST_VERSION=1.95
# The must-gather target's base (below).
ARG MUST_GATHER_BASE=quay.io/openshift/origin-must-gather:4.18
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
 && cp target/release/gate-agent /gate-agent \
 && /gate-agent --version | awk '{print $2}' >/gate-agent.version

# The must-gather image (`docker build --target must-gather -t metadata-gate-must-gather:TAG .`):
# the agent image has no shell and no client, so support's collection runs from an image
# that has both. `oc adm must-gather --image=…` runs /usr/bin/gather and copies /must-gather
# back (openshift/enhancements, enhancements/oc/must-gather.md); the base is OpenShift's own
# must-gather image, which has bash, oc and rsync. deploy/README.md, must-gather.
FROM ${MUST_GATHER_BASE} AS must-gather
COPY --from=builder /gate-agent.version /usr/share/metadata-gate/version
COPY deploy/must-gather/gather /usr/bin/gather
RUN chmod 0755 /usr/bin/gather
ENTRYPOINT ["/usr/bin/gather"]

# Runtime (the default target: the last stage): glibc and libgcc only, no shell. The agent
# runs as root with a handful of capabilities (deploy/base/daemonset.yaml), so the image keeps the default root user.
FROM gcr.io/distroless/cc-debian12
COPY --from=builder /gate-agent /gate-agent
ENTRYPOINT ["/gate-agent"]
