#!/bin/bash
# A Debian bookworm base image with Python 3.11 (the wheel's cp311) for the container image, built without a
# registry: debootstrap a minbase root file system with python3 and python3-venv, leave out what the slim images
# leave out too (apt's caches and package lists, manuals, documentation but the copyright files) and
# `docker import` it. `make image-base` and tests/test_container_image.py both build their base with this.
#
#   scripts/image-base.sh [NAME]     # NAME default txmq-base; then: make image BASE=NAME
#
# Needs root, debootstrap (apt-get install debootstrap) and a Docker daemon; fetches Debian's packages from
# TXMQ_DEBIAN_MIRROR (default http://deb.debian.org/debian). Every failure is one line on stderr, exit 1.
set -euo pipefail

name=${1:-txmq-base}
mirror=${TXMQ_DEBIAN_MIRROR:-http://deb.debian.org/debian}
me="image-base"

fail() { echo "$me: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || fail "debootstrap needs root: run it as root (sudo make image-base)"
command -v debootstrap >/dev/null 2>&1 || fail "debootstrap is not installed: apt-get install debootstrap"
command -v docker >/dev/null 2>&1 || fail "no docker CLI on PATH"
docker info >/dev/null 2>&1 || fail "no Docker daemon answers \`docker info\`: start it (systemctl start docker, or dockerd &)"

work=$(mktemp -d "${TMPDIR:-/tmp}/txmq-rootfs-XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
root=$work/bookworm
start=$(date +%s)

if ! debootstrap --variant=minbase --include=python3,python3-venv bookworm "$root" "$mirror" >"$work/debootstrap.log" 2>&1; then
    fail "debootstrap from $mirror failed (offline? set TXMQ_DEBIAN_MIRROR to a reachable Debian mirror): $(tail -n 1 "$work/debootstrap.log")"
fi
for sub in var/cache/apt var/lib/apt/lists usr/share/man usr/share/info usr/share/doc; do
    if [ -d "$root/$sub" ]; then
        find "$root/$sub" \( -type f -o -type l \) ! -name lock ! -name copyright -delete
    fi
done
tar -C "$root" -c . | docker import - "$name" >/dev/null
size=$(docker image inspect --format '{{.Size}}' "$name")
echo "built the base image $name: $(( (size + 500000) / 1000000 )) MB, Python $(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])'), in $(( $(date +%s) - start )) s; now: make image BASE=$name"
