#!/usr/bin/env bash
# Make an earlier version of the library importable beside the current one, for
# `python benchmarks/run.py --baseline benchmarks/baseline` (one process times both):
#   bash scripts/make_baseline.sh REV      # REV: a commit, e.g. HEAD~3 or a tag
#   bash scripts/make_baseline.sh HEAD benchmarks/baseline/aa  # another folder (an A/A copy)
# It writes benchmarks/baseline/cudagraph_td_baseline/ (ignored by git): the package as it
# was at REV, renamed, with its own optree namespace so that both can register TensorDict.
set -euo pipefail
rev=${1:?usage: make_baseline.sh REV [DIR]}
cd "$(git rev-parse --show-toplevel)"
out=${2:-benchmarks/baseline}/cudagraph_td_baseline
rm -rf "$out" && mkdir -p "$out"
# The package's folder at REV: src/cudagraph_td, or cudagraph_td before the src layout.
folder=src/cudagraph_td
git cat-file -e "$rev:$folder" 2>/dev/null || folder=cudagraph_td
git archive "$rev" "$folder" | tar -x -C "$out" --strip-components="$(tr -cd / <<< "$folder/" | wc -c)"
# The optree namespace's module: _values/tree.py, or _tree.py before the subpackages.
tree="$out/_values/tree.py"
[[ -f "$tree" ]] || tree="$out/_tree.py"
sed -i 's/^NAMESPACE = "cudagraph_td"/NAMESPACE = "cudagraph_td_baseline"/' "$tree"
grep -q '^NAMESPACE = "cudagraph_td_baseline"' "$tree"
echo "REVISION = \"$(git rev-parse --short "$rev")\"" >> "$out/__init__.py"
echo "baseline: $rev ($(git rev-parse --short "$rev")) in $out"
