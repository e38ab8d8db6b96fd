#!/usr/bin/env bash
# A Burn user's own crate on memsave, built from README's "Use memsave in your project" lines in a
# folder outside this workspace (tests/downstream/src is its code), so that those lines stay true:
#
# 1. its dependency tree holds none of the crates of memsave's command line, models or data
#    parallelism (tokio, axum, hyper, websockets, burn-collective, clap, plotters, image, ...),
#    and does hold tokio and memsave's burn-collective once it asks for `parallel`;
# 2. it builds and runs: `memsave::check` on its model, then burn-train training with mixed
#    precision, accumulation and checkpointing, memsave's metrics in burn-train's log.
#
# Usage: scripts/downstream.sh [--fresh]
#   By default it builds into this workspace's target folder (CARGO_TARGET_DIR), so that only what
#   differs is compiled (CI). With --fresh it builds into a target folder of its own, from
#   scratch, and prints the time and the number of crates (README's figures).
set -euo pipefail

repo="$(cd "$(dirname "$0")/.." && pwd)"
fresh=0
[ "${1:-}" = "--fresh" ] && fresh=1

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
crate="$work/user"
mkdir -p "$crate"
cp -r "$repo/tests/downstream/src" "$crate/"

# README's block, between its markers, without the code fence.
lines="$(awk '/<!-- downstream:begin -->/{on=1; next} /<!-- downstream:end -->/{on=0} on && !/^```/' "$repo/README.md")"
if [ -z "$lines" ]; then
  echo "downstream: README.md has no <!-- downstream:begin --> ... <!-- downstream:end --> block" >&2
  exit 1
fi
if ! grep -q 'path = "../memsave"' <<<"$lines"; then
  echo "downstream: README's memsave line no longer says path = \"../memsave\"; update this script" >&2
  exit 1
fi
{
  cat <<'EOF'
[package]
name = "downstream"
version = "0.1.0"
edition = "2021"
publish = false

EOF
  sed "s|path = \"../memsave\"|path = \"$repo\"|" <<<"$lines"
} >"$crate/Cargo.toml"
# The workspace's versions of every crate (a fresh resolution could pick newer ones, and CI would
# compile them again).
cp "$repo/Cargo.lock" "$crate/"

if [ "$fresh" = 1 ]; then
  export CARGO_TARGET_DIR="$work/target"
else
  export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
fi
cd "$crate"
echo "downstream: Cargo.toml"
sed 's/^/  /' Cargo.toml

# 1. The dependency tree.
unwanted='^(tokio|tokio-tungstenite|tokio-util|axum|hyper|tungstenite|burn-collective|memsave-burn-collective|burn-communication|clap|indicatif|plotters|dejavu|image|zip|tar|zstd|roxmltree|burn-vision|burn-store|memsave-models) '
tree="$(cargo tree -e normal,build --prefix none | sed 's/ (\*)//; s/ (proc-macro)//' | sort -u)"
crates="$(awk '{print $1" "$2}' <<<"$tree" | sort -u | wc -l)"
echo "downstream: $crates crates under the library line"
if found="$(grep -E "$unwanted" <<<"$tree")"; then
  echo "downstream: the library line builds crates it did not ask for:" >&2
  echo "$found" >&2
  exit 1
fi
# The same check sees them once they are asked for.
parallel="$(cargo tree -e normal,build --prefix none --features memsave/parallel | sort -u)"
for wanted in tokio memsave-burn-collective; do
  if ! grep -qE "^$wanted " <<<"$parallel"; then
    echo "downstream: with memsave/parallel the tree lacks $wanted" >&2
    exit 1
  fi
done

# 2. Build and run.
start=$SECONDS
cargo build
built=$((SECONDS - start))
echo "downstream: built in ${built} s ($crates crates)"
cargo run --quiet -- "$work/run"
echo "downstream: ok"
