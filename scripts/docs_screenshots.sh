#!/usr/bin/env bash
# Build the docs and take headless-Chromium screenshots of pages, to look at them as a reader
# does (the API page's examples as code blocks, its tables, the figures):
#   bash scripts/docs_screenshots.sh [OUT] [PAGE ...]   # default: docs-shots/, api/ quickstart/
#   WIDTH=390 HEIGHT=6000 bash scripts/docs_screenshots.sh shots-phone ""   # a phone's width
# Needs Debian's chromium (`apt-get install chromium`).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
out=${1:-docs-shots}
shift || true
pages=("${@:-api/}")
[ $# -eq 0 ] && pages=(api/ quickstart/ several-gpus/ benchmarks/)
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$site"
mkdir -p "$out"
port=${PORT:-8765}
python3 -m http.server "$port" --directory "$site" > /dev/null 2>&1 &
server=$!
trap 'kill $server' EXIT
sleep 1
for page in "${pages[@]}"; do
  name=$(echo "${page%/}" | tr / -)
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$(mktemp -d)" --hide-scrollbars --window-size=${WIDTH:-1400},${HEIGHT:-9000} \
    --screenshot="$out/${name:-index}.png" "http://localhost:$port/$page" 2> /dev/null
done
ls -1 "$out"
