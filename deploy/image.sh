#!/usr/bin/env bash
# Run by deploy/Containerfile, in the image being built (Debian 12, as root):
#   bash deploy/image.sh packages   Debian packages: scripts/setup.sh's APT_PACKAGES (read from
#                                   it, so the two lists cannot drift apart) less what only its
#                                   tests and benchmarks use, plus what only the image needs;
#                                   gVisor's runsc from bookworm-backports, as setup.sh does
#   bash deploy/image.sh python     the virtualenv with the pinned server dependencies (no test
#                                   tools) and the native helpers, built from the sources here
# A script rather than RUN lines: podman's default (OCI) image format ignores SHELL, and
# this needs bash.
set -euo pipefail
cd "$(dirname "$0")/.."

# Only the test suite and the benchmarks use these (setup.sh says why each is there).
TEST_ONLY_PACKAGES=(postgresql podman runc chromium fonts-dejavu-core)
# Only the image: modprobe (an edge that loads zram itself, with the host's /lib/modules
# mounted), CA certificates (https registries).
IMAGE_PACKAGES=(kmod ca-certificates)

packages() {
  eval "$(sed -n '/^APT_PACKAGES=(/,/^[^#]*)/p' scripts/setup.sh)"
  local keep=() p
  for p in "${APT_PACKAGES[@]}"; do
    [[ " ${TEST_ONLY_PACKAGES[*]} " == *" $p "* ]] || keep+=("$p")
  done
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${keep[@]}" "${IMAGE_PACKAGES[@]}"
  # from the mirror the image's own apt sources name (src/dsec/images/aptsources.py, standard
  # library only; python3 came with python3-venv above): a build behind a mirror keeps using it
  python3 src/dsec/images/aptsources.py stanza bookworm-backports > /etc/apt/sources.list.d/bookworm-backports.sources
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends -t bookworm-backports runsc
  rm -rf /var/lib/apt/lists/*
  # the control plane and the registry run as this uid (their manifests say so)
  groupadd --system --gid 10001 dsec
  useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent dsec
}

python() {
  # never binaries or caches from the build context: built here, from these sources
  find src -name __pycache__ -prune -exec rm -rf {} +
  rm -f src/dsec/backends/container/native/dsec-spawner src/dsec/backends/container/native/dsec-init \
        src/dsec/backends/gvisor/native/dsec-gvexec
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[server]'
  .venv/bin/python -m dsec.backends.container.build
  .venv/bin/python -m dsec.backends.gvisor.build
  .venv/bin/python -m compileall -q src/dsec
}

case "${1:-}" in
  packages) packages ;;
  python) python ;;
  *) echo "usage: bash deploy/image.sh packages|python" >&2; exit 2 ;;
esac
