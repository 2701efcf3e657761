#!/usr/bin/env bash
# Build the CPU flavour of the chatlearn image (docker/Dockerfile) with podman, without any container
# registry, and check it: `chatlearn --version`, a dry run of every template, a container whose output volume
# is not writable (refused before training), and the default job for a few episodes with its output on a
# mounted folder (it must write its metrics there and its eval must rise). README.md, "Container image".
#
#   bash tools/build_image.sh              build (the base and the image: once) and check
#   bash tools/build_image.sh --build-only build, no checks
#
# Environment: CHATLEARN_IMAGE (the tag, default localhost/chatlearn:cpu), CHATLEARN_BASE_IMAGE (default
# localhost/chatlearn-base:bookworm, made here by mmdebstrap from this machine's apt source and `podman import`
# when missing), CHATLEARN_IMAGE_OUT (the mounted output folder, default output/image-check),
# CHATLEARN_IMAGE_EPISODES (default 20), CHATLEARN_IMAGE_REBUILD_BASE=1 (make the base again).
# podman, runc and mmdebstrap are installed from apt when missing (as root). What this machine needs, measured:
# runc as the runtime (crun refuses its cgroup setup), open-file and process limits at or below its hard
# limits, --network=host for the build, and pip given the host's CA bundle (a build secret: in no layer).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE=${CHATLEARN_IMAGE:-localhost/chatlearn:cpu}
BASE=${CHATLEARN_BASE_IMAGE:-localhost/chatlearn-base:bookworm}
OUT=${CHATLEARN_IMAGE_OUT:-$PWD/output/image-check}
EPISODES=${CHATLEARN_IMAGE_EPISODES:-20}
BUILD_ONLY=0
[ "${1:-}" = "--build-only" ] && BUILD_ONLY=1
WORK=$(mktemp -d -t chatlearn-image-XXXXXX)
trap 'rm -rf "$WORK"' EXIT

refuse() {  # one paragraph on stderr, exit 1
  echo "error: $*" | tr -s ' ' | fmt -w 100 >&2
  exit 1
}
say() { echo "[build_image] $*"; }

need_tools() {
  local missing=()
  command -v podman >/dev/null || missing+=(podman)
  command -v runc >/dev/null || missing+=(runc)
  command -v mmdebstrap >/dev/null || missing+=(mmdebstrap)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    refuse "${missing[*]} not found, and this script installs them from apt only as root: run" \
      "\`sudo apt-get install -y ${missing[*]}\` (Debian 12 or Ubuntu 22.04+), then run it again."
  fi
  say "installing ${missing[*]} from apt"
  if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"; } \
      >"$WORK/apt.log" 2>&1; then
    refuse "apt-get could not install ${missing[*]} (the image is built with podman and runc, its base made" \
      "with mmdebstrap): $(grep -E '^(E|Err):' "$WORK/apt.log" | head -3 | tr '\n' ' ')Check this machine's" \
      "apt sources (/etc/apt/sources.list.d) or install them yourself, then run this script again."
  fi
}

# podman with runc, and limits at or below this machine's hard limits (podman's defaults are above them here)
PODMAN=(podman --runtime runc)
LIMITS=()
limits() {
  local nofile nproc
  nofile=$(ulimit -Hn)
  nproc=$(ulimit -Hu)
  # runc cannot set a process limit above the kernel's pid_max here (measured: EPERM above it)
  local pid_max
  pid_max=$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo unlimited)
  if [ "$pid_max" != unlimited ] && { [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; }; then
    nproc=$pid_max
  fi
  [ "$nofile" != unlimited ] && LIMITS+=(--ulimit "nofile=$nofile:$nofile")
  [ "$nproc" != unlimited ] && LIMITS+=(--ulimit "nproc=$nproc:$nproc")
  return 0
}

