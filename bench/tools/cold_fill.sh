#!/bin/bash
# bench/tools/cold_fill.sh: a cold ReadAll of a tree, with hoardfs's cache on several file
# systems, beside native and bindfs: what a cold fill costs the cache's file system.
#
#   sudo bench/tools/cold_fill.sh ROUNDS TREE HOARDFS_BIN [HOARDFS_OPTION...]
#
# Each round, interleaved, after `drop_caches`: `bt readall` of TREE itself, through
# bindfs, and through a fresh hoardfs mount (empty cache) with its cache
#   disk    beside the work directory ($HOARDFS_COLD_DIR, default /var/tmp/hoardfs-cold)
#   ext4j   on a new ext4 with a journal (mkfs.ext4's default) on zram0, made for the run
#   ext4nj  the same without a journal (as this VM's root file system)
#   tmpfs   in memory (no file system work to speak of: not a persistent cache)
# and prints the seconds and, for hoardfs, the daemon's CPU seconds. The zram rows show
# what the cache's file system costs without any disk; they are skipped where zram0 is
# missing or in use. Removes what it made at the end.
set -euo pipefail
ROUNDS=$1; TREE=$2; BIN=$3; shift 3
W=${HOARDFS_COLD_DIR:-/var/tmp/hoardfs-cold}
HERE=$(cd "$(dirname "$0")" && pwd)
M=$W/mnt; Z=$W/zram
ZRAM=/sys/block/zram0
mkdir -p "$M" "$Z"
cc -O2 -o "$W/bt" "$HERE/bt.c"
where=(disk tmpfs)
if [ -e "$ZRAM" ] && [ "$(cat "$ZRAM/disksize")" = 0 ]; then where=(disk ext4j ext4nj tmpfs); fi
cleanup() {
  umount "$M" 2>/dev/null || true
  umount "$Z" 2>/dev/null || true
  # zram0 is reset only if this run took it (it was unused at the start).
  if [ "${#where[@]}" = 4 ]; then echo 1 > "$ZRAM/reset" 2>/dev/null || true; fi
  rm -rf "$W"
}
trap cleanup EXIT

timed() { # seconds of one cold ReadAll of $1
  sync; echo 3 > /proc/sys/vm/drop_caches
  local s; s=$(date +%s.%N); "$W/bt" readall "$1" >/dev/null
  echo "$(date +%s.%N) - $s" | bc
}
cache_fs() { # a fresh file system of kind $1 at $Z; prints the cache directory to use
  umount "$Z" 2>/dev/null || true
  case $1 in
    disk) rm -rf "$W/cache"; echo "$W/cache"; return;;
    tmpfs) mount -t tmpfs -o size=4g,mode=0700 tmpfs "$Z";;
    ext4j|ext4nj)
      echo 1 > "$ZRAM/reset"; echo 4G > "$ZRAM/disksize"
      if [ "$1" = ext4j ]; then mkfs.ext4 -q /dev/zram0; else mkfs.ext4 -q -O ^has_journal /dev/zram0; fi
      mount /dev/zram0 "$Z";;
  esac
  echo "$Z/cache"
}
for r in $(seq "$ROUNDS"); do
  echo "round $r native $(timed "$TREE")"
  bindfs "$TREE" "$M"; echo "round $r bindfs $(timed "$M")"; umount "$M"
  for w in "${where[@]}"; do
    C=$(cache_fs "$w"); mkdir -p "$C"
    "$BIN" "$TREE" "$M" --cache-dir "$C" "$@"
    pid=$(pgrep -n -f -- " $M --cache-dir")
    secs=$(timed "$M")
    cpu=$(awk -v t="$(getconf CLK_TCK)" '{printf "%.2f", ($14 + $15) / t}' "/proc/$pid/stat")
    echo "round $r hoardfs-$w $secs cpu $cpu"
    umount "$M"
    while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done # the cache's fs is busy till then
  done
done
