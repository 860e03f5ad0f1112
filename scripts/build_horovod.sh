#!/usr/bin/env bash
# Build (or reuse) a Horovod 0.28.1 wheel with the TensorFlow op library and the
# Gloo controller for the project's venv, and install it there.  Called by
# `make horovod`.
#
# Horovod 0.28.1 (the newest release) does not build against TensorFlow 2.21 as
# published: horovod/tensorflow/CMakeLists.txt compiles xla_mpi_ops.cc (GPU-only
# XLA custom calls) whose TF headers are no longer shipped in the TF wheel.  We
# build from the sdist with that one source removed; nothing else is changed.
#
# Environment:
#   PYTHON              interpreter of the target venv
#                       (default: <repo>/.venv/bin/python)
#   HOROVOD_WHEEL_CACHE where the built wheel and the build log are kept
#                       (default: ${XDG_CACHE_HOME:-$HOME/.cache}/yogastore/wheels)
#   BUILD_JOBS          parallel compile jobs (default: nproc)
# Options:
#   --rebuild           ignore an installed Horovod and a cached wheel; build anew
set -euo pipefail

HOROVOD_VERSION=0.28.1

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-$REPO_ROOT/.venv/bin/python}"
HOROVOD_WHEEL_CACHE="${HOROVOD_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/yogastore/wheels}"
BUILD_JOBS="${BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"

REBUILD=0
for arg in "$@"; do
    case "$arg" in
        --rebuild) REBUILD=1 ;;
        -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "build_horovod: unknown argument: $arg" >&2; exit 2 ;;
    esac
done

log() { echo "build_horovod: $*"; }
die() { echo "build_horovod: ERROR: $*" >&2; exit 1; }

[[ -x "$PYTHON" ]] || die "python not found at $PYTHON (set PYTHON or create the venv first)"
VENV_BIN="$(cd "$(dirname "$PYTHON")" && pwd)"
# Horovod's setup.py looks for `cmake` on PATH; horovodrun etc. live here too.
export PATH="$VENV_BIN:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-3}"

pip_() { "$PYTHON" -m pip --disable-pip-version-check "$@"; }

# Succeeds iff horovod.tensorflow imports (its native op library loads against
# the installed TensorFlow) and was built with Gloo.
verify() {
    "$PYTHON" - "$HOROVOD_VERSION" <<'EOF' 2>&1 | grep -v -e 'absl::InitializeLog' -e 'cpu_feature_guard' -e 'To enable the following instructions' -e 'oneDNN custom operations'
import sys
import horovod
import horovod.tensorflow as hvd
import tensorflow as tf
want = sys.argv[1]
if horovod.__version__ != want:
    sys.exit(f"horovod {horovod.__version__} installed, want {want}")
if not hvd.gloo_built():
    sys.exit("horovod.tensorflow was built without Gloo")
print(f"horovod {horovod.__version__} (tensorflow {tf.__version__}, gloo built: True)")
EOF
    return "${PIPESTATUS[0]}"
}

if [[ $REBUILD -eq 0 ]] && status="$(verify 2>/dev/null)"; then
    log "already installed: $status"
    exit 0
fi

PY_TAG="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
mkdir -p "$HOROVOD_WHEEL_CACHE"
BUILD_LOG="$HOROVOD_WHEEL_CACHE/horovod-$HOROVOD_VERSION-build.log"

RUNTIME_DEPS=(cloudpickle psutil pyyaml packaging)

install_wheel() {
    log "installing $(basename "$1")"
    pip_ install -q "${RUNTIME_DEPS[@]}"
    pip_ install -q --no-deps --force-reinstall "$1"
}

