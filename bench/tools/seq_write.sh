#!/bin/bash
# bench/tools/seq_write.sh: issue 22's 1 GiB write, and the cache's fill after it.
#
#   sudo bench/tools/seq_write.sh ROUNDS HOARDFS_BIN [HOARDFS_OPTION...]
#
# Each round, interleaved: a native `dd if=/dev/zero bs=1M count=1024 conv=fsync` into a
# directory, then the same into a fresh hoardfs mount (empty source and cache) with the
# options given, after `drop_caches`. For hoardfs it then polls `hoardfs stats` every
# 0.5 s until `chunks_filled_behind` stops moving (with --source-writes the cache is
# filled after the writer's close) and prints how long that took and the daemon's CPU
# seconds during the dd and in all. Works in $HOARDFS_SEQ_DIR (default
# /var/tmp/hoardfs-seq), which must be on the file system to measure; removes it at the end.
set -euo pipefail
ROUNDS=$1; BIN=$2; shift 2
W=${HOARDFS_SEQ_DIR:-/var/tmp/hoardfs-seq}
now() { date +%s.%N; }
cpu() { local t=0; for f in /proc/"$1"/task/*/stat; do t=$((t + $(awk '{print $14+$15}' "$f"))); done
        echo "scale=2; $t/$(getconf CLK_TCK)" | bc; }
filled() { "$BIN" stats --json "$W/mnt" |
           python3 -c 'import json,sys; print(json.load(sys.stdin)["cache"]["chunks_filled_behind"])'; }
trap 'umount "$W/mnt" 2>/dev/null; rm -rf "$W"' EXIT
for r in $(seq "$ROUNDS"); do
  rm -rf "$W"; mkdir -p "$W/native"; sync; echo 3 > /proc/sys/vm/drop_caches
  s=$(now); dd if=/dev/zero of="$W/native/big" bs=1M count=1024 conv=fsync status=none; e=$(now)
  echo "native dd $(echo "$e - $s" | bc)"
  rm -rf "$W"; mkdir -p "$W/src" "$W/cache" "$W/mnt"
  "$BIN" "$W/src" "$W/mnt" --cache-dir "$W/cache" "$@"
  pid=$(pgrep -f -- " $W/mnt " | head -1)
  sync; echo 3 > /proc/sys/vm/drop_caches
  s=$(now); dd if=/dev/zero of="$W/mnt/big" bs=1M count=1024 conv=fsync status=none; e=$(now)
  during=$(cpu "$pid"); last=-1; f=$(filled)
  for _ in $(seq 60); do [ "$f" = "$last" ] && break; last=$f; sleep 0.5; f=$(filled); done
  done_at=$(now)
  echo "hoardfs $* dd $(echo "$e - $s" | bc) cpu_dd $during chunks_filled_behind $f" \
       "settled_after $(echo "$done_at - $e" | bc) cpu_all $(cpu "$pid")"
  umount "$W/mnt"
done