check_podman() {
  if ! "${PODMAN[@]}" info >"$WORK/podman-info.log" 2>&1; then
    refuse "podman is installed but cannot run here (\`podman --runtime runc info\` failed:" \
      "$(grep -iE 'error|denied' "$WORK/podman-info.log" | head -2 | tr '\n' ' ' | sed 's/ *$//')). Building the image needs" \
      "a working podman with runc: as root, or rootless with subuid/subgid ranges for your user" \
      "(/etc/subuid, /etc/subgid) and fuse-overlayfs."
  fi
}

# the base: a minimal Debian 12 root filesystem (with Python 3.11 and venv) from this machine's apt source
make_base() {
  if [ "${CHATLEARN_IMAGE_REBUILD_BASE:-0}" != 1 ] && "${PODMAN[@]}" image exists "$BASE"; then
    say "base $BASE exists"
    return 0
  fi
  local src
  src=$(grep -lE '^(Suites:|deb ).*bookworm' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list \
        2>/dev/null | head -1 || true)
  say "making the base $BASE with mmdebstrap (${src:-http://deb.debian.org/debian})"
  local start=$SECONDS mirror=${src:+-}  # "-": the sources on stdin
  if ! mmdebstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libnuma1,procps \
      --aptopt='APT::Install-Recommends "false"' --dpkgopt='path-exclude=/usr/share/doc/*' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
      bookworm "$WORK/base.tar" "${mirror:-http://deb.debian.org/debian}" <"${src:-/dev/null}" >"$WORK/mmdebstrap.log" 2>&1; then
    refuse "mmdebstrap could not make the base root filesystem (Debian 12 from" \
      "${src:-http://deb.debian.org/debian}): $(grep -E '^E:|error' "$WORK/mmdebstrap.log" | head -3 | tr '\n' ' ')" \
      "It needs root (or unshare with subuid ranges) and a reachable Debian mirror. Or give an existing" \
      "Debian 12 image as CHATLEARN_BASE_IMAGE."
  fi
  if ! "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' "$WORK/base.tar" "$BASE" >"$WORK/import.log" 2>&1; then
    refuse "podman import could not turn the root filesystem into the image $BASE: $(tail -2 "$WORK/import.log")"
  fi
  rm -f "$WORK/base.tar"
  say "base made in $((SECONDS - start)) s"
}

# pip's CA bundle and local wheels on this machine (its pip config), handed to the build
PIP_CA=""
WHEELS=""
pip_sources() {
  local py
  py=$(command -v python3 || true)
  PIP_CA=${PIP_CERT:-}
  [ -z "$PIP_CA" ] && [ -n "$py" ] && PIP_CA=$("$py" -m pip config get global.cert 2>/dev/null || true)
  [ -n "$PIP_CA" ] && [ ! -s "$PIP_CA" ] && PIP_CA=""
  WHEELS=${PIP_FIND_LINKS:-}
  [ -z "$WHEELS" ] && [ -n "$py" ] && WHEELS=$("$py" -m pip config get global.find-links 2>/dev/null || true)
  WHEELS=${WHEELS%% *}
  if [ -z "$WHEELS" ] || [ ! -d "$WHEELS" ]; then
    WHEELS="$WORK/no-wheels"
    mkdir -p "$WHEELS"
  fi
}

build() {
  local args=(--network=host "${LIMITS[@]}" -f docker/Dockerfile -t "$IMAGE"
              --build-arg FLAVOUR=cpu --build-arg "BASE_IMAGE=$BASE" --build-context "wheels=$WHEELS")
  [ -n "$PIP_CA" ] && args+=(--secret "id=pip_ca,src=$PIP_CA")
  # a local torch CPU wheel (as .venv takes, tools/setup.sh): no need of PyTorch's CPU index
  compgen -G "$WHEELS/torch-*+cpu-*.whl" >/dev/null && args+=(--build-arg TORCH_INDEX=none)
  say "building $IMAGE (wheels from $WHEELS${PIP_CA:+, pip CA bundle $PIP_CA as a build secret})"
  local start=$SECONDS
  "${PODMAN[@]}" build "${args[@]}" . || refuse "podman build of $IMAGE failed (its output is above)."
  BUILD_S=$((SECONDS - start))
  SIZE=$("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE")
  say "built $IMAGE in ${BUILD_S} s; size $((SIZE / 1000000)) MB"
}

