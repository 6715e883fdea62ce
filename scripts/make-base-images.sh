#!/usr/bin/env bash
# Makes the three base images docker/Dockerfile and compose.yaml's `redis` build on, from
# Debian's packages, for an engine that reaches no image registry:
#
#   flashmoe-base/python:bookworm   Debian bookworm (minbase) with python3, python3-venv and
#                                   ca-certificates: debootstrap, then `docker import`
#   flashmoe-base/node:bookworm     the same with nodejs and npm (the vendor stage's npm)
#   flashmoe-base/redis:bookworm    the same with redis-server and redis-cli, run as `redis`
#                                   in /data (what compose.yaml's redis service expects)
#
# An image already there is kept. Then build with
#   --build-arg PYTHON_IMAGE=flashmoe-base/python:bookworm
#   --build-arg NODE_IMAGE=flashmoe-base/node:bookworm
# and give compose FLASHMOE_REDIS_IMAGE=flashmoe-base/redis:bookworm.
#
# Needs root (debootstrap), debootstrap, a Debian mirror (DEBIAN_MIRROR, default
# http://deb.debian.org/debian) and the docker CLI reaching the engine (DOCKER_HOST). The
# package installs of the second and third image run with --network host (an engine without a
# bridge network has no other way out). About 4 minutes for the debootstrap, 1-2 for the rest.
#
# Usage: scripts/make-base-images.sh [WORKDIR]   (WORKDIR: where the root filesystem is made;
#        default a temporary folder, removed at the end)
set -euo pipefail
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PREFIX=${FLASHMOE_BASE_PREFIX:-flashmoe-base}
PY=$PREFIX/python:$SUITE
NODE=$PREFIX/node:$SUITE
REDIS=$PREFIX/redis:$SUITE
export DOCKER_BUILDKIT=0

have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have "$PY"; then
    if [ "$(id -u)" != 0 ]; then
        echo "make-base-images: debootstrap needs root" >&2
        exit 1
    fi
    command -v debootstrap >/dev/null || { echo "make-base-images: no debootstrap" >&2; exit 1; }
    work=${1:-}
    own=0
    if [ -z "$work" ]; then
        work=$(mktemp -d)
        own=1
    fi
    mkdir -p "$work"
    trap '[ "$own" = 1 ] && rm -rf "$work"' EXIT
    rootfs=$work/rootfs
    rm -rf "$rootfs"
    echo "make-base-images: debootstrap $SUITE from $MIRROR (a few minutes)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        "$SUITE" "$rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
        || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
    # The image needs no package lists, apt caches or documentation.
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
        "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/usr/share/doc/* \
        "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
    # No daemon starts while packages are installed in a build.
    printf '#!/bin/sh\nexit 101\n' >"$rootfs/usr/sbin/policy-rc.d"
    chmod 0755 "$rootfs/usr/sbin/policy-rc.d"
    tar -C "$rootfs" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' - "$PY" >/dev/null
    echo "make-base-images: $PY made"
fi

build_from_base() {  # build_from_base TAG DOCKERFILE-BODY
    local tag=$1 body=$2
    have "$tag" && return 0
    printf 'FROM %s\n%s\n' "$PY" "$body" \
        | docker build --network host -q -t "$tag" - >/dev/null
    echo "make-base-images: $tag made"
}

build_from_base "$NODE" 'RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends nodejs npm \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/*'

build_from_base "$REDIS" 'RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* /usr/share/doc/* /usr/share/man/* \
    && install -d -o redis -g redis -m 0750 /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]'
