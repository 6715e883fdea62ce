#!/usr/bin/env bash
# The control panel's browser assets, from the npm registry (`npm pack`), served by the panel
# itself (an edge box has no internet: never a CDN): uPlot for the charts, swagger-ui-dist for
# /docs. One definition for scripts/setup.sh (a checkout) and docker/Dockerfile (the image).
#
#   bash scripts/vendor-assets.sh [DEST]     DEST: default services/control_panel/static/vendor
#
# STRICT=1 (the image build): a package that cannot be packed is an error. Otherwise a warning:
# the page then works without charts and says so. Files already in place are kept.
set -uo pipefail
VENDOR=${1:-services/control_panel/static/vendor}
STRICT=${STRICT:-0}

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
        rm -rf "$tmp"
        if [ "$STRICT" = 1 ]; then
            echo "vendor-assets: npm pack $spec failed" >&2
            exit 1
        fi
        echo "setup: npm pack $spec failed: the panel's page works without it, but says so" >&2
        return 0
    fi
    rm -rf "$tmp"
}

vendor_npm uplot@1.6.32 uplot dist/uPlot.iife.min.js dist/uPlot.min.css LICENSE
vendor_npm swagger-ui-dist@5.35.0 swagger-ui swagger-ui-bundle.js swagger-ui.css LICENSE
