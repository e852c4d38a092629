#!/usr/bin/python3
"""Fetch-engine measurements (issue 9), on bench.py's sources; run as root:

    cargo build --release && python3 bench/fetch.py [--runs 3] [--only seq,random,many,grep]
        [--grep-srcs remote,slow,local] [--grep-variants 'dp0=--fetch-dir-prefetch 0;dp16=']
        [--rtt-ms 20]

Uses bench.py's set-up and tear-down (local dir, throttled loop-device ext4, SSHFS over a
100 Mbit/s shaped veth; with --rtt-ms, ssh runs through tools/delay_relay.py, which adds
that round trip) with a smaller grep tree (/usr/include/linux and c++). Prints a
markdown summary and writes bench/results/fetch-<date>.json. Medians of --runs runs, the
systems interleaved (rotated) run by run.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as B  # noqa: E402

MIB = B.MIB
OUT = []


def rec(what, src, system, value, **extra):
    OUT.append(dict(what=what, src=src, sys=system, value=value, **extra))
    B.log(f"  {what} {src} {system}: {value:.4g} {extra if extra else ''}")


def seq(srcs, variants, names=("slow", "remote", "local")):
    for name in names:
        src = srcs[name]
        f = "seq.bin"
        systems = [("source", None)] + variants
        for r in range(B.P["runs"]):
            for label, extra in B.rotate(systems, r):
                if extra is None:
                    src.refresh()
                    B.drop_caches()
                    rec("seq", name, "source", float(B.bt("seq", os.path.join(src.path, f), MIB)["mib_s"]))
                    continue
                h = B.Hoardfs(label, src, extra)
                h.start(fresh=True)
                mibs = float(B.bt("seq", os.path.join(h.mnt, f), MIB)["mib_s"])
                s1 = h.stats()["cache"]
                B.bt("seq", os.path.join(h.mnt, f), MIB)  # second open: passthrough?
                s2 = h.stats()["cache"]
                rec("seq", name, label, mibs,
                    from_source=s1["bytes_from_source"], prefetched=s1["chunks_prefetched"],
                    early=s1["early_returns"], waits=s1["fetch_waits"], hints=s1["hint_reads"],
                    passthrough_next=s2["passthrough_opens"] - s1["passthrough_opens"])
                h.stop()


def random_reads(srcs, n=200):
    import random
    for name in ("slow", "remote"):
        src = srcs[name]
        for chunk in ("1M", "256K"):
            h = B.Hoardfs(f"hoardfs-c{chunk}", src, ["--chunk-size", chunk])
            h.start(fresh=True)
            p = os.path.join(h.mnt, "seq.bin")
            size = os.path.getsize(p)
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            rnd = random.Random(7)
            t = time.time()
            for _ in range(n):
                os.pread(fd, 4096, rnd.randrange(0, size - 4096) & ~4095)
            el = time.time() - t
            os.close(fd)
            s = h.stats()["cache"]
            cs = (1 << 20) if chunk == "1M" else (256 << 10)
            rec("random4k", name, h.name, s["bytes_from_source"] / n,
                reads=n, chunk=cs, per_read_ms=el / n * 1000, prefetched=s["chunks_prefetched"])
            h.stop()


def many_readers(srcs, k=10):
    for name in ("slow", "remote"):
        src = srcs[name]
        for label, root in (("source", None), ("hoardfs", "m")):
            for r in range(B.P["runs"]):
                if root is None:
                    src.refresh()
                    B.drop_caches()
                    p = os.path.join(src.path, "seq.bin")
                    h = None
                else:
                    h = B.Hoardfs("hoardfs", src)
                    h.start(fresh=True)
                    p = os.path.join(h.mnt, "seq.bin")
                t = time.time()
                procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=1M", "status=none"])
                         for _ in range(k)]
                for q in procs:
                    q.wait()
                el = time.time() - t
                extra = {}
                if h:
                    s = h.stats()["cache"]
                    extra = dict(from_source=s["bytes_from_source"], size=os.path.getsize(p),
                                 waits=s["fetch_waits"])
                    h.stop()
                rec("many", name, label, el, readers=k, **extra)


def grep(srcs, variants, names):
    """Cold grep -r: the source directly (after drop_caches, sshfs remounted) against
    fresh hoardfs mounts; `variants` are (label, extra args)."""
    env = dict(os.environ, LC_ALL="C")
    for name in names:
        src = srcs[name]
        systems = [("source", None)] + variants
        for r in range(B.P["runs"]):
            for label, extra in B.rotate(systems, r):
                if extra is None:
                    src.refresh()
                    B.drop_caches()
                    rec("grep", name, "source", B.timed(B.GREP + [os.path.join(src.path, "tree")], ok=(0, 1), env=env))
                else:
                    h = B.Hoardfs(label, src, extra)
                    h.start(fresh=True)
                    v = B.timed(B.GREP + [os.path.join(h.mnt, "tree")], ok=(0, 1), env=env)
                    s = h.stats()["cache"]
                    rec("grep", name, label, v, from_source=s["bytes_from_source"],
                        whole=s["whole_file_fetches"], dir_prefetched=s.get("dir_prefetch_files"),
                        dir_hits=s.get("dir_prefetch_hits"), dir_dropped=s.get("dir_prefetch_dropped"),
                        open_hits=s["open_hits"], open_misses=s["open_misses"])
                    h.stop()


def summary():
    lines = []
    groups = {}
    for o in OUT:
        groups.setdefault((o["what"], o["src"], o["sys"]), []).append(o)
    for (w, src, sy), rows in groups.items():
        vals = [r["value"] for r in rows]
        extra = {k: v for k, v in rows[-1].items() if k not in ("what", "src", "sys", "value")}
        lines.append(f"| {w} | {src} | {sy} | {statistics.median(vals):.4g} | "
                     f"{min(vals):.4g}–{max(vals):.4g} | {len(vals)} | {extra} |")
    return "\n".join(["| what | source | system | median | spread | runs | last run |",
                      "|---|---|---|---:|---|---:|---|"] + lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="seq,random,many,grep")
    ap.add_argument("--seq-srcs", default="slow,remote,local")
    ap.add_argument("--workers-only", action="store_true",
                    help="seq: compare --fetch-workers 1, 2, 4 only")
    ap.add_argument("--grep-srcs", default="remote,slow,local")
    ap.add_argument("--rtt-ms", type=float, default=0,
                    help="remote: add this round trip to the SSH link (tools/delay_relay.py)")
    ap.add_argument("--grep-variants", default="hoardfs=",
                    help="grep: ';'-separated LABEL=ARGS, e.g. 'dp0=--fetch-dir-prefetch 0;dp16=--fetch-dir-prefetch 16'")
    a = ap.parse_args()
    B.RemoteSource.rtt_ms = a.rtt_ms
    B.P = dict(B.FULL, runs=a.runs, tree=["linux", "c++"], pages_files=4,
               seq={"local": 1024 * MIB, "slow": 512 * MIB, "remote": 64 * MIB})
    B.teardown()
    os.makedirs(B.WORK, exist_ok=True)
    B.LOG = open(os.path.join(B.WORK, "log.txt"), "w")
    only = a.only.split(",")
    try:
        B.sh(["cc", "-O2", "-o", B.BT, os.path.join(B.BENCH, "tools", "bt.c")])
        import shutil
        shutil.copy(B.HOARDFS_BUILT, B.HOARDFS)
        srcs = B.setup_sources()
        load0 = os.getloadavg()
        if "seq" in only and a.workers_only:
            seq(srcs, [(f"hoardfs-{n}workers", ["--fetch-workers", str(n)]) for n in (1, 2, 4)],
                names=a.seq_srcs.split(","))
        elif "seq" in only:
            seq(srcs, [("hoardfs", []),
                       ("hoardfs-w0", ["--fetch-window", "0"]),
                       ("hoardfs-w32", ["--fetch-window", "32"]),
                       ("hoardfs-1worker", ["--fetch-workers", "1"]),
                       ("hoardfs-c256K", ["--chunk-size", "256K"]),
                       ("hoardfs-c4M", ["--chunk-size", "4M"])],
                names=a.seq_srcs.split(","))
        if "random" in only:
            random_reads(srcs)
        if "many" in only:
            many_readers(srcs)
        if "grep" in only:
            variants = []
            for v in a.grep_variants.split(";"):
                label, _, args = v.partition("=")
                variants.append((label, args.split()))
            grep(srcs, variants, a.grep_srcs.split(","))
        meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                    git=B.sh(["git", "-C", B.REPO, "describe", "--always", "--dirty"], check=False).stdout.strip(),
                    load_before=load0, load_after=os.getloadavg(), throttle=B.META.get("throttle"),
                    rtt_ms=a.rtt_ms)
        out = os.path.join(B.BENCH, "results", f"fetch-{datetime.datetime.now():%Y-%m-%d-%H%M%S}.json")
        with open(out, "w") as f:
            json.dump(dict(meta=meta, results=OUT), f, indent=1)
        print(json.dumps(meta))
        print(summary())
    finally:
        B.teardown()


if __name__ == "__main__":
    main()
