#!/usr/bin/python3
"""Object-store benchmark (issue 11): an S3 server on loopback, hoardfs and its peers over
one bucket, side by side in one run. Run through `bench/run --s3` (root):

    bench/run --s3            MinIO, a 1 GiB object and 10,000 small objects, 3 runs
    bench/run --s3 --quick    versitygw (the test suite's server), 64 MiB and 500 objects, 1 run

Workloads, each cold (fresh persistent cache, page cache dropped) and warm (the persistent
cache kept, the daemon remounted, the page cache dropped):
- seq: read the large object from start to end (`bt seq FILE 1MiB`); the baselines are the
  client hoardfs uses (`examples/s3_download.rs`: object_store ranged GETs of 8 MiB), one
  stream and four in flight.
- grep: `grep -r -c` over the prefix of small objects.
Systems: hoardfs, rclone mount (S3 backend, --vfs-cache-mode full), s3fs (use_cache), when
installed. Writes bench/results/s3-<date>-<host>.md and .json.
"""
import argparse
import datetime
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench as B  # noqa: E402

MIB = B.MIB
ACCESS, SECRET = "hoardfsbench", "hoardfsbench-secret"
BUCKET = "bench"
MINIO_PKG = "github.com/minio/minio@v0.0.0-20260212201848-7aac2a2c5b7c"
VERSITYGW_PKG = "github.com/versity/versitygw/cmd/versitygw@v1.8.0"
DOWNLOAD = os.path.join(B.REPO, "target", "release", "examples", "s3_download")
OUT = []
S3 = os.path.join(B.WORK, "s3")
HOARDFS_ARGS = []  # --hoardfs-args


def rec(w, system, state, value, **extra):
    OUT.append(dict(w=w, sys=system, state=state, value=value, **extra))
    B.log(f"  {w} {system} {state}: {value:.4g} {extra if extra else ''}")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def go_binary(name, pkg, env_var):
    """The server binary: $env_var, else ~/go/bin/name, else built there with Go."""
    if os.environ.get(env_var):
        return os.environ[env_var]
    path = os.path.expanduser(f"~/go/bin/{name}")
    if not os.access(path, os.X_OK):
        go = shutil.which("go") or "/usr/local/go/bin/go"
        B.log(f"building {name} with {go} (several minutes the first time)")
        B.sh(["nice", go, "install", pkg], env=dict(os.environ, GOBIN=os.path.dirname(path)))
    return path


class Server:
    """An S3 server on 127.0.0.1, its data under WORK/s3."""

    def __init__(self, kind):
        self.kind, self.port = kind, free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        # In memory: the server stands for another machine, whose disk is not the cache's.
        self.data = "/dev/shm/" + os.path.basename(B.WORK) + "-s3"
        B.rmtree(self.data)
        os.makedirs(self.data, exist_ok=True)
        env = dict(os.environ, MINIO_ROOT_USER=ACCESS, MINIO_ROOT_PASSWORD=SECRET,
                   MINIO_BROWSER="off")
        if kind == "minio":
            cmd = [go_binary("minio", MINIO_PKG, "HOARDFS_MINIO"), "server", "--quiet",
                   "--address", f"127.0.0.1:{self.port}", self.data]
        else:
            cmd = [go_binary("versitygw", VERSITYGW_PKG, "HOARDFS_VERSITYGW"), "--port",
                   f"127.0.0.1:{self.port}", "--access", ACCESS, "--secret", SECRET, "--quiet",
                   "posix", self.data]
        self.log = open(os.path.join(S3, "server.log"), "a")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=self.log)
        for _ in range(300):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited; see {S3}/server.log")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        B.META["server"] = f"{kind} on {self.endpoint} ({os.path.basename(cmd[0])})"
        try:
            self.aws("s3api", "create-bucket", "--bucket", BUCKET)
        except Exception:
            self.stop()
            raise

    def aws(self, *args):
        return B.sh(["aws", "--endpoint-url", self.endpoint, "--region", "us-east-1"]
                    + list(args), env=aws_env())

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        B.rmtree(self.data)


def aws_env():
    return dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS, AWS_SECRET_ACCESS_KEY=SECRET,
                AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true",
                AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null")


