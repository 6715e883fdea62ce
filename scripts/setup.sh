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

# The control panel's browser assets, from the npm registry (scripts/vendor-assets.sh; the
# image build runs the same script).
if command -v npm >/dev/null; then
    bash scripts/vendor-assets.sh
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
