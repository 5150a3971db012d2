#!/usr/bin/env bash
# Installs everything DSec needs on a fresh Debian 12 machine (run as root):
# Debian packages, a virtualenv with pinned PyPI dependencies, and the native spawner.
# Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PACKAGES=(gcc libc6-dev libseccomp-dev pkg-config erofs-utils crun bubblewrap btrfs-progs musl-tools
              debootstrap busybox-static iproute2 nftables tar gzip util-linux python3-venv python3-dev
              postgresql podman runc docker-registry openssl fuse3 libfuse3-dev chromium fonts-dejavu-core
              libfaketime)
              # postgresql: the control-plane tests run on a throwaway cluster too;
              # podman + runc: `dsec bench cli`'s baseline (podman run --rm);
              # docker-registry (CNCF distribution 2.8) + openssl: the registry layer store, its
              # tests' registries and token server (dsec/images/registry_server.py), `dsec up --registry`
              # fuse3 + libfuse3-dev: pyfuse3 (the lazy layer FUSE process, dsec/images/lazy) builds against it
              # python3-dev: ...and against Python.h, which Debian's python3 lacks (deploy/Containerfile's build found it)
              # chromium + fonts-dejavu-core: the control plane's dashboard is tested in headless Chromium
              # (driven over the DevTools protocol, tests/integration/chromium.py; docs/DASHBOARD.md)
              # libfaketime: the cluster suite's clock-skew test runs an edge 2 s ahead / behind (tests/cluster)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# gVisor's runsc with the systrap platform: bookworm's own build (2022) has ptrace only, so
# take it from bookworm-backports (docs/GVISOR.md). The sources file is written once, from the
# mirror apt's own sources name (src/dsec/images/aptsources.py: the debootstrap builder's choice,
# standard library only): a machine behind its own mirror keeps using it.
BACKPORTS=/etc/apt/sources.list.d/bookworm-backports.sources
if grep -q '^VERSION_CODENAME=bookworm' /etc/os-release 2>/dev/null && [ ! -f "$BACKPORTS" ] &&
   ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  if stanza=$(python3 src/dsec/images/aptsources.py stanza bookworm-backports); then
    echo "setup: enabling bookworm-backports from $(python3 src/dsec/images/aptsources.py mirror bookworm-backports) (for gVisor's runsc)"
    printf '%s\n' "$stanza" > "$BACKPORTS"
    apt-get update -qq
  fi  # else aptsources.py said why on stderr; runsc and QEMU 10 are skipped below with a warning
fi
if ! dpkg-query -W -f='${Version}' runsc 2>/dev/null | grep -q 'bpo'; then
  echo "setup: installing runsc from bookworm-backports"
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "setup: warning: no bookworm-backports source; runsc (gVisor backend) not installed" >&2
  else
    apt-cache policy runsc | grep -q bpo || apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc >/dev/null
  fi
fi

# QEMU 10 for the microVM backend (docs/MICROVM.md): bookworm's 7.2 lacks what its templates
# need (a private mapping of a read-only RAM file, x-ignore-shared restores), so take it from
# bookworm-backports too.
if ! dpkg-query -W -f='${Version}' qemu-system-x86 2>/dev/null | grep -q 'bpo' ||
   ! dpkg-query -W -f='${Status}' qemu-utils 2>/dev/null | grep -q 'ok installed'; then
  echo "setup: installing QEMU (qemu-system-x86, qemu-utils) from bookworm-backports"
  if ! grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
    echo "setup: warning: no bookworm-backports source; QEMU (microvm backend) not installed" >&2
  else
    apt-cache policy qemu-system-x86 | grep -q bpo || apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends -t bookworm-backports \
      qemu-system-x86 qemu-utils >/dev/null
  fi
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dsec-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null
  # compat: the released clients that tests/compat runs against DSec (swe-rex, mini-swe-agent);
  # bench: matplotlib, for the benches' HTML reports (and their tests)
  .venv/bin/python -m pip install -q -e '.[server,dev,compat,bench]'
  touch "$stamp"
fi

# The native spawner: a small C helper (see docs/ARCHITECTURE-RUNTIME.md).
.venv/bin/python -m dsec.backends.container.build
# The gVisor backend's in-sandbox helper (static; see src/dsec/backends/gvisor/build.py).
.venv/bin/python -m dsec.backends.gvisor.build
# The microVM backend's guest agent (static; src/dsec/backends/microvm/build.py), and its guest
# image: Debian's cloud kernel from bookworm-backports (downloaded, not installed) and the
# initramfs, cached once under /var/lib/dsec/cache/microvm (src/dsec/backends/microvm/guest.py).
.venv/bin/python -m dsec.backends.microvm.build
.venv/bin/python -m dsec.backends.microvm.guest /var/lib/dsec/cache/microvm ||
  echo "setup: warning: no microVM guest image (the microvm backend needs it)" >&2