shopt -s nullglob
cached=("$HOROVOD_WHEEL_CACHE"/horovod-"$HOROVOD_VERSION"-"$PY_TAG"-*.whl)
shopt -u nullglob
if [[ $REBUILD -eq 0 && ${#cached[@]} -gt 0 ]]; then
    install_wheel "${cached[0]}"
    if verify; then
        log "done (from cached wheel ${cached[0]})"
        exit 0
    fi
    log "cached wheel does not work with this venv (built against another TensorFlow?); rebuilding"
    rm -f "${cached[0]}"
fi

# ---------------------------------------------------------------- build ----
"$PYTHON" -c 'import tensorflow' >/dev/null 2>&1 \
    || die "tensorflow does not import in $PYTHON; install the project's requirements first"

log "installing build dependencies into the venv"
pip_ install -q setuptools wheel "${RUNTIME_DEPS[@]}"
cmake_ok() {
    command -v cmake >/dev/null 2>&1 || return 1
    "$PYTHON" - "$(cmake --version | head -n1)" <<'EOF'
import re, sys
m = re.search(r"(\d+)\.(\d+)", sys.argv[1])
sys.exit(0 if m and (int(m[1]), int(m[2])) >= (3, 13) else 1)
EOF
}
if ! cmake_ok; then
    log "no cmake >= 3.13 on PATH; installing the cmake package into the venv"
    pip_ install -q cmake
    cmake_ok || die "cmake still not usable after 'pip install cmake'"
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log "downloading horovod $HOROVOD_VERSION sdist"
pip_ download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$WORK" >"$BUILD_LOG" 2>&1 \
    || { tail -n 30 "$BUILD_LOG" >&2; die "pip download failed (log: $BUILD_LOG)"; }
tar -xzf "$WORK/horovod-$HOROVOD_VERSION.tar.gz" -C "$WORK"
SRC="$WORK/horovod-$HOROVOD_VERSION"

TF_CMAKE="$SRC/horovod/tensorflow/CMakeLists.txt"
grep -q 'xla_mpi_ops\.cc' "$TF_CMAKE" \
    || die "patch target not found: no 'xla_mpi_ops.cc' line in $TF_CMAKE"
sed -i '/xla_mpi_ops\.cc/d' "$TF_CMAKE"
log "patched: removed xla_mpi_ops.cc from horovod/tensorflow/CMakeLists.txt"

log "building wheel (${BUILD_JOBS} jobs; a few minutes on 2 cores; log: $BUILD_LOG)"
start=$SECONDS
if ! env \
        HOROVOD_WITH_TENSORFLOW=1 \
        HOROVOD_WITH_GLOO=1 \
        HOROVOD_WITHOUT_MPI=1 \
        HOROVOD_WITHOUT_PYTORCH=1 \
        HOROVOD_WITHOUT_MXNET=1 \
        MAKEFLAGS="-j${BUILD_JOBS}" \
        CMAKE_BUILD_PARALLEL_LEVEL="${BUILD_JOBS}" \
        "$PYTHON" -m pip --disable-pip-version-check wheel -v --no-deps --no-build-isolation \
            -w "$WORK/dist" "$SRC" >>"$BUILD_LOG" 2>&1; then
    echo "----- first errors in $BUILD_LOG -----" >&2
    grep -n -m 20 -E 'error:|CMake Error|Error [0-9]+' "$BUILD_LOG" >&2 || true
    echo "----- last 60 lines of $BUILD_LOG -----" >&2
    tail -n 60 "$BUILD_LOG" >&2
    die "wheel build failed after $((SECONDS - start)) s (full log: $BUILD_LOG)"
fi
log "built in $((SECONDS - start)) s"

shopt -s nullglob
built=("$WORK"/dist/horovod-"$HOROVOD_VERSION"-*.whl)
shopt -u nullglob
[[ ${#built[@]} -eq 1 ]] || die "expected one horovod wheel in $WORK/dist, found ${#built[@]}"
cp "${built[0]}" "$HOROVOD_WHEEL_CACHE/"
WHEEL="$HOROVOD_WHEEL_CACHE/$(basename "${built[0]}")"
log "cached $WHEEL"

install_wheel "$WHEEL"
verify || die "horovod installed but does not work: see output above"
log "done"
