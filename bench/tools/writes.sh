#!/bin/bash
# bench/tools/writes.sh: the write-heavy rows of issue 22 in a few minutes, side by side.
#
#   sudo bench/tools/writes.sh ROUNDS TARBALL HOARDFS_BIN... [peer:NAME=COMMAND]...
#
# For each round, interleaved: native (a directory on the same file system), bindfs, then
# each hoardfs binary given (a fresh mount with a fresh cache each time). Each system runs
# Postmark (2,000 files of 512 B-10 KB, 5,000 transactions, seed 42), then an untar of
# TARBALL into it and an `rm -rf` of what was unpacked; the page cache is dropped before
# each; then a sequential write of 1 GiB in 1 MiB writes (`dd ... conv=fsync`, so durable
# on the source for every system). Native times include a `sync -f` (the mounts write
# through to the source before each request returns). Prints one line per run and the
# medians; for hoardfs also the daemon's CPU seconds. Works in $HOARDFS_WRITES_DIR (default /var/tmp/hoardfs-writes),
# which must be on the file system to measure; removes it at the end. A `peer:NAME=COMMAND`
# argument adds a reference daemon without a cache, mounted as `COMMAND SRC MNT` (the floor
# a FUSE daemon sets here, e.g. libfuse's passthrough_hp; docs/performance.md, session 31).
set -euo pipefail
ROUNDS=$1; TAR=$2; shift 2
W=${HOARDFS_WRITES_DIR:-/var/tmp/hoardfs-writes}
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
now() { date +%s.%N; }
cpu_of() { # CPU seconds of the daemon serving mount $1
  local pid; pid=$(pgrep -f -- " $1( |$)" | head -1) || { echo "?"; return; }
  local t=0; for f in /proc/"$pid"/task/*/stat; do t=$((t + $(awk '{print $14+$15}' "$f"))); done
  echo "scale=2; $t/$(getconf CLK_TCK)" | bc
}
fresh() { # fresh() SYSTEM: sets LOC (where to work) for a new empty source and mount
  umount "$W/mnt" 2>/dev/null || true
  rm -rf "$W"; mkdir -p "$W/src" "$W/cache" "$W/mnt"
  case $1 in
    native) LOC=$W/src ;;
    bindfs) bindfs "$W/src" "$W/mnt"; LOC=$W/mnt ;;
    peer:*) # word splitting of COMMAND is wanted: a program and its options
      # shellcheck disable=SC2086
      ${1#peer:*=} "$W/src" "$W/mnt"
      for _ in $(seq 100); do mountpoint -q "$W/mnt" && break; sleep 0.05; done
      LOC=$W/mnt ;;
    *) "$1" "$W/src" "$W/mnt" --cache-dir "$W/cache"; LOC=$W/mnt ;;
  esac
}
finish() { # finish() SYSTEM: the daemon's CPU, then unmount
  CPU=-; case $1 in native|bindfs) ;; *) CPU=$(cpu_of "$W/mnt") ;; esac
  [ "$1" = native ] || umount "$W/mnt"
}
elapsed() { echo "$2 - $1" | bc; }
results=$(mktemp)
trap 'umount "$W/mnt" 2>/dev/null || true; rm -rf "$W" "$results"' EXIT
for r in $(seq "$ROUNDS"); do
  for sys in native bindfs "$@"; do
    case $sys in peer:*) name=${sys#peer:}; name=${name%%=*} ;; *) name=$(basename "$sys") ;; esac
    fresh "$sys"
    printf 'set location %s\nset number 2000\nset transactions 5000\nset size 512 10000\nset seed 42\nrun\nquit\n' "$LOC" > "$W/pm.cfg"
    drop; s=$(now); postmark "$W/pm.cfg" > /dev/null; [ "$sys" = native ] && sync -f "$W/src"; e=$(now)
    finish "$sys"; echo "$name postmark $(elapsed "$s" "$e") cpu $CPU" | tee -a "$results"
    fresh "$sys"
    drop; s=$(now); tar -xf "$TAR" -C "$LOC"; [ "$sys" = native ] && sync -f "$W/src"; e=$(now)
    drop; s2=$(now); rm -rf "${LOC:?}"/*; [ "$sys" = native ] && sync -f "$W/src"; e2=$(now)
    finish "$sys"
    echo "$name untar $(elapsed "$s" "$e") cpu $CPU" | tee -a "$results"
    echo "$name rm-rf $(elapsed "$s2" "$e2") cpu -" | tee -a "$results"
    fresh "$sys"
    drop; s=$(now); dd if=/dev/zero of="$LOC/big" bs=1M count=1024 conv=fsync status=none; e=$(now)
    finish "$sys"
    echo "$name seq-1g $(elapsed "$s" "$e") cpu $CPU" | tee -a "$results"
  done
done
echo "medians (seconds; ratio to native in brackets):"
python3 - "$results" <<'PY'
import sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    name, row, t, _, _ = line.split()
    runs[(row, name)].append(float(t))
med = lambda v: sorted(v)[len(v) // 2]
for row in ("postmark", "untar", "rm-rf", "seq-1g"):
    base = med(runs[(row, "native")])
    cells = [f"{n} {med(v):.2f} ({med(v) / base:.1f}x)" for (r, n), v in runs.items() if r == row]
    print(f"  {row:9s} " + ", ".join(cells))
PY
