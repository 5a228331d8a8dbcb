#!/usr/bin/env bash
# scripts/build_view_assets.sh [VERSION] — refresh the chart library codespec view ships.
#
# Fetches uPlot from the npm registry (`npm pack`, in a scratch folder; VERSION defaults to
# the one vendored now) and copies its built dist files and its LICENSE into
# daemon/view/static/, where the package ships them (pyproject's package-data). The page
# loads them from the daemon or inlines them into an export: no CDN, it works offline.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=daemon/view/static
VERSION=${1:-1.6.32}
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
(cd "$SCRATCH" && npm pack --silent "uplot@$VERSION" >/dev/null && tar xzf uplot-*.tgz)
cp "$SCRATCH/package/dist/uPlot.iife.min.js" "$SCRATCH/package/dist/uPlot.min.css" "$DEST/"
cp "$SCRATCH/package/LICENSE" "$DEST/uPlot.LICENSE"
echo "uPlot $(node -p "require('$SCRATCH/package/package.json').version") -> $DEST"
