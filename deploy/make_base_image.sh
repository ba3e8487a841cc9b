#!/usr/bin/env bash
# Makes a local stand-in for the Dockerfile's usual base (python:3.11-slim) from Debian's own
# packages, for machines where no registry image can be pulled but Debian's archive and PyPI can
# be reached: Debian bookworm (minbase) with Python 3.11 in a virtual environment on PATH, the
# host's CA bundle (pip reaches the package index through it), and the CPU build of torch 2.13.0
# already installed, so the Dockerfile's torch step finds it satisfied and pulls no CUDA build.
#
# Usage (as root): deploy/make_base_image.sh [IMAGE]   (default IMAGE: cgad-node-base:bookworm)
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian), TORCH_WHEEL (a torch 2.13.0
# wheel file to install; default: what the host's pip resolves for torch==2.13.0, as `make setup`
# does, which is the CPU build where the host's pip is set up to find it).
set -euo pipefail

IMAGE=${1:-cgad-node-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt

[ "$(id -u)" = 0 ] || { echo "make_base_image.sh: debootstrap and chroot need root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "make_base_image.sh: apt-get install debootstrap" >&2; exit 1; }
[ -r "$CA_BUNDLE" ] || { echo "make_base_image.sh: no CA bundle at $CA_BUNDLE" >&2; exit 1; }

work=$(mktemp -d /tmp/cgad-base.XXXXXX)
root=$work/rootfs
cleanup() {
    # the chroot's /proc first: removing the tree with it mounted would reach the host's
    umount "$root/proc" 2>/dev/null || true
    rm -rf --one-file-system "$work"
}
trap cleanup EXIT

wheel=${TORCH_WHEEL:-}
if [ -z "$wheel" ]; then
    mkdir -p "$work/wheels"
    python3 -m pip download --quiet --no-deps --only-binary=:all: -d "$work/wheels" torch==2.13.0
    wheel=$(ls "$work"/wheels/torch-*.whl)
fi
case "$(basename "$wheel")" in
    *+cpu*) ;;
    *) echo "make_base_image.sh: $(basename "$wheel") is not a CPU build: the image will be large" >&2 ;;
esac

echo "debootstrap bookworm (minbase) from $MIRROR ..."
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" \
    >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }

# the host's CA bundle replaces Debian's (it may hold a CA that Debian's lacks), and pip uses it
cp "$CA_BUNDLE" "$root$CA_BUNDLE"
printf '[global]\ncert = %s\n' "$CA_BUNDLE" >"$root/etc/pip.conf"
cp /etc/resolv.conf "$root/etc/resolv.conf"
cp "$wheel" "$root/tmp/"

# a clean environment inside: the host's PIP_* variables (find-links, indexes) name its own paths
inside() { env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 chroot "$root" "$@"; }
mount -t proc proc "$root/proc"
inside /usr/bin/python3 -m venv /opt/venv
inside /opt/venv/bin/pip install --quiet --no-cache-dir --upgrade pip
inside /opt/venv/bin/pip install --quiet --no-cache-dir "/tmp/$(basename "$wheel")"
umount "$root/proc"

# what a base image does not need: package caches, the wheel, the build host's resolver
rm -rf "$root"/tmp/* "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root/etc/resolv.conf"

echo "importing $IMAGE ..."
tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$IMAGE" >/dev/null
docker image ls "$IMAGE"
