#!/usr/bin/env bash
# Build an image of the kit with no container registry: how CI builds the CPU
# image here, how the long tier builds the GPU one, and how air-gapped users
# build either.
#   1. base image  ray-app-base:bookworm  from Debian packages (debootstrap), once;
#                                         the same base for both targets
#   2. wheelhouse  build/wheelhouse (cpu), build/wheelhouse-gpu (gpu: torch's CUDA
#                  build and its nvidia-* wheels, about 3.5 GB): every pinned wheel,
#                  downloaded once per lock
#   3. image       docker build --target TARGET, installing only from the wheelhouse
# Each step is skipped when its result is already there, so a second run only
# re-runs `docker build` (whose layer cache does the rest). The last line says
# the image's size and the seconds each step took.
#
# Environment (all optional):
#   TARGET       cpu or gpu                       (default cpu)
#   IMAGE        tag to build                     (default ray-app:0.1.0, gpu: ray-app:0.1.0-gpu, as the Makefile)
#   BASE_IMAGE   local base image tag             (default ray-app-base:bookworm)
#   WHEELHOUSE   wheel folder; must be build/wheelhouse or build/wheelhouse-* (the
#                only build/ folders .dockerignore lets into the build context)
#                (default build/wheelhouse, gpu: build/wheelhouse-gpu)
#   PYTHON       Python 3.11 with pip, for `pip download` (default .venv/bin/python, else python3)
#   DEBIAN_MIRROR  mirror for debootstrap         (default: debootstrap's own)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
TARGET=${TARGET:-cpu}
case "$TARGET" in
  cpu) IMAGE=${IMAGE:-ray-app:0.1.0}; WHEELHOUSE=${WHEELHOUSE:-build/wheelhouse} ;;
  gpu) IMAGE=${IMAGE:-ray-app:0.1.0-gpu}; WHEELHOUSE=${WHEELHOUSE:-build/wheelhouse-gpu} ;;
  *) printf '[build-offline] TARGET=%s: use cpu or gpu\n' "$TARGET" >&2; exit 2 ;;
esac
BASE_IMAGE=${BASE_IMAGE:-ray-app-base:bookworm}
REQUIREMENTS=docker/requirements-$TARGET.txt
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

log() { printf '[build-offline] %s\n' "$*" >&2; }

case "$WHEELHOUSE" in
  build/wheelhouse | build/wheelhouse-*) ;;
  *) log "WHEELHOUSE=$WHEELHOUSE: use build/wheelhouse or build/wheelhouse-NAME (the build context only has those)"; exit 2 ;;
esac

build_base_image() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    log "base image $BASE_IMAGE exists: skipped"
    return
  fi
  command -v debootstrap >/dev/null || { log "debootstrap missing: apt-get install -y debootstrap"; exit 2; }
  local rootfs
  rootfs=$(mktemp -d "${TMPDIR:-/tmp}/ray-app-rootfs.XXXXXX")
  log "debootstrap bookworm into $rootfs (about a minute)"
  # shellcheck disable=SC2086  # DEBIAN_MIRROR is deliberately optional
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$rootfs" ${DEBIAN_MIRROR:-} >/dev/null
  # Leave package caches out of the image; the lists are useless without a mirror.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
  log "base image $BASE_IMAGE imported"
}

fill_wheelhouse() {
  # The stamp is named after the lock's hash: a changed lock downloads again
  # (pip skips the wheels it already has), an unchanged one does nothing.
  local stamp
  stamp="$WHEELHOUSE/.complete-$(sha256sum "$REQUIREMENTS" | cut -c1-16)"
  if [[ -e "$stamp" ]]; then
    log "wheelhouse $WHEELHOUSE is complete for $REQUIREMENTS: skipped"
    return
  fi
  local pyver
  pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [[ "$pyver" != "3.11" ]]; then
    # The base image's python3 is bookworm's 3.11; wheels must match it.
    log "$PYTHON is Python $pyver; pip download needs Python 3.11 (set PYTHON=...)"
    exit 2
  fi
  mkdir -p "$WHEELHOUSE"
  log "pip download -r $REQUIREMENTS into $WHEELHOUSE"
  "$PYTHON" -m pip download --quiet --only-binary=:all: -d "$WHEELHOUSE" -r "$REQUIREMENTS"
  rm -f "$WHEELHOUSE"/.complete-*
  touch "$stamp"
}

build_image() {
  log "docker build --target $TARGET -t $IMAGE (base $BASE_IMAGE, wheels from $WHEELHOUSE)"
  # Both base arguments name the same local base: the gpu target needs no CUDA base image.
  # Only the target's stages (docker/stages.sh): the legacy builder would build the other's too.
  bash docker/stages.sh "$TARGET" | docker build -f - --target "$TARGET" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg GPU_BASE_IMAGE="$BASE_IMAGE" \
    --build-arg WHEELHOUSE="$WHEELHOUSE" \
    -t "$IMAGE" .
}

t0=$SECONDS
build_base_image
t1=$SECONDS
fill_wheelhouse
t2=$SECONDS
build_image
t3=$SECONDS
size=$(docker image inspect -f '{{.Size}}' "$IMAGE")
log "$IMAGE ($TARGET): $((size / 1000000)) MB; base $((t1 - t0)) s, wheelhouse $((t2 - t1)) s, docker build $((t3 - t2)) s, $((t3 - t0)) s in all"
