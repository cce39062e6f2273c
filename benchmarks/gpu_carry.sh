#!/usr/bin/env bash
# Cuts ../shared/gpu/prepare.sh's bundle (.gpu/c1 .. .gpu/cN) again into folders that each fit one device call
# beside this working tree: a call carries the tree (tracked and untracked files that git does not ignore) and the
# carried folder, 64 MiB in all, and prepare.sh's 60 MiB parts leave too little room once the tree passes 4 MiB.
# usage: bash benchmarks/gpu_carry.sh   (then calls 1..N of benchmarks/README.md's "On the GPU machine")
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
folders=$(ls -d .gpu/c* 2>/dev/null | sort -V) || true
[ -n "$folders" ] || { echo "gpu_carry: no .gpu/c1: run bash ../shared/gpu/prepare.sh first" >&2; exit 1; }
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- | tail -1 | cut -f1)
part=$(( (64 << 20) - tree - (2 << 20) ))  # 2 MiB to spare
[ "$part" -ge $((4 << 20)) ] || { echo "gpu_carry: the working tree ($tree bytes) leaves no room to carry" >&2; exit 1; }
for f in $folders; do ls "$f"/part.* | sort; done | xargs cat > .gpu/bundle.tar
rm -rf $folders
(cd .gpu && split -b "$part" -d -a 3 bundle.tar part. && rm bundle.tar)
n=0
for p in $(ls .gpu/part.* | sort); do n=$((n + 1)); mkdir .gpu/c$n; mv "$p" .gpu/c$n/; done
echo "gpu_carry: $n folders of at most $((part >> 20)) MiB beside a tree of $((tree >> 20)) MiB: .gpu/c1 .. .gpu/c$n"