def fill_bucket(srv, big, nsmall):
    """big.bin of `big` bytes and small/dNN/fNNNN of 1 to 16 KiB each."""
    stage = os.path.join(S3, "stage")
    B.rmtree(stage)
    os.makedirs(os.path.join(stage, "small"))
    B.write_seq(os.path.join(stage, "big.bin"), big)
    rnd = random.Random(11)
    words = [b"alpha", b"beta", b"gamma", b"delta", b"object", b"bucket", b"cache", b"\n"]
    for i in range(nsmall):
        d = os.path.join(stage, "small", f"d{i // 100:03d}")
        os.makedirs(d, exist_ok=True)
        n = rnd.randint(1024, 16 * 1024)
        with open(os.path.join(d, f"f{i:05d}.txt"), "wb") as f:
            f.write(b" ".join(rnd.choice(words) for _ in range(n // 6))[:n])
    t = time.time()
    srv.aws("s3", "cp", "--recursive", "--only-show-errors", stage, f"s3://{BUCKET}/")
    B.log(f"uploaded {big >> 20} MiB + {nsmall} objects in {time.time() - t:.1f}s")
    B.rmtree(stage)


class Mount:
    """One system's mount of the bucket; cold = fresh persistent cache."""
    name = "?"

    def __init__(self, srv):
        self.srv = srv
        self.base = os.path.join(S3, "sys", self.name)
        self.mnt, self.cache = os.path.join(self.base, "mnt"), os.path.join(self.base, "cache")
        self.proc = None

    def start(self, fresh):
        self.stop()
        if fresh:
            B.rmtree(self.cache)
        os.makedirs(self.mnt, exist_ok=True)
        os.makedirs(self.cache, exist_ok=True)
        B.drop_caches()
        self.mount()
        B.wait_mounted(self.mnt, proc=self.proc)

    def stop(self):
        B.umount(self.mnt)
        for pid in B.pids_of_mount(self.mnt):  # daemons exit on unmount; wait for them
            for _ in range(100):
                if not os.path.exists(f"/proc/{pid}"):
                    break
                time.sleep(0.05)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def note(self):
        return {}


class Hoardfs(Mount):
    name = "hoardfs"

    def mount(self):
        B.mount_cmd([B.HOARDFS, f"s3://{BUCKET}", self.mnt, "--cache-dir", self.cache,
                     "--s3-endpoint", self.srv.endpoint] + HOARDFS_ARGS,
                    os.path.join(self.base, "mount.log"))

    def note(self):
        s = json.loads(B.sh([B.HOARDFS, "stats", self.mnt, "--json"], env=aws_env()).stdout)
        c = s["cache"]
        return dict(from_source=c["bytes_from_source"], prefetched=c["chunks_prefetched"])


class Rclone(Mount):
    name = "rclone"

    def mount(self):
        log = open(os.path.join(self.base, "rclone.log"), "a")
        self.proc = subprocess.Popen(
            ["rclone", "mount", f":s3:{BUCKET}", self.mnt, "--config", "/dev/null",
             "--s3-provider", "Other", "--s3-endpoint", self.srv.endpoint,
             "--s3-access-key-id", ACCESS, "--s3-secret-access-key", SECRET,
             "--vfs-cache-mode", "full", "--cache-dir", self.cache,
             "--vfs-cache-max-age", "24h", "--dir-cache-time", "5m"],
            stdout=log, stderr=log,
            # rclone 1.60's S3 client cannot take a CA bundle (and needs none over http).
            env={k: v for k, v in os.environ.items() if k != "AWS_CA_BUNDLE"})


class S3fs(Mount):
    name = "s3fs"

    def mount(self):
        pw = os.path.join(self.base, "passwd")
        with open(pw, "w") as f:
            f.write(f"{ACCESS}:{SECRET}\n")
        os.chmod(pw, 0o600)
        B.mount_cmd(["s3fs", BUCKET, self.mnt, "-o",
                     f"url={self.srv.endpoint},use_path_request_style,passwd_file={pw},"
                     f"use_cache={self.cache}"],
                    os.path.join(self.base, "mount.log"))


SYSTEMS = set()  # --systems; empty: all installed


def systems(srv):
    out = [Hoardfs(srv)]
    if shutil.which("rclone"):
        out.append(Rclone(srv))
    if shutil.which("s3fs"):
        out.append(S3fs(srv))
    return [m for m in out if not SYSTEMS or m.name in SYSTEMS]


def download(srv, parallel, to_file):
    """The baseline client's speed; to_file: into a file beside the caches (a download
    stores what it reads, as the cache does), else the bytes are dropped."""
    out = os.path.join(S3, "download.bin")
    B.rmtree(out)
    B.drop_caches()
    r = B.sh([DOWNLOAD, "--endpoint", srv.endpoint, f"s3://{BUCKET}/big.bin", "--parallel",
              str(parallel), "--part", str(8 * MIB)] + (["--out", out] if to_file else []),
             env=aws_env())
    B.rmtree(out)
    return json.loads(r.stdout)["mib_per_s"]


BASELINES = [("download to a file, 1 stream", 1, True),
             ("download to a file, 4 in flight", 4, True),
             ("GETs dropped, 4 in flight", 4, False)]


def seq(srv, runs):
    sys_ = systems(srv)
    for r in range(runs):
        for name, parallel, to_file in BASELINES:
            rec("seq", name, "-", download(srv, parallel, to_file))
        for m in B.rotate(sys_, r):
            for state in ("cold", "warm"):
                m.start(fresh=state == "cold")
                mibs = float(B.bt("seq", os.path.join(m.mnt, "big.bin"), MIB)["mib_s"])
                rec("seq", m.name, state, mibs, **m.note())
                m.stop()
            if isinstance(m, Hoardfs):
                # The local disk's speed, which a warm read by passthrough should reach.
                B.drop_caches()
                data = os.path.join(m.cache, "data", "big.bin")
                rec("seq", "the cache file, read directly", "-",
                    float(B.bt("seq", data, MIB)["mib_s"]))


def grep(srv, runs, nsmall):
    cmd = ["grep", "-r", "-c", "hoardfs_no_such_string_zq"]
    sys_ = systems(srv)
    for r in range(runs):
        for m in B.rotate(sys_, r):
            for state in ("cold", "warm"):
                m.start(fresh=state == "cold")
                t0 = time.perf_counter()
                out = B.sh(cmd + [os.path.join(m.mnt, "small")], check=False)
                secs = time.perf_counter() - t0
                # One line per file read: a mount that lost objects must not look fast.
                files = out.stdout.count("\n")
                if files != nsmall:
                    raise RuntimeError(f"grep over {m.name} saw {files} files, not {nsmall}: "
                                       f"{out.stderr[-500:]}")
                rec("grep", m.name, state, secs, **m.note())
                m.stop()


def med(w, system, state):
    v = [o["value"] for o in OUT if (o["w"], o["sys"], o["state"]) == (w, system, state)]
    return statistics.median(v) if v else None


def report(quick, big, nsmall, elapsed):
    stamp = datetime.datetime.now().strftime("%Y-%m-%d")
    stem = os.path.join(B.RESULTS_DIR, f"s3-{stamp}-{socket.gethostname()}" + ("-quick" if quick else ""))
    os.makedirs(B.RESULTS_DIR, exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=B.META, results=OUT), f, indent=1)
    one, ref = (med("seq", b[0], "-") for b in BASELINES[:2])
    L = [f"# hoardfs over an S3 server ({'quick' if quick else 'full'})", "",
         f"{datetime.datetime.now():%Y-%m-%d %H:%M}, {B.META.get('machine', '')}; "
         f"{B.META.get('server', '')}; hoardfs {B.META.get('hoardfs', '')}; "
         f"{B.P['runs']} run(s), medians; {elapsed:.0f} s.", "",
         f"## seq: reading a {big >> 20} MiB object (MiB/s, higher is better)", "",
         "Baselines: the client hoardfs uses (object_store, `examples/s3_download.rs`), "
         "ranged GETs of 8 MiB, written at their offsets into a file on the caches' disk "
         "(as a download, and the cache, store what they read) or dropped. The server keeps "
         "its data in memory (it stands for another machine). Cold: empty persistent cache; "
         "warm: the cache kept, the daemon remounted; the page cache is dropped before every "
         "reading.", "",
         "| system | state | MiB/s | / download, 1 stream | / download, 4 in flight | "
         "bytes from the store |",
         "|---|---|---:|---:|---:|---:|"]
    for system, state in [(b[0], "-") for b in BASELINES] + [
            (m, s) for m in ("hoardfs", "rclone", "s3fs") for s in ("cold", "warm")] + [
            ("the cache file, read directly", "-")]:
        v = med("seq", system, state)
        if v is None:
            continue
        src = [o.get("from_source") for o in OUT
               if (o["w"], o["sys"], o["state"]) == ("seq", system, state) and "from_source" in o]
        L.append(f"| {system} | {state} | {v:.0f} | {v / one:.2f} | {v / ref:.2f} | "
                 f"{src[-1] if src else ''} |")
    L += ["", f"## grep: `grep -r -c` over {nsmall} objects of 1-16 KiB (seconds, lower is better)",
          "", "| system | cold | warm |", "|---|---:|---:|"]
    for system in ("hoardfs", "rclone", "s3fs"):
        c, w = med("grep", system, "cold"), med("grep", system, "warm")
        if c is not None:
            L.append(f"| {system} | {c:.2f} | {w:.2f} |")
    if B.EXTRA.get("failed"):
        L += ["", "## Failed", ""] + [f"- {x}" for x in B.EXTRA["failed"]]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(L) + "\n")
    B.log(f"report: {stem}.md")
    print("\n".join(L))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--s3", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int)
    ap.add_argument("--server", choices=["minio", "versitygw"],
                    help="default: minio, versitygw with --quick")
    ap.add_argument("--only", default="", help="seq,grep")
    ap.add_argument("--systems", default="", help="hoardfs,rclone,s3fs (default: all installed)")
    ap.add_argument("--hoardfs-args", default="", help="extra mount options, e.g. '-o chunk_size=8M'")
    a = ap.parse_args()
    HOARDFS_ARGS.extend(a.hoardfs_args.split())
    # The mounts and the client take the server's keys from the environment.
    os.environ.update(aws_env())
    if a.systems:
        SYSTEMS.update(a.systems.split(","))
    B.P = dict(B.QUICK if a.quick else B.FULL)
    if a.runs:
        B.P["runs"] = a.runs
    big, nsmall = (64 * MIB, 500) if a.quick else (1024 * MIB, 10000)
    B.teardown()
    os.makedirs(S3, exist_ok=True)
    B.LOG = open(os.path.join(B.WORK, "log.txt"), "w")
    t0 = time.time()
    srv = None
    try:
        B.sh(["cc", "-O2", "-o", B.BT, os.path.join(B.BENCH, "tools", "bt.c")])
        shutil.copy(B.HOARDFS_BUILT, B.HOARDFS)
        B.META["machine"] = f"{os.cpu_count()} cores, Linux {os.uname().release}"
        B.META["hoardfs"] = B.sh(["git", "-C", B.REPO, "describe", "--always", "--dirty"],
                                 check=False).stdout.strip()
        srv = Server(a.server or ("versitygw" if a.quick else "minio"))
        fill_bucket(srv, big, nsmall)
        only = set(a.only.split(",")) if a.only else {"seq", "grep"}
        for name, fn in [("seq", lambda: seq(srv, B.P["runs"])),
                         ("grep", lambda: grep(srv, B.P["runs"], nsmall))]:
            if name not in only:
                continue
            B.log("=== workload", name)
            try:
                fn()
            except Exception as e:
                B.log(f"workload {name} FAILED: {e}")
                B.EXTRA.setdefault("failed", []).append(f"{name}: {str(e)[:300]}")
                for mp in B.mounts_under(os.path.join(S3, "sys")):
                    B.umount(mp)
        report(a.quick, big, nsmall, time.time() - t0)
    finally:
        for mp in B.mounts_under(S3):
            B.umount(mp)
        if srv:
            srv.stop()
        B.teardown()
    if B.EXTRA.get("failed"):
        sys.exit(f"bench: {len(B.EXTRA['failed'])} workload(s) failed (see the report)")


if __name__ == "__main__":
    main()
