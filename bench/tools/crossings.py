#!/usr/bin/env python3
"""bench/tools/crossings.py: issue 23's small-file rows with the requests behind them.

    sudo bench/tools/crossings.py TREE [GIT_CHECKOUT] [--rounds N] [--ops walk,...]
                                  [--variants default,ko,kd] [--bin HOARDFS]...
                                  [--peer NAME=COMMAND]... [--cache-root DIR]

For each round, systems interleaved: native (TREE read directly), bindfs, and each
hoardfs binary given (default target/release/hoardfs), once with its defaults and once
with --kernel-opens (`--variants`: also kd, --kernel-dir-opens). For each operation (stat walk, ReadAll, `grep -r` with no match,
and `git status` in a copy of GIT_CHECKOUT) a fresh mount with an empty cache, then:

  cold  caches dropped (for hoardfs: the persistent cache empty)
  warm  caches dropped again, same mount (the persistent cache full)
  hot   at once again
  again at once once more: the steady state of a hot tree (the hot pass after a warm one
        also refreshes the attributes the warm pass's reads through the daemon left
        stale: the kernel drops a file's atime after every read a daemon serves)

`git status` has no cold row: the first run on a mount refreshes the index (the mount's
inode numbers are not the source's), so it runs once untimed first. Prints, per
operation, phase and system, the median time, its ratio to native in the same rounds,
and for hoardfs the requests that reached the daemon (`hoardfs stats --json` deltas, the
Coda Table 2 count) in the last round. `--peer NAME=COMMAND` adds a reference daemon
without a cache, mounted as `COMMAND SRC MNT` (for the floor a FUSE daemon sets here,
e.g. libfuse's passthrough_hp built beside the project; see docs/performance.md,
session 31). Needs `bt` (built here from bench/tools/bt.c) and
bindfs. Works in $CROSSINGS_DIR (default /var/tmp/hoardfs-crossings), which it removes.
`--cache-root DIR` puts hoardfs's cache in DIR/cache instead (on a file system of its own,
docs/performance.md, session 32; removed at the end).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORK = os.environ.get("CROSSINGS_DIR", "/var/tmp/hoardfs-crossings")
BT = os.path.join(WORK, "bt")
OPS = ["walk", "readall", "grep", "git"]


def sh(*args, **kw):
    return subprocess.run(args, check=True, **kw)


def drop():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def run_op(op, where):
    """Runs `op` in `where`; returns seconds."""
    t = time.monotonic()
    if op in ("walk", "readall"):
        sh(BT, op, where, stdout=subprocess.DEVNULL)
    elif op == "grep":
        # No match: every byte of every file is read. Exit 1 is "no match".
        r = subprocess.run(["grep", "-r", "-c", "zq9xj-no-such-text", where],
                           stdout=subprocess.DEVNULL)
        assert r.returncode in (0, 1), r
    else:
        sh("git", "-C", where, "status", "--porcelain", stdout=subprocess.DEVNULL)
    return time.monotonic() - t


def stats(mnt, binary):
    out = subprocess.run([binary, "stats", mnt, "--json"], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)["requests"]


def wait_mounted(mnt):
    # A peer that daemonizes may return before its mount is there.
    for _ in range(100):
        if os.path.ismount(mnt):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{mnt}: not mounted")


def delta(a, b):
    return {k: b[k] - a.get(k, 0) for k in b if b[k] - a.get(k, 0)}


class System:
    def __init__(self, name, binary=None, extra=(), peer=None):
        self.name, self.binary, self.extra, self.peer = name, binary, list(extra), peer

    def mount(self, src, mnt, cache):
        if self.name == "native":
            return src
        os.makedirs(mnt, exist_ok=True)
        if self.name == "bindfs":
            sh("bindfs", src, mnt)
        elif self.peer:
            sh(*self.peer.split(), src, mnt)
            wait_mounted(mnt)
        else:
            shutil.rmtree(cache, ignore_errors=True)
            os.makedirs(cache)
            sh(self.binary, src, mnt, "--cache-dir", cache, *self.extra)
        return mnt

    def unmount(self, mnt):
        if self.name != "native":
            sh("umount", mnt)

    def counts(self, mnt):
        return stats(mnt, self.binary) if self.binary else None


def measure(system, op, tree, git_tree, cache):
    """One fresh mount (hoardfs's cache in `cache`): {phase: (seconds, requests or None)}."""
    src = os.path.join(WORK, "git", system.name) if op == "git" else tree
    mnt = os.path.join(WORK, "mnt")
    where = system.mount(src, mnt, cache)
    out = {}
    try:
        if op == "git":
            run_op(op, where)  # refreshes the index for this mount's inode numbers
        for phase in (["warm", "hot", "again"] if op == "git" else ["cold", "warm", "hot", "again"]):
            if phase in ("cold", "warm"):
                drop()
            before = system.counts(mnt)
            secs = run_op(op, where)
            after = system.counts(mnt)
            out[phase] = (secs, delta(before, after) if before is not None else None)
    finally:
        system.unmount(mnt)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("tree")
    p.add_argument("git_checkout", nargs="?")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bin", action="append", default=[])
    p.add_argument("--peer", action="append", default=[], metavar="NAME=COMMAND",
                   help="a reference daemon without a cache, mounted as COMMAND SRC MNT")
    p.add_argument("--ops", default=",".join(OPS), help="of: " + ", ".join(OPS))
    p.add_argument("--variants", default="default,ko",
                   help="hoardfs mounts: default, ko (--kernel-opens), kd (--kernel-dir-opens)")
    p.add_argument("--cache-root", metavar="DIR",
                   help="hoardfs's cache in DIR/cache (e.g. a file system of its own)")
    a = p.parse_args()
    cache = os.path.join(a.cache_root or WORK, "cache")
    bins = a.bin or [os.path.join(ROOT, "target/release/hoardfs")]
    os.makedirs(WORK, exist_ok=True)
    sh("cc", "-O2", "-o", BT, os.path.join(HERE, "bt.c"))
    systems = [System("native"), System("bindfs")]
    for peer in a.peer:
        name, _, command = peer.partition("=")
        systems.append(System(name, peer=command))
    variants = {"default": ("hoardfs", []), "ko": ("hoardfs-ko", ["--kernel-opens"]),
                "kd": ("hoardfs-kd", ["--kernel-dir-opens"])}
    for i, b in enumerate(bins):
        tag = "" if len(bins) == 1 else str(i + 1)
        for v in a.variants.split(","):
            name, extra = variants[v]
            systems.append(System(name + tag, b, extra))
    ops = [op for op in a.ops.split(",") if op != "git" or a.git_checkout]
    if a.git_checkout:
        os.makedirs(os.path.join(WORK, "git"), exist_ok=True)
        for s in systems:  # git keeps inode numbers in its index: a copy for each
            dst = os.path.join(WORK, "git", s.name)
            shutil.rmtree(dst, ignore_errors=True)
            sh("cp", "-a", a.git_checkout, dst)
    times, last = {}, {}
    try:
        for r in range(a.rounds):
            for op in ops:
                for s in systems:
                    for phase, (secs, req) in measure(s, op, a.tree, a.git_checkout, cache).items():
                        times.setdefault((op, phase, s.name), []).append(secs)
                        last[(op, phase, s.name)] = req
                        print(f"round {r + 1} {op} {phase} {s.name} {secs:.3f} s",
                              file=sys.stderr, flush=True)
        print("| operation | phase | system | median s | spread | × native | requests (last round) |")
        print("|---|---|---|---:|---|---:|---|")
        for (op, phase, name), ts in times.items():
            med = statistics.median(ts)
            nat = statistics.median(times[(op, phase, "native")])
            req = last[(op, phase, name)]
            req = ", ".join(f"{k} {v}" for k, v in sorted(req.items(), key=lambda kv: -kv[1])) \
                if req is not None else ""
            print(f"| {op} | {phase} | {name} | {med:.3f} | {min(ts):.3f}–{max(ts):.3f} "
                  f"| {med / nat:.2f} | {req} |")
    finally:
        subprocess.run(["umount", os.path.join(WORK, "mnt")], stderr=subprocess.DEVNULL)
        shutil.rmtree(WORK, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
