#!/usr/bin/env bash
# Print docker/Dockerfile with only one target's stages (and the global ARGs before them):
#   bash docker/stages.sh gpu | docker build -f - --target gpu ... .
# Docker's legacy builder (no BuildKit, as Debian's docker.io without buildx) builds every stage
# that comes before --target, used or not: the gpu build would first build the cpu stages, and
# offline, from the gpu wheelhouse, fail. BuildKit skips unused stages; this filter gives the
# same result with either builder. Sections start at the "# ---...--- cpu ----" and
# "# ---...--- gpu ----" banners.
set -euo pipefail

target=${1:-}
case "$target" in
  cpu | gpu) ;;
  *) echo "stages.sh: TARGET=$target: use cpu or gpu" >&2; exit 2 ;;
esac
awk -v want="$target" '
  /^# -+ (cpu|gpu) ----$/ { section = $3 }
  section == "" || section == want { print }
' "$(dirname "${BASH_SOURCE[0]}")/Dockerfile"
