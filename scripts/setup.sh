#!/usr/bin/env bash
# Installs everything FlashMoE needs on a fresh Debian/Ubuntu machine: system packages (when
# root), a virtual environment in .venv with the CPU build of torch, the project itself, and
# the io_uring C helper. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

# chromium + chromium-driver: the control panel's headless browser test.
APT_PACKAGES="liburing-dev fio redis-server chromium chromium-driver"
command -v npm >/dev/null || APT_PACKAGES="$APT_PACKAGES npm"  # the panel's chart library
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if ! dpkg -s $APT_PACKAGES >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $APT_PACKAGES >/dev/null
    fi
else
    echo "setup: not root (or no apt-get): install $APT_PACKAGES yourself;" \
         "without liburing the pread engine is used" >&2
fi

# The control panel's browser assets, from the npm registry, served by the panel itself (an
# edge box has no internet: never a CDN): uPlot for the charts, swagger-ui-dist for /docs.
VENDOR=services/control_panel/static/vendor
vendor_npm() {  # package@version folder file...: the package's files into $VENDOR/folder
    local spec=$1 dest=$VENDOR/$2 tmp have=1
    shift 2
    for file in "$@"; do [ -f "$dest/$(basename "$file")" ] || have=0; done
    [ $have = 1 ] && return 0
    tmp=$(mktemp -d)
    if (cd "$tmp" && npm pack --silent "$spec" >/dev/null 2>&1) \
            && tar -xzf "$tmp"/*.tgz -C "$tmp"; then
        mkdir -p "$dest"
        for file in "$@"; do cp "$tmp/package/$file" "$dest/"; done
    else
        echo "setup: npm pack $spec failed: the panel's page works without it, but says so" >&2
    fi
    rm -rf "$tmp"
}
if command -v npm >/dev/null; then
    vendor_npm uplot@1.6.32 uplot dist/uPlot.iife.min.js dist/uPlot.min.css LICENSE
    vendor_npm swagger-ui-dist@5.35.0 swagger-ui swagger-ui-bundle.js swagger-ui.css LICENSE
else
    echo "setup: no npm: the control panel shows no charts and /docs has no Swagger UI" >&2
fi

PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# The CPU build, pinned: any other torch spec pulls a multi-GB CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e ".[test]"
.venv/bin/flashmoe build-helper >/dev/null \
    || echo "setup: the io_uring helper did not build; the pread engine will be used" >&2
