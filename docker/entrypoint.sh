#!/bin/bash
# Container entrypoint for DeepInfer-server.
#
# 1. Raise the locked-memory limit to unlimited (RDMA / pinned host memory for DeepEP and Engram)
#    and the stack limit to 64 MiB. Without permission (no CAP_SYS_RESOURCE, hard limit lower than
#    requested) print a warning to stderr and go on: the server may still work, e.g. without RDMA.
# 2. Create the JIT and Hugging Face cache directories under the cache root (/cache) when it is writable,
#    plus $DEEPINFER_JIT_CACHE_DIR / $HF_HOME if they point elsewhere (GPUStack sets its own JIT path).
# 3. exec the server with the arguments unchanged. No shell stays in between: the server is the container's
#    PID 1 and gets `docker stop`'s SIGTERM itself (it drains, then stops its ranks; see Dockerfile STOPSIGNAL).
#
# Overrides (mainly for tests):
#   DEEPINFER_SERVER_BIN   command to exec (default: deepinfer-server)
#   DEEPINFER_CACHE_ROOT   cache root (default: /cache)
set -eu

SERVER_BIN="${DEEPINFER_SERVER_BIN:-deepinfer-server}"
CACHE_ROOT="${DEEPINFER_CACHE_ROOT:-/cache}"
MEMLOCK_WANT="unlimited"
STACK_WANT_KIB=65536

warn() {
    printf 'deepinfer-entrypoint: WARNING: %s\n' "$*" >&2
}

# raise_limit FLAG WANT DESCRIPTION CONSEQUENCE
raise_limit() {
    local flag="$1" want="$2" what="$3" consequence="$4" current hard now
    current="$(ulimit "-S$flag" 2>/dev/null || echo '?')"
    if [ "$current" = "$want" ]; then
        return 0
    fi
    if ulimit "-$flag" "$want" 2>/dev/null; then
        return 0
    fi
    # Could not set it: try at least the soft limit (possible when the hard limit is already high enough).
    if ulimit "-S$flag" "$want" 2>/dev/null; then
        return 0
    fi
    hard="$(ulimit "-H$flag" 2>/dev/null || echo '?')"
    # Take what the hard limit allows.
    if [ "$hard" != "?" ]; then
        ulimit "-S$flag" "$hard" 2>/dev/null || true
    fi
    now="$(ulimit "-S$flag" 2>/dev/null || echo '?')"
    warn "cannot raise the $what limit to $want (soft now $now, hard $hard; needs root/CAP_SYS_RESOURCE" \
        "or docker run --ulimit); continuing, but $consequence"
}

raise_limit l "$MEMLOCK_WANT" "locked-memory (ulimit -l, KiB)" \
    "RDMA / pinned host memory registration (DeepEP, Engram) may fail"
raise_limit s "$STACK_WANT_KIB" "stack (ulimit -s, KiB)" "deep native call chains may overflow the stack"

# make_dir DIR: create DIR if missing; warn (do not fail) when that is impossible.
make_dir() {
    [ -d "$1" ] && return 0
    mkdir -p "$1" 2>/dev/null || warn "cannot create cache directory $1"
}

if [ -d "$CACHE_ROOT" ] && [ -w "$CACHE_ROOT" ]; then
    make_dir "$CACHE_ROOT/jit"
    make_dir "$CACHE_ROOT/huggingface"
fi
if [ -n "${DEEPINFER_JIT_CACHE_DIR:-}" ]; then
    make_dir "$DEEPINFER_JIT_CACHE_DIR"
fi
if [ -n "${HF_HOME:-}" ]; then
    make_dir "$HF_HOME"
fi

exec "$SERVER_BIN" "$@"
