#!/usr/bin/env bash
# MuJoCo Warp's wheels for the GPU machine (Python 3.12, torch preinstalled, no network), in
# parts small enough for one device call each. warp-lang's wheel alone is 149 MB and a call
# carries at most 64 MiB (the repository included), so the wheels travel as an xz archive
# of their unpacked contents (warp's libraries compress to about two thirds of their zip
# size), byte-split into .carry1/, .carry2/ ... (each part at most 55 MiB), one part a
# call to a machine kept warm between the calls (ignored folders stay on a warm machine
# unless named again in `carry`; it goes cold after a short idle time, so make the calls
# one right after another). The last call joins the parts, checks them against the sha256
# recorded here, zips each wheel again and pip-installs the lot into /tmp/site-mjw.
#
# Here (a machine with network), from the root of the checkout:
#   bash scripts/carry_parts.sh fetch   # the wheels, into .whl-mjw/
#   bash scripts/carry_parts.sh split   # .whl-mjw/ -> .carry1/ .carry2/ ... (prints the plan)
# On the device, call k (k = 1 .. N-1) carries .carry<k> and only lists what arrived:
#   run(command="bash scripts/carry_parts.sh status", carry=[".carry1"])
#   run(command="bash scripts/carry_parts.sh status", carry=[".carry2"])  # if N > 2
# and call N carries .carry<N>, joins, installs and goes on with the work, e.g.:
#   run(command="bash scripts/carry_parts.sh join && PYTHONPATH=$PWD/src:/tmp/site-mjw \
#     python3 benchmarks/mjwarp_cheetah.py --check --json $OUT/mjw.json", carry=[".carry<N>"])
# Each .carry<k>/ holds MANIFEST (the same in every part: the number of parts, each part's
# sha256, the archive's sha256, the wheels' names and sha256 before packing) and its part.
# `join` is idempotent: once /tmp/site-mjw holds the install (marker file), it does nothing.
# WHEELS=dir selects another folder of wheels for split; SITE=dir another install target.
set -euo pipefail
cd "$(dirname "$0")/.."  # the root of the checkout (the device's copy has no .git)
wheels=${WHEELS:-.whl-mjw}
site=${SITE:-/tmp/site-mjw}
part_mib=${PART_MIB:-55}
stage=/tmp/carry-mjw  # where the device joins, outside the working tree

exclude() {  # ignored folders: .git/info/exclude is shared by every worktree
  local common
  common=$(git rev-parse --git-common-dir)
  mkdir -p "$common/info"
  grep -qxF "$1" "$common/info/exclude" 2>/dev/null || echo "$1" >> "$common/info/exclude"
}

fetch() {
  # mujoco-warp 4.0.0 asks warp-lang>=1.15 and mujoco>=3.13: the newest of each (warp-lang
  # 1.19.0, built with CUDA 13.4: R580 drivers or newer; mujoco 4.0.0, whose mujoco-core
  # holds the bindings). Left out, as not needed to import mujoco or mujoco_warp (checked
  # on Python 3.11 and 3.12): mujoco-studio (the viewer, 12.8 MB), glfw and pyopengl
  # (rendering, imported by mujoco inside try/except), etils' epath extras.
  exclude '/.whl-mjw/'
  mkdir -p "$wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$wheels" \
    mujoco-warp==4.0.0 warp-lang==1.19.0 mujoco==4.0.0 mujoco-core==4.0.0 absl-py==2.5.1 \
    etils==1.15.0 2>&1 | grep -v '^WARNING' || true
  ls -l "$wheels"
}

