#!/bin/bash
# metadata-gate boot step, run by metadata-gate-boot.service before the kubelet on every boot.
# It closes the gate (cgroup hooks, node-level and LSM programs, pinned) with, in order:
#   the policy and allow set the agent kept in $METADATA_GATE_STATE_DIR (reboots);
#   else the installed policy $METADATA_GATE_POLICY if that file exists;
#   else the policy shipped for $METADATA_GATE_PLATFORM ("auto": ignition.platform.id, else DMI).
# It runs the agent's binary kept in the state dir; where there is none (a node's first
# boot) or it fails, the agent's image $METADATA_GATE_IMAGE with podman, as OpenShift's own
# node units run theirs. Settings: /etc/metadata-gate/boot.env (see deploy/README.md).
# It exits non-zero when the gate is not closed, which holds the kubelet, unless
# METADATA_GATE_BOOT_FAIL_OPEN=true (the operator's explicit opt-out).
set -u
state=${METADATA_GATE_STATE_DIR:-/var/lib/metadata-gate}
pin=${METADATA_GATE_PIN_DIR:-/sys/fs/bpf/metadata-gate}
root=${METADATA_GATE_CGROUP_ROOT:-/sys/fs/cgroup/kubepods.slice}
policy=${METADATA_GATE_POLICY:-/etc/metadata-gate/policy.yaml}
image=${METADATA_GATE_IMAGE:-}
podman=${METADATA_GATE_PODMAN:-/usr/bin/podman}

args=(boot --state-dir "$state" --pin-dir "$pin" --cgroup-root "$root")
if [ -f "$policy" ]; then
    args+=(--policy "$policy")
else
    args+=(--platform "${METADATA_GATE_PLATFORM:-auto}")
fi
# More flags as the DaemonSet's run has them (--gate-scope, --tc-trusted-interface …).
read -r -a extra <<<"${METADATA_GATE_BOOT_ARGS:-}"
args+=("${extra[@]}")

rc=127
if [ -x "$state/bin/gate-agent" ]; then
    "$state/bin/gate-agent" "${args[@]}"
    rc=$?
fi
if [ "$rc" -ne 0 ] && [ -n "$image" ]; then
    [ "$rc" -ne 127 ] && echo "metadata-gate: the kept binary failed ($rc); trying $image" >&2
    mkdir -p "$state"
    mounts=(-v /sys/fs/bpf:/sys/fs/bpf -v /sys/fs/cgroup:/sys/fs/cgroup -v "$state:$state")
    [ -f "$policy" ] && mounts+=(-v "$policy:$policy:ro")
    auth=()
    [ -f /var/lib/kubelet/config.json ] && auth=(--authfile /var/lib/kubelet/config.json)
    "$podman" run --rm --privileged --net=host --pid=host --cgroupns=host "${auth[@]}" \
        "${mounts[@]}" "$image" "${args[@]}"
    rc=$?
fi
if [ "$rc" -eq 0 ]; then
    exit 0
fi
if [ "$rc" -eq 127 ]; then
    why="no agent to run: neither $state/bin/gate-agent nor METADATA_GATE_IMAGE"
    echo "metadata-gate: $why" >&2
    # The agent reads this record (status, metadata_gate_boot_step_failed).
    mkdir -p "$state" && printf '{"boot_id":"%s","closed":false,"policy":null,"allowed":0,"problems":["%s"],"at":%s}\n' \
        "$(cat /proc/sys/kernel/random/boot_id)" "$why" "$(date +%s)" >"$state/boot.json"
fi
echo "metadata-gate: the gate is NOT closed on this boot (exit $rc)" >&2
if [ "${METADATA_GATE_BOOT_FAIL_OPEN:-false}" = true ]; then
    echo "metadata-gate: METADATA_GATE_BOOT_FAIL_OPEN=true: the kubelet starts anyway, open until the agent runs" >&2
    exit 0
fi
exit "$rc"