run_image() {  # run the image with this machine's limits; extra podman options before "--"
  local opts=()
  while [ "$1" != -- ]; do opts+=("$1"); shift; done
  shift
  "${PODMAN[@]}" run --rm "${LIMITS[@]}" --shm-size=2g "${opts[@]}" "$IMAGE" "$@"
}

check_image() {
  say "chatlearn --version: $(run_image -- --version)"
  local t
  for t in template/*.yaml; do
    if [ "$(basename "$t")" = sft.yaml ]; then continue; fi  # `chatlearn sft` has no dry run
    run_image -- run "$t" --dry-run >"$WORK/dry.log" 2>&1 \
      || { cat "$WORK/dry.log"; refuse "the dry run of $t failed in the image (its output is above)."; }
    say "dry run of $t: ok"
  done
  # a read-only output volume: refused before training, in one paragraph
  mkdir -p "$WORK/ro"
  local refused
  if run_image -v "$WORK/ro:/opt/chatlearn/output:ro" -- run template/grpo_fsdp.yaml >"$WORK/ro.log" 2>&1; then
    refused=""
  else
    refused=$(tr -s '\n ' '  ' <"$WORK/ro.log")  # the paragraph, unwrapped
  fi
  if [[ "$refused" != *"cannot be written by this container's user"* ]]; then
    cat "$WORK/ro.log"
    refuse "a container with a read-only output volume was not refused before training (its output is above)."
  fi
  say "a read-only output volume is refused: ${refused:0:160}..."
  # the default job for a few episodes, its output on a mounted folder the image's user can write
  rm -rf "$OUT"
  mkdir -p "$OUT"
  local user=()
  if [ "$(id -u)" = 0 ]; then
    chown "$("${PODMAN[@]}" run --rm "${LIMITS[@]}" --entrypoint id "$IMAGE" -u)" "$OUT"
  else  # rootless podman: this user is the image's user inside
    user=(--userns="keep-id:uid=$("${PODMAN[@]}" run --rm "${LIMITS[@]}" --entrypoint id "$IMAGE" -u)")
  fi
  local start=$SECONDS
  run_image "${user[@]}" -v "$OUT:/opt/chatlearn/output" -- run template/grpo_fsdp.yaml \
    "runtime_args.num_episode=$EPISODES" "runtime_args.eval_episode_interval=$EPISODES" \
    "runtime_args.save_episode_interval=$EPISODES" | tee "$WORK/run.log" \
    || refuse "the default job failed in the image (its output is above)."
  RUN_S=$((SECONDS - start))
  local metrics="$OUT/grpo_fsdp/metrics.jsonl"
  [ -s "$metrics" ] || refuse "the run in the image wrote no $metrics on the mounted folder."
  python3 - "$metrics" "$EPISODES" <<'PY' || refuse "the run in the image did not learn (see above)."
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
evals = {r["episode"]: r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r}
last = int(sys.argv[2])
print(f"[build_image] eval/reward_mean: episode 0 {evals.get(0)}, episode {last} {evals.get(last)}")
sys.exit(0 if 0 in evals and last in evals and evals[last] > evals[0] else 1)
PY
  say "the default job ran $EPISODES episodes in ${RUN_S} s (with start-up); metrics in $metrics"
}

need_tools
limits
check_podman
make_base
pip_sources
build
if [ "$BUILD_ONLY" = 0 ]; then
  check_image
fi
say "done: $IMAGE, built in ${BUILD_S} s, $((SIZE / 1000000)) MB"