split_parts() {
  compgen -G "$wheels/*.whl" > /dev/null || { echo "no wheels in $wheels (run fetch)" >&2; exit 1; }
  local tmp archive total size parts k
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' RETURN
  # Each wheel unpacked into a folder of its file name, so that `join` can zip it again.
  for whl in "$wheels"/*.whl; do
    mkdir -p "$tmp/wheels/$(basename "$whl")"
    python3 -m zipfile -e "$whl" "$tmp/wheels/$(basename "$whl")/"
  done
  archive=$tmp/wheels.tar.xz
  tar -C "$tmp/wheels" -cf - . | xz -T0 -6 > "$archive"
  total=$(stat -c %s "$archive")
  size=$((part_mib * 1024 * 1024))
  parts=$(((total + size - 1) / size))
  size=$(((total + parts - 1) / parts))  # parts of equal size, at most PART_MIB
  rm -rf .carry[0-9]*
  (cd "$tmp" && split -b "$size" -d -a 2 wheels.tar.xz part.)
  {
    echo "parts $parts"
    echo "archive $(sha256sum "$archive" | cut -d' ' -f1) $total"
    for k in $(seq 1 "$parts"); do
      echo "part $k $(sha256sum "$tmp/part.$(printf %02d $((k - 1)))" | cut -d' ' -f1)"
    done
    for whl in "$wheels"/*.whl; do
      echo "wheel $(basename "$whl") $(sha256sum "$whl" | cut -d' ' -f1) $(stat -c %s "$whl")"
    done
  } > "$tmp/MANIFEST"
  for k in $(seq 1 "$parts"); do
    exclude "/.carry$k/"
    mkdir -p ".carry$k"
    mv "$tmp/part.$(printf %02d $((k - 1)))" ".carry$k/part"
    cp "$tmp/MANIFEST" ".carry$k/MANIFEST"
  done
  echo "wheels $(du -cb "$wheels"/*.whl | tail -1 | cut -f1) bytes -> archive $total bytes, $parts parts"
  local repo
  repo=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
  echo "repository (tracked files) $repo bytes"
  for k in $(seq 1 "$parts"); do
    echo "call $k carries .carry$k: $(du -sb ".carry$k" | cut -f1) bytes," \
      "with the repository $(($(du -sb ".carry$k" | cut -f1) + repo)) (limit $((64 * 1024 * 1024)))"
  done
}

# On the device: move the part this call carried out of the working tree (a later call that
# does not name .carry<k> may remove it there) into $stage, where the parts gather.
gather() {
  mkdir -p "$stage"
  for dir in .carry[0-9]*; do
    [ -f "$dir/part" ] || continue
    local k
    k=${dir#.carry}
    cp "$dir/MANIFEST" "$stage/MANIFEST"
    cp "$dir/part" "$stage/part.$k"
    local want got
    want=$(awk -v k="$k" '$1 == "part" && $2 == k {print $3}' "$stage/MANIFEST")
    got=$(sha256sum "$stage/part.$k" | cut -d' ' -f1)
    if [ "$want" != "$got" ]; then
      echo "part $k: sha256 $got, the manifest says $want" >&2
      rm -f "$stage/part.$k"
      exit 1
    fi
  done
}

status() {
  gather
  local parts
  parts=$(awk '$1 == "parts" {print $2}' "$stage/MANIFEST" 2>/dev/null || echo '?')
  echo "parts here: $(cd "$stage" && ls part.* 2>/dev/null | tr '\n' ' ')(of $parts), in $stage"
  [ -f "$site/.carry-installed" ] && echo "installed in $site"
  df -h /tmp | tail -1
}

join_parts() {
  if [ -f "$site/.carry-installed" ]; then
    echo "already installed in $site"
    return
  fi
  gather
  local parts k
  parts=$(awk '$1 == "parts" {print $2}' "$stage/MANIFEST")
  for k in $(seq 1 "$parts"); do
    [ -f "$stage/part.$k" ] || { echo "part $k of $parts missing (carry .carry$k first)" >&2; exit 1; }
  done
  for k in $(seq 1 "$parts"); do cat "$stage/part.$k"; done > "$stage/wheels.tar.xz"
  local want got
  want=$(awk '$1 == "archive" {print $2}' "$stage/MANIFEST")
  got=$(sha256sum "$stage/wheels.tar.xz" | cut -d' ' -f1)
  [ "$want" = "$got" ] || { echo "archive: sha256 $got, the manifest says $want" >&2; exit 1; }
  rm -rf "$stage/unpacked" "$stage/wheels" && mkdir -p "$stage/unpacked" "$stage/wheels"
  # Python's lzma, in case the machine has no xz.
  python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    "$stage/wheels.tar.xz" "$stage/unpacked"
  rm -f "$stage/wheels.tar.xz"
  # Zip each wheel again (stored: pip reads it once), then install; each installed file is
  # checked against its wheel's RECORD below.
  python3 - "$stage/unpacked" "$stage/wheels" <<'EOF'
import pathlib, sys, zipfile
root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for folder in sorted(p for p in root.iterdir() if p.is_dir()):
    with zipfile.ZipFile(out / folder.name, "w", zipfile.ZIP_STORED) as whl:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                whl.write(path, path.relative_to(folder).as_posix())
EOF
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$stage"/wheels/*.whl
  python3 - "$site" "$stage/wheels" <<'EOF'
import base64, csv, hashlib, pathlib, sys
site, root = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
checked = 0
for record in site.glob("*.dist-info/RECORD"):
    for row in csv.reader(record.read_text().splitlines()):
        # Console scripts (../../bin/...) are written by pip, not copied from the wheel.
        if len(row) < 2 or not row[1].startswith("sha256=") or row[0].startswith("../"):
            continue
        digest = base64.urlsafe_b64encode(hashlib.sha256((site / row[0]).read_bytes()).digest())
        if row[1] != "sha256=" + digest.rstrip(b"=").decode():
            sys.exit(f"{row[0]}: its content does not match {record}")
        checked += 1
print(f"{checked} installed files match their wheels' RECORD")
EOF
  rm -rf "$stage/unpacked" "$stage/wheels" "$stage"/part.*
  touch "$site/.carry-installed"
  PYTHONPATH="$site" python3 -c 'import mujoco, warp, mujoco_warp; print("mujoco", mujoco.__version__, "warp", warp.__version__, "mujoco_warp", mujoco_warp.__version__)'
}

case "${1:-}" in
  fetch) fetch ;;
  split) split_parts ;;
  status) status ;;
  join) join_parts ;;
  *) echo "usage: $0 fetch|split|status|join" >&2; exit 2 ;;
esac
