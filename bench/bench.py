#!/usr/bin/python3
"""hoardfs benchmark driver (called by bench/run; needs root, see bench/README.md).

Sets up three sources (local dir, throttled loop-device ext4, SSHFS over a shaped veth into
a network namespace), mounts each system under test over them one at a time, runs the
workloads with the systems interleaved, writes bench/results/<date>-<host>.md plus plots,
and tears everything down (also on failure or signal).
"""
import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
# Where reports and plots go (the test suite's smoke run points this at a scratch dir).
RESULTS_DIR = os.environ.get("HOARDFS_BENCH_RESULTS", os.path.join(BENCH, "results"))
WORK = os.environ.get("HOARDFS_BENCH_WORK", "/var/tmp/hoardfs-bench")
HOARDFS_BUILT = os.path.join(REPO, "target", "release", "hoardfs")
CATFS_NOTE = "/var/tmp/hoardfs-bench-catfs.txt"  # bench/run's memo of its catfs attempt
HOARDFS = os.path.join(WORK, "hoardfs")  # a copy: others may rebuild target/ during a run
BT = os.path.join(WORK, "bt")
NETNS = "hbench"
VETH_HOST, VETH_NS = "hbv0", "hbv1"
ADDR_HOST, ADDR_NS = "198.18.0.1", "198.18.0.2"  # RFC 2544 benchmarking range, local only
RATE = "100mbit"
SLOW_RBPS = 80 * 1024 * 1024  # slow disk: 80 MiB/s ...
SLOW_RIOPS = 2000  # ... and 2,000 read IOPS
CG_V1 = "/sys/fs/cgroup/blkio/hoardfs-bench"
CG_V2 = "/sys/fs/cgroup/hoardfs-bench"
MIB = 1 << 20

QUICK = dict(runs=1, seq={"local": 32 * MIB, "slow": 32 * MIB, "remote": 16 * MIB},
             bs=[4096, 131072, MIB], pread_n=2000, pages_files=40, pages_size=MIB,
             pages_rounds=2, tree=["linux"], andrew_versions=["lua-5.4.9"], make_files=4,
             pm_files=200, pm_tx=500, sym_n=500, meta_files=2000)
FULL = dict(runs=3, seq={"local": 1024 * MIB, "slow": 512 * MIB, "remote": 64 * MIB},
            bs=[4096, 131072, MIB], pread_n=100000, pages_files=500, pages_size=MIB,
            pages_rounds=20, tree=None, andrew_versions=None, make_files=None,
            pm_files=10000, pm_tx=20000, sym_n=10000, meta_files=100000)

P = None  # parameters in force
LOG = None


def log(*a):
    msg = time.strftime("%H:%M:%S ") + " ".join(str(x) for x in a)
    print(msg, flush=True)
    if LOG:
        LOG.write(msg + "\n")
        LOG.flush()


def sh(cmd, check=True, quiet=False, **kw):
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"command failed ({r.returncode}): {cmd}\n{r.stdout}\n{r.stderr}")
    return r


def mount_cmd(cmd, logpath):
    """Run a mount command that daemonizes; its output goes to a log file, not a pipe the
    daemon would keep open."""
    with open(logpath, "a") as lf:
        r = subprocess.run(cmd, stdout=lf, stderr=lf, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise RuntimeError(f"{cmd} exited {r.returncode}; see {logpath}")


def drop_caches(level=3):
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(str(level))


def mounts_under(prefix):
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == prefix or mp.startswith(prefix + "/"):
                out.append(mp)
    return sorted(out, key=len, reverse=True)


def is_mounted(path):
    return path in mounts_under(path)


def umount(path):
    for _ in range(50):
        if not is_mounted(path):
            return
        r = sh(["umount", path], check=False)
        if r.returncode != 0:
            time.sleep(0.2)
    if is_mounted(path):
        sh(["umount", "-l", path], check=False)


def wait_mounted(path, timeout=30, proc=None):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if is_mounted(path):
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mount of {path} exited with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"{path} not mounted after {timeout}s")


def pids_of_mount(mnt):
    """Daemon pids whose command line names this mount point (processes we started)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if mnt.encode() in args:
            out.append(int(d))
    return out


def proc_status(pid, key):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rmtree(p):
    if os.path.lexists(p):
        sh(["rm", "-rf", "--one-file-system", p], check=False)


# ---------------------------------------------------------------------------------------
# tear-down: idempotent, works from any partial state
# ---------------------------------------------------------------------------------------

def teardown():
    if not os.path.isdir(WORK):
        return
    for mp in mounts_under(WORK):
        umount(mp)
    # processes we started that may survive an unmount (rclone, sshfs's ssh, sshd)
    pidfile = os.path.join(WORK, "remote", "ssh", "sshd.pid")
    if os.path.exists(pidfile):
        try:
            os.kill(int(open(pidfile).read().strip()), signal.SIGTERM)
        except (OSError, ValueError):
            pass
        # sshd removes its own pid file as it exits: it may already be gone.
        try:
            os.unlink(pidfile)
        except FileNotFoundError:
            pass
    if os.path.exists(f"/run/netns/{NETNS}"):
        for pid in sh(["ip", "netns", "pids", NETNS], check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGTERM)
            except OSError:
                pass
        time.sleep(0.3)
        sh(["ip", "netns", "del", NETNS], check=False)
    sh(["ip", "link", "del", VETH_HOST], check=False)
    img = os.path.join(WORK, "slow.img")
    if os.path.exists(img):
        for line in sh(["losetup", "-j", img], check=False).stdout.splitlines():
            sh(["losetup", "-d", line.split(":")[0]], check=False)
    for cg, root in ((CG_V1, "/sys/fs/cgroup/blkio"), (CG_V2, "/sys/fs/cgroup")):
        if os.path.isdir(cg):
            try:
                for pid in open(os.path.join(cg, "cgroup.procs")).read().split():
                    with open(os.path.join(root, "cgroup.procs"), "w") as f:
                        f.write(pid)
            except OSError:
                pass
            try:
                os.rmdir(cg)
            except OSError as e:
                print(f"warning: could not remove {cg}: {e}", file=sys.stderr)
    left = mounts_under(WORK)
    if left:
        print(f"warning: still mounted: {left}", file=sys.stderr)


# ---------------------------------------------------------------------------------------
# sources
# ---------------------------------------------------------------------------------------

class Source:
    def __init__(self, name, path):
        self.name, self.path = name, path

    def refresh(self):
        """Make the next access cold below the systems (drop_caches comes after)."""


class RemoteSource(Source):
    # Added round trip in ms (`fetch.py --rtt-ms`): ssh goes through tools/delay_relay.py.
    rtt_ms = 0

    def mount(self):
        d = os.path.join(WORK, "remote")
        umount(self.path)
        os.makedirs(self.path, exist_ok=True)
        opts = (f"IdentityFile={d}/ssh/client_key,StrictHostKeyChecking=no,"
                f"UserKnownHostsFile=/dev/null,BatchMode=yes,LogLevel=ERROR")
        if self.rtt_ms:
            relay = os.path.join(BENCH, "tools", "delay_relay.py")
            opts += f",ProxyCommand=/usr/bin/python3 {relay} {self.rtt_ms / 2} %h %p"
        mount_cmd(["sshfs", f"root@{ADDR_NS}:{d}/export", self.path, "-o", opts],
                  os.path.join(d, "sshfs.log"))
        wait_mounted(self.path)

    def refresh(self):
        self.mount()


def make_tree_data(root):
    """The data every source holds (created once on the local disk, copied to the others)."""
    os.makedirs(root, exist_ok=True)
    # W4: a real tree
    tree = os.path.join(root, "tree")
    if P["tree"]:
        os.makedirs(tree)
        for sub in P["tree"]:
            sh(["cp", "-a", f"/usr/include/{sub}", tree])
    else:
        sh(["cp", "-a", "/usr/include", tree])
        rmtree(os.path.join(tree, "node"))
        rmtree(os.path.join(tree, "llvm-14"))
    sh(["find", tree, "-type", "l", "-delete"])
    # W3: pages/fNNNN
    pages = os.path.join(root, "pages")
    os.makedirs(pages)
    blob = os.urandom(P["pages_size"])
    for i in range(P["pages_files"]):
        with open(os.path.join(pages, f"f{i:04d}"), "wb") as f:
            f.write(blob)
    # W2: one 1 MiB file
    with open(os.path.join(root, "small.bin"), "wb") as f:
        f.write(os.urandom(MIB))


def write_seq(path, size):
    sh(["dd", "if=/dev/urandom", f"of={path}", "bs=1M", f"count={size // MIB}", "status=none"])


def setup_sources():
    os.makedirs(WORK, exist_ok=True)
    tmpl = os.path.join(WORK, "template")
    rmtree(tmpl)
    log("creating data template")
    make_tree_data(tmpl)
    tree_bytes = int(sh(["du", "-sb", tmpl]).stdout.split()[0])
    srcs = {}
    # local
    local = os.path.join(WORK, "local", "src")
    rmtree(os.path.dirname(local))
    os.makedirs(local)
    sh(["cp", "-a", tmpl + "/.", local])
    write_seq(os.path.join(local, "seq.bin"), P["seq"]["local"])
    srcs["local"] = Source("local", local)
    # slow disk: ext4 image on a loop device, throttled by the blkio/io controller
    log("setting up slow disk")
    img = os.path.join(WORK, "slow.img")
    size = tree_bytes * 2 + P["seq"]["slow"] + 512 * MIB
    sh(["truncate", "-s", str(size), img])
    sh(["mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", img])
    dev = sh(["losetup", "-f", "--show", "--direct-io=on", img]).stdout.strip()
    slow = os.path.join(WORK, "slow", "src")
    os.makedirs(slow, exist_ok=True)
    sh(["mount", dev, slow])
    sh(["cp", "-a", tmpl + "/.", slow])
    write_seq(os.path.join(slow, "seq.bin"), P["seq"]["slow"])
    os.sync()
    majmin = sh(["lsblk", "-dno", "MAJ:MIN", dev]).stdout.strip()
    throttle(majmin)
    srcs["slow"] = Source("slow", slow)
    srcs["slow"].dev = dev
    # remote: sshd in a netns, veth shaped with HTB, sshfs on the host
    log("setting up remote (sshd in netns, veth shaped to", RATE + ")")
    d = os.path.join(WORK, "remote")
    export = os.path.join(d, "export")
    rmtree(d)
    os.makedirs(export)
    sh(["cp", "-a", tmpl + "/.", export])
    write_seq(os.path.join(export, "seq.bin"), P["seq"]["remote"])
    setup_netns(d)
    r = RemoteSource("remote", os.path.join(d, "src"))
    r.mount()
    srcs["remote"] = r
    return srcs


def throttle(majmin):
    v2 = "/sys/fs/cgroup/cgroup.controllers"
    if os.path.exists(v2) and "io" in open(v2).read().split():
        with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
            f.write("+io")
        os.makedirs(CG_V2, exist_ok=True)
        with open(os.path.join(CG_V2, "io.max"), "w") as f:
            f.write(f"{majmin} rbps={SLOW_RBPS} riops={SLOW_RIOPS}\n")
        cg, how = CG_V2, "cgroup v2 io.max"
    elif os.path.isdir("/sys/fs/cgroup/blkio"):
        # hybrid hierarchy: the io controller is bound to v1 blkio; same limits there
        os.makedirs(CG_V1, exist_ok=True)
        with open(os.path.join(CG_V1, "blkio.throttle.read_bps_device"), "w") as f:
            f.write(f"{majmin} {SLOW_RBPS}\n")
        with open(os.path.join(CG_V1, "blkio.throttle.read_iops_device"), "w") as f:
            f.write(f"{majmin} {SLOW_RIOPS}\n")
        cg, how = CG_V1, "cgroup v1 blkio.throttle (io controller bound to v1 here)"
    else:
        raise RuntimeError("no io/blkio cgroup controller to throttle the slow disk")
    # The driver and every child (readers, hoardfs/bindfs/rclone daemons) live in this
    # cgroup. The limit is per device, so it throttles exactly the reads that hit the loop
    # device: the reader's for "source read directly", the daemon's source reads for the
    # FUSE systems; cache dirs are on another device and stay unthrottled.
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    META["throttle"] = f"{how}: device {majmin}, {SLOW_RBPS // MIB} MiB/s, {SLOW_RIOPS} read IOPS"


def setup_netns(d):
    ssh = os.path.join(d, "ssh")
    os.makedirs(ssh, exist_ok=True)
    sh(["ip", "netns", "add", NETNS])
    sh(["ip", "link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NS])
    sh(["ip", "link", "set", VETH_NS, "netns", NETNS])
    sh(["ip", "addr", "add", f"{ADDR_HOST}/30", "dev", VETH_HOST])
    sh(["ip", "link", "set", VETH_HOST, "up"])
    sh(["ip", "-n", NETNS, "addr", "add", f"{ADDR_NS}/30", "dev", VETH_NS])
    sh(["ip", "-n", NETNS, "link", "set", VETH_NS, "up"])
    sh(["ip", "-n", NETNS, "link", "set", "lo", "up"])
    for ns in ([], ["ip", "netns", "exec", NETNS]):
        dev = VETH_NS if ns else VETH_HOST
        sh(ns + ["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"])
        sh(ns + ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:10", "htb",
                 "rate", RATE, "ceil", RATE])
    for k in ("host_key", "client_key"):
        sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(ssh, k)])
    shutil.copy(os.path.join(ssh, "client_key.pub"), os.path.join(ssh, "authorized_keys"))
    conf = os.path.join(ssh, "sshd_config")
    with open(conf, "w") as f:
        f.write(f"""ListenAddress {ADDR_NS}
Port 22
HostKey {ssh}/host_key
AuthorizedKeysFile {ssh}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile {ssh}/sshd.pid
Subsystem sftp internal-sftp
""")
    os.makedirs("/run/sshd", exist_ok=True)
    sh(["ip", "netns", "exec", NETNS, "/usr/sbin/sshd", "-f", conf])
    for _ in range(100):
        if os.path.exists(f"{ssh}/sshd.pid"):
            break
        time.sleep(0.05)
    META["remote"] = (f"sshd in netns {NETNS} at {ADDR_NS}, veth {VETH_HOST}<->{VETH_NS}, "
                      f"HTB {RATE} each way; sshfs 3 defaults")


# ---------------------------------------------------------------------------------------
# systems under test (one mounted at a time, over one source)
# ---------------------------------------------------------------------------------------

class System:
    persistent = False  # has a persistent cache (warm differs from cold)
    fuse = False

    def __init__(self, name, src):
        self.name, self.src = name, src
        self.base = os.path.join(WORK, "sys", src.name, name)
        self.mnt = os.path.join(self.base, "mnt")
        self.cache = os.path.join(self.base, "cache")

    @property
    def root(self):
        return self.src.path

    def start(self, fresh):
        """Mount; fresh = empty persistent cache and cold kernel caches; otherwise the
        persistent cache is kept and the kernel's caches are still dropped."""
        if fresh:
            self.src.refresh()
        drop_caches()

    def stop(self):
        pass

    def drop(self):
        """Warm state: drop the page cache only, keep the persistent cache."""
        drop_caches()


class Direct(System):
    pass


class CacheDir(System):
    """The hoardfs cache directory of this source, read directly (filled by a hoardfs)."""
    persistent = True

    def __init__(self, name, src, filler):
        super().__init__(name, src)
        self.filler = filler

    @property
    def root(self):
        return os.path.join(self.filler.cache, "data")

    def start(self, fresh):
        drop_caches()


class Hoardfs(System):
    persistent = fuse = True
    filled = set()  # paths known to be fully in the persistent cache

    def __init__(self, name, src, extra=()):
        super().__init__(name, src)
        self.extra = list(extra)

    @property
    def root(self):
        return self.mnt

    def start(self, fresh):
        self.stop()
        if fresh:
            rmtree(self.cache)
            self.filled = set()
            self.src.refresh()
        os.makedirs(self.mnt, exist_ok=True)
        os.makedirs(self.cache, exist_ok=True)
        drop_caches()
        mount_cmd([HOARDFS, self.src.path, self.mnt, "--cache-dir", self.cache] + self.extra,
                  os.path.join(self.base, "mount.log"))
        wait_mounted(self.mnt)

    def stop(self):
        umount(self.mnt)
        for pid in pids_of_mount(self.mnt):  # the daemon exits on unmount; wait for it
            for _ in range(100):
                if not os.path.exists(f"/proc/{pid}"):
                    break
                time.sleep(0.05)

    def stats(self):
        r = sh([HOARDFS, "stats", self.mnt, "--json"])
        return json.loads(r.stdout)

    def pid(self):
        pids = [p for p in pids_of_mount(self.mnt)
                if os.path.realpath(f"/proc/{p}/exe") == os.path.realpath(HOARDFS)]
        return pids[0] if pids else None

    def settle_fills(self, limit=30.0):
        """With --source-reads the cache is filled after a read closes: wait until the
        fills' counters stop moving (a warm state taken earlier would find it partial)."""
        def done():
            c = self.stats()["cache"]
            return c["chunks_filled_behind"] + c["chunks_left_behind"]
        end, last = time.time() + limit, None
        while time.time() < end:
            now = done()
            if now == last:
                return
            last = now
            time.sleep(0.3)


class Bindfs(System):
    fuse = True

    @property
    def root(self):
        return self.mnt

    def start(self, fresh):
        self.stop()
        if fresh:
            self.src.refresh()
        os.makedirs(self.mnt, exist_ok=True)
        drop_caches()
        mount_cmd(["bindfs", self.src.path, self.mnt], os.path.join(self.base, "mount.log"))
        wait_mounted(self.mnt)

    def stop(self):
        umount(self.mnt)


class Rclone(System):
    persistent = fuse = True
    proc = None

    @property
    def root(self):
        return self.mnt

    def start(self, fresh):
        self.stop()
        if fresh:
            rmtree(self.cache)
            self.src.refresh()
        os.makedirs(self.mnt, exist_ok=True)
        os.makedirs(self.cache, exist_ok=True)
        drop_caches()
        logf = open(os.path.join(self.base, "rclone.log"), "a")
        self.proc = subprocess.Popen(
            ["rclone", "mount", f":local:{self.src.path}", self.mnt, "--config", "/dev/null",
             "--vfs-cache-mode", "full", "--cache-dir", self.cache, "--vfs-cache-max-age",
             "24h", "--dir-cache-time", "5m"], stdout=logf, stderr=logf)
        wait_mounted(self.mnt, proc=self.proc)

    def stop(self):
        umount(self.mnt)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                self.proc.wait()
            self.proc = None


def systems_for(src, names):
    hoard = Hoardfs("hoardfs", src)
    out = {}
    make = {
        "source": lambda: Direct("source", src),
        "cache": lambda: CacheDir("cache", src, next(s for s in out.values() if isinstance(s, Hoardfs))),
        "hoardfs": lambda: hoard,
        "hoardfs-nopt": lambda: Hoardfs("hoardfs-nopt", src, ["--no-passthrough"]),
        "hoardfs-ko": lambda: Hoardfs("hoardfs-ko", src, ["--kernel-opens"]),
        "hoardfs-sr": lambda: Hoardfs("hoardfs-sr", src, ["--source-reads"]),
        "hoardfs-lease": lambda: Hoardfs("hoardfs-lease", src, ["--open-lease", "60"]),
        "hoardfs-t0": lambda: Hoardfs("hoardfs-t0", src, ["--whole-file-threshold", "0"]),
        "hoardfs-t400K": lambda: Hoardfs("hoardfs-t400K", src, ["--whole-file-threshold", "400K"]),
        "bindfs": lambda: Bindfs("bindfs", src),
        "rclone": lambda: Rclone("rclone", src),
    }
    for n in sorted(names, key=lambda n: n == "cache"):  # hoardfs systems before the cache
        out[n] = make[n]()
    return [out[n] for n in names]


# ---------------------------------------------------------------------------------------
# measurement bookkeeping
# ---------------------------------------------------------------------------------------

RESULTS = []  # dicts: w, src, sys, param, state, run, value
META = {}
EXTRA = {}  # workload-specific tables (daemon request counts, RSS)
CMDS = {}


def record(w, src, sys_, param, state, run, value):
    RESULTS.append(dict(w=w, src=src, sys=sys_, param=str(param), state=state, run=run,
                        value=value))
    log(f"  {w} {src} {sys_} {param} {state} run{run}: {value:.6g}")


def bt(*args):
    out = sh([BT] + [str(a) for a in args]).stdout
    return dict(kv.split("=") for kv in out.split())


def timed(cmd, ok=(0,), **kw):
    t0 = time.perf_counter()
    r = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, **kw)
    dt = time.perf_counter() - t0
    if r.returncode not in ok:
        raise RuntimeError(f"{cmd} exited {r.returncode}: {r.stderr[-2000:]}")
    return dt


def rotate(lst, r):
    r %= len(lst)
    return lst[r:] + lst[:r]


# ---------------------------------------------------------------------------------------
# workloads
# ---------------------------------------------------------------------------------------

def fill_hoardfs_cache(hoard, rel):
    """Fill hoard's persistent cache with rel (so that "cache" has something to read)."""
    if rel in hoard.filled:
        return
    hoard.start(fresh=True)
    hoard.filled = {rel}
    p = os.path.join(hoard.root, rel)
    if os.path.isdir(p):
        bt("readall", p)
    else:
        bt("seq", p, MIB)
    hoard.stop()


def w1_seq(srcs):
    CMDS["w1"] = "bt seq FILE BS  (open, read(2) BS bytes until EOF, close; MiB/s)"
    for src in srcs.values():
        names = ["source", "cache", "hoardfs", "bindfs", "rclone"]
        if src.name != "remote":  # a network source has a source timeout: no source reads
            names.insert(3, "hoardfs-sr")
        systems = systems_for(src, names)
        hoard = systems[2]
        for r in range(P["runs"]):
            for bs in P["bs"]:
                for s in rotate(systems, r):
                    if isinstance(s, CacheDir):
                        fill_hoardfs_cache(hoard, "seq.bin")
                    s.start(fresh=True)
                    f = os.path.join(s.root, "seq.bin")
                    if not isinstance(s, CacheDir):
                        record("w1", src.name, s.name, bs, "cold", r, float(bt("seq", f, bs)["mib_s"]))
                        if s is hoard:
                            hoard.filled = {"seq.bin"}
                    if s.persistent:
                        if isinstance(s, Hoardfs) and "--source-reads" in s.extra:
                            s.settle_fills()
                        s.drop()
                        record("w1", src.name, s.name, bs, "warm", r, float(bt("seq", f, bs)["mib_s"]))
                    record("w1", src.name, s.name, bs, "hot", r, float(bt("seq", f, bs)["mib_s"]))
                    s.stop()


def w2_pread(srcs):
    CMDS["w2"] = f"bt pread FILE SIZE {P['pread_n']}  (open once, pread SIZE at offset 0; ns per call; file cached and page cache hot)"
    src = srcs["local"]
    systems = systems_for(src, ["source", "cache", "hoardfs", "hoardfs-nopt", "bindfs", "rclone"])
    hoard = systems[2]
    fill_hoardfs_cache(hoard, "small.bin")
    for r in range(P["runs"]):
        for s in rotate(systems, r):
            s.start(fresh=not isinstance(s, CacheDir))
            f = os.path.join(s.root, "small.bin")
            bt("seq", f, MIB)  # fill persistent and page cache
            for size in (100, 1000, 4000, 8000, 65536):
                record("w2", src.name, s.name, size, "hot", r,
                       float(bt("pread", f, size, P["pread_n"])["ns_per_call"]))
            s.stop()


def w3_pages(srcs):
    CMDS["w3"] = (f"bt pages DIR {P['pages_files']} {P['pages_rounds']}  ({P['pages_files']} files of "
                  f"{P['pages_size'] // 1024} KiB; each round opens every file and preads one 4 KiB page; "
                  "us per page)")
    for name in ("local", "slow"):
        src = srcs[name]
        systems = systems_for(src, ["source", "cache", "hoardfs-t0", "hoardfs-t400K", "bindfs", "rclone"])
        hoard = systems[2]
        for r in range(P["runs"]):
            for s in rotate(systems, r):
                if isinstance(s, CacheDir):
                    fill_hoardfs_cache(hoard, "pages")
                s.start(fresh=True)
                d = os.path.join(s.root, "pages")
                args = (d, P["pages_files"], P["pages_rounds"])
                if not isinstance(s, CacheDir):
                    record("w3", name, s.name, "", "cold", r, float(bt("pages", *args)["us_per_page"]))
                    if s is hoard:
                        hoard.filled = set()  # one page per file read: not complete
                if s.persistent:
                    s.drop()
                    record("w3", name, s.name, "", "warm", r, float(bt("pages", *args)["us_per_page"]))
                record("w3", name, s.name, "", "hot", r, float(bt("pages", *args)["us_per_page"]))
                s.stop()


GREP = ["grep", "-r", "-c", "hoardfs_no_such_string_zq"]


def w4_grep(srcs):
    CMDS["w4"] = "LC_ALL=C grep -r -c hoardfs_no_such_string_zq TREE >/dev/null  (seconds)"
    env = dict(os.environ, LC_ALL="C")
    for src in srcs.values():
        names = ["source", "cache", "hoardfs", "hoardfs-ko", "bindfs", "rclone"]
        # Open leases act only where nothing is watched: the SSHFS source.
        if isinstance(src, RemoteSource):
            names.insert(4, "hoardfs-lease")
        systems = systems_for(src, names)
        hoard = systems[2]
        for r in range(P["runs"]):
            for s in rotate(systems, r):
                if isinstance(s, CacheDir):
                    fill_hoardfs_cache(hoard, "tree")
                s.start(fresh=True)
                cmd = GREP + [os.path.join(s.root, "tree")]
                if not isinstance(s, CacheDir):
                    record("w4", src.name, s.name, "", "cold", r, timed(cmd, ok=(0, 1), env=env))
                    if s is hoard:
                        hoard.filled = {"tree"}
                if s.persistent:
                    s.drop()
                    record("w4", src.name, s.name, "", "warm", r, timed(cmd, ok=(0, 1), env=env))
                record("w4", src.name, s.name, "", "hot", r, timed(cmd, ok=(0, 1), env=env))
                # Once more: with --kernel-opens the pass after one that read through the
                # daemon still asks one getattr per file (the kernel's atime), this one none.
                record("w4", src.name, s.name, "", "hot again", r, timed(cmd, ok=(0, 1), env=env))
                s.stop()


def andrew_tree():
    lua = [p for p in sh("ls -d /root/.cargo/registry/src/*/lua-src-*/ 2>/dev/null || true").stdout.split()]
    if not lua:
        raise RuntimeError("lua-src sources missing (bench/run fetches them)")
    base = lua[-1]
    vers = P["andrew_versions"] or sorted(d for d in os.listdir(base) if d.startswith("lua-"))
    tree = os.path.join(WORK, "andrew-src")
    rmtree(tree)
    os.makedirs(tree)
    for v in vers:
        sh(["cp", "-a", os.path.join(base, v), tree])
    cfiles = sorted(sh(["find", "lua-5.4.9", "-name", "*.c"], cwd=tree).stdout.split())
    if P["make_files"]:
        cfiles = cfiles[:P["make_files"]]
    return tree, vers, cfiles


def w5_andrew(srcs):
    tree, vers, cfiles = andrew_tree()
    nfiles = int(sh(f"find {tree} -type f | wc -l").stdout)
    CMDS["w5"] = (f"tree: Lua sources from the lua-src crate ({', '.join(vers)}; {nfiles} files). "
                  "MakeDir: `mkdir -p` of every directory; Copy: `cp --parents` of every file (no `-a`: rclone mount cannot chmod); "
                  "ScanDir: `bt walk` (lstat every entry); ReadAll: `bt readall`; "
                  f"Make: `cc -O0 -c` of the {len(cfiles)} .c files of lua-5.4.9 (2 jobs). "
                  "cold = fresh mount and dropped caches before the phase; warm = phase repeated at once.")
    dirs = sorted(sh(["find", ".", "-type", "d"], cwd=tree).stdout.split())
    for name in ("local", "slow"):
        src = srcs[name]
        systems = systems_for(src, ["source", "hoardfs", "hoardfs-ko", "bindfs", "rclone"])
        for r in range(P["runs"]):
            for s in rotate(systems, r):
                rmtree(os.path.join(src.path, "andrew"))
                s.start(fresh=True)
                dst = os.path.join(s.root, "andrew")
                isH = isinstance(s, Hoardfs)
                snap = [s.stats()] if isH else None

                def phase(ph, fn):
                    t = fn()
                    record("w5", name, s.name, ph, "", r, t)
                    if isH and r == 0 and s.name == "hoardfs":
                        st = s.stats()
                        req = {k: v - snap[0]["requests"].get(k, 0) for k, v in st["requests"].items()}
                        EXTRA.setdefault("w5req", {}).setdefault(name, {})[ph] = {k: v for k, v in req.items() if v}
                        snap[0] = st

                def mkd():
                    return timed(["mkdir", "-p"] + [os.path.join(dst, d) for d in dirs])

                def cp():
                    return timed(f"cd {tree} && find . -type f -print0 | xargs -0 cp --parents -t {dst}")

                def scan():
                    return float(bt("walk", dst)["seconds"])

                def readall():
                    return float(bt("readall", dst)["seconds"])

                def make():
                    srcs_ = " ".join(cfiles)
                    return timed(f"cd {dst} && printf '%s\\n' {srcs_} | xargs -P2 -I@ cc -O0 -w -c @ -o @.o")

                def cold():
                    s.stop()
                    s.start(fresh=False)
                    if isH:
                        snap[0] = s.stats()

                phase("MakeDir", mkd)
                phase("Copy", cp)
                cold()
                phase("ScanDir cold", scan)
                phase("ScanDir warm", scan)
                cold()
                phase("ReadAll cold", readall)
                phase("ReadAll warm", readall)
                phase("Make", make)
                s.stop()
                rmtree(os.path.join(src.path, "andrew"))


def w6_postmark(srcs):
    if not shutil.which("postmark"):
        EXTRA["w6skip"] = "postmark not installed"
        return
    conf = (f"set number {P['pm_files']}\nset transactions {P['pm_tx']}\nset subdirectories 200\n"
            "set size 512 10000\nset seed 42\n")
    CMDS["w6"] = "postmark with: " + conf.replace("\n", "; ") + "run  (seconds)"
    src = srcs["local"]
    systems = systems_for(src, ["source", "hoardfs", "bindfs", "rclone"])
    for r in range(P["runs"]):
        for s in rotate(systems, r):
            rmtree(os.path.join(src.path, "pm"))
            os.makedirs(os.path.join(src.path, "pm"))
            s.start(fresh=True)
            inp = f"set location {os.path.join(s.root, 'pm')}\n" + conf + "run\nquit\n"
            record("w6", "local", s.name, "", "", r, timed(["postmark"], input=inp))
            s.stop()
            rmtree(os.path.join(src.path, "pm"))


def w7_symlinks(srcs):
    n = P["sym_n"]
    CMDS["w7"] = f"bt stat LINK {n}  (stat(2) through a chain of k links; ns per stat; after one priming stat)"
    src = srcs["local"]
    systems = systems_for(src, ["source", "hoardfs", "bindfs", "rclone"])
    for s in systems:
        d = os.path.join(src.path, "links", s.name)
        rmtree(d)
        os.makedirs(d)
        open(os.path.join(d, "t"), "w").write("x")
        mroot = os.path.join(s.root, "links", s.name)
        for k in range(1, 6):
            for i in range(1, k + 1):
                nxt = f"r{k}_{i + 1}" if i < k else "t"
                os.symlink(nxt, os.path.join(d, f"r{k}_{i}"))
                nxt = os.path.join(mroot, f"a{k}_{i + 1}" if i < k else "t")
                os.symlink(nxt, os.path.join(d, f"a{k}_{i}"))
    for r in range(P["runs"]):
        for s in rotate(systems, r):
            s.start(fresh=True)
            for k in range(1, 6):
                for kind in ("r", "a"):
                    p = os.path.join(s.root, "links", s.name, f"{kind}{k}_1")
                    try:
                        bt("stat", p, 1)
                        v = float(bt("stat", p, n)["ns_per_call"])
                    except RuntimeError:
                        EXTRA.setdefault("w7fail", set()).add(s.name)
                        continue
                    record("w7", "local", s.name, f"{'rel' if kind == 'r' else 'abs'} {k}", "hot", r, v)
            s.stop()


def w8_meta(srcs):
    n = P["meta_files"]
    src = srcs["local"]
    d = os.path.join(src.path, "meta")
    rmtree(d)
    ndirs = max(1, n // 100)
    for i in range(ndirs):
        sub = os.path.join(d, f"d{i:05d}")
        os.makedirs(sub)
        for j in range(100):
            os.close(os.open(os.path.join(sub, f"f{j:03d}"), os.O_CREAT | os.O_WRONLY, 0o644))
    CMDS["w8"] = f"bt walk DIR over {ndirs * 100} empty files in {ndirs} directories (seconds)"
    systems = systems_for(src, P.get("meta_systems", ["source", "hoardfs", "bindfs", "rclone"]))
    for r in range(P["runs"]):
        for s in rotate(systems, r):
            s.start(fresh=True)
            p = os.path.join(s.root, "meta")
            record("w8", "local", s.name, "", "cold", r, float(bt("walk", p)["seconds"]))
            record("w8", "local", s.name, "", "hot", r, float(bt("walk", p)["seconds"]))
            if isinstance(s, Hoardfs):
                pid = s.pid()
                hwm, rss = proc_status(pid, "VmHWM"), proc_status(pid, "VmRSS")
                drop_caches(2)
                time.sleep(2)
                after = proc_status(pid, "VmRSS")
                EXTRA.setdefault("w8rss", []).append((hwm, rss, after, s.stats().get("inodes")))
            s.stop()
    rmtree(d)


# ---------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------

def summarize():
    groups = {}
    for x in RESULTS:
        groups.setdefault((x["w"], x["src"], x["param"], x["state"], x["sys"]), []).append(x["value"])
    return {k: (statistics.median(v), min(v), max(v), len(v)) for k, v in groups.items()}


def fmt(v):
    if v is None:
        return "—"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    if v >= 1:
        return f"{v:.2f}"
    return f"{v:.3g}"


def table(S, w, unit, higher_better, srcs=None, states=None, param_label="param"):
    keys = sorted({(k[1], k[2], k[3]) for k in S if k[0] == w},
                  key=lambda k: (["local", "slow", "remote"].index(k[0]), _num(k[1]), _st(k[2])))
    if srcs:
        keys = [k for k in keys if k[0] in srcs]
    if states:
        keys = [k for k in keys if k[2] in states]
    sysorder = ["source", "cache", "hoardfs", "hoardfs-nopt", "hoardfs-ko", "hoardfs-sr", "hoardfs-lease", "hoardfs-t0",
                "hoardfs-t400K", "bindfs", "rclone"]
    ratio_word = "throughput ÷ reference (higher is better)" if higher_better else "time ÷ reference (lower is better)"
    lines = [f"Median of runs, spread = min–max, in {unit}. Ratios: {ratio_word}; "
             "‘vs source’ compares with the source read directly in the same state "
             "(cold source for the warm state, the source having no persistent cache), "
             "‘vs cache’ with the cache directory read directly in the same state.", "",
             f"| source | {param_label} | state | system | median | spread | runs | vs source | vs cache |",
             "|---|---|---|---|---:|---|---:|---:|---:|"]
    for (src, param, state) in keys:
        for sy in sysorder:
            k = (w, src, param, state, sy)
            if k not in S:
                continue
            med, lo, hi, n = S[k]
            ref_src = S.get((w, src, param, state, "source")) or (
                S.get((w, src, param, "cold", "source")) if state == "warm" else None)
            ref_c = S.get((w, src, param, state, "cache"))
            rs = _ratio(med, ref_src, higher_better) if sy != "source" else "1"
            rc = _ratio(med, ref_c, higher_better) if sy != "cache" else ("1" if ref_c else "—")
            lines.append(f"| {src} | {param} | {state} | {sy} | {fmt(med)} | {fmt(lo)}–{fmt(hi)} | {n} | {rs} | {rc} |")
    return "\n".join(lines)


def _num(p):
    m = re.match(r"[^\d]*(\d+)", p)
    return (p.split()[0] if " " in p else "", int(m.group(1)) if m else 0, p)


def _st(s):
    order = ["cold", "warm", "hot", "hot again", ""]
    return order.index(s) if s in order else 9


def _ratio(v, ref, higher_better):
    if not ref or not ref[0]:
        return "—"
    return f"{v / ref[0]:.2f}" if higher_better else f"{v / ref[0]:.2f}×"


def med(S, *k):
    return S[k][0] if k in S else None


def plots(S, stem):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out = []
    sysorder = ["source", "cache", "hoardfs", "bindfs", "rclone"]
    colors = {"source": "#777777", "cache": "#2ca02c", "hoardfs": "#1f77b4", "bindfs": "#ff7f0e",
              "rclone": "#d62728", "hoardfs-nopt": "#9467bd", "hoardfs-t0": "#1f77b4",
              "hoardfs-t400K": "#17becf"}
    # W1: one panel per source, groups = state x bs (1 MiB and 4 KiB)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, src in zip(axes, ["local", "slow", "remote"]):
        groups = [(st, bs) for st in ("cold", "warm", "hot") for bs in (str(4096), str(MIB))]
        width = 0.8 / len(sysorder)
        for i, sy in enumerate(sysorder):
            vals = [med(S, "w1", src, str(bs), st, sy) or 0 for st, bs in groups]
            ax.bar([g + i * width for g in range(len(groups))], vals, width, label=sy, color=colors[sy])
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{st}\n{'4K' if bs == '4096' else '1M'}" for st, bs in groups])
        ax.set_yscale("log")
        ax.set_title(f"W1 sequential read, {src} source")
        ax.set_ylabel("MiB/s (log)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.append(("W1 sequential read throughput", f"{stem}-w1-seq.png"))
    fig.savefig(os.path.join(RESULTS_DIR, out[-1][1]), dpi=80)
    plt.close(fig)
    # W2
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = [100, 1000, 4000, 8000, 65536]
    for sy in ["source", "cache", "hoardfs", "hoardfs-nopt", "bindfs", "rclone"]:
        vals = [med(S, "w2", "local", str(z), "hot", sy) for z in sizes]
        if any(vals):
            ax.plot(sizes, [v or float("nan") for v in vals], marker="o", label=sy, color=colors[sy])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("pread size (bytes)")
    ax.set_ylabel("ns per call (log)")
    ax.set_title("W2 warm small preads, local source")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.append(("W2 small preads", f"{stem}-w2-pread.png"))
    fig.savefig(os.path.join(RESULTS_DIR, out[-1][1]), dpi=80)
    plt.close(fig)
    # W4 grep
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, src in zip(axes, ["local", "slow", "remote"]):
        states = ["cold", "warm", "hot"]
        width = 0.8 / len(sysorder)
        for i, sy in enumerate(sysorder):
            vals = [med(S, "w4", src, "", st, sy) or 0 for st in states]
            ax.bar([g + i * width for g in range(3)], vals, width, label=sy, color=colors[sy])
        ax.set_xticks([g + 0.4 - width / 2 for g in range(3)])
        ax.set_xticklabels(states)
        ax.set_title(f"W4 grep -r, {src} source")
        ax.set_ylabel("seconds (lower is better)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.append(("W4 grep -r", f"{stem}-w4-grep.png"))
    fig.savefig(os.path.join(RESULTS_DIR, out[-1][1]), dpi=80)
    plt.close(fig)
    # W5 Andrew
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    phases = ["MakeDir", "Copy", "ScanDir cold", "ScanDir warm", "ReadAll cold", "ReadAll warm", "Make"]
    for ax, src in zip(axes, ["local", "slow"]):
        sy4 = ["source", "hoardfs", "bindfs", "rclone"]
        width = 0.8 / len(sy4)
        for i, sy in enumerate(sy4):
            base = [med(S, "w5", src, ph, "", "source") for ph in phases]
            vals = [(med(S, "w5", src, ph, "", sy) or 0) / b if b else 0 for ph, b in zip(phases, base)]
            ax.bar([g + i * width for g in range(len(phases))], vals, width, label=sy, color=colors[sy])
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(phases))])
        ax.set_xticklabels([p.replace(" ", "\n") for p in phases])
        ax.set_yscale("log")
        ax.axhline(1, color="k", lw=0.5)
        ax.set_title(f"W5 Andrew phases, {src} source: time ÷ source (log)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out.append(("W5 Andrew-style phases", f"{stem}-w5-andrew.png"))
    fig.savefig(os.path.join(RESULTS_DIR, out[-1][1]), dpi=80)
    plt.close(fig)
    # A run of some workloads (--only) keeps only the plots that have data.
    ran = {k[0] for k in S}
    for title, name in list(out):
        if name.rsplit("-", 2)[-2] not in ran:
            os.remove(os.path.join(RESULTS_DIR, name))
            out.remove((title, name))
    return out


def targets(S):
    """The issue's targets, each with the measured value and met / missed."""
    rows = []

    def add(name, val, ok):
        rows.append(f"| {name} | {val} | {'met' if ok else ('MISSED' if ok is not None else 'not measured')} |")

    for bs in P["bs"]:
        for st in ("hot", "warm"):
            h, c = med(S, "w1", "local", str(bs), st, "hoardfs"), med(S, "w1", "local", str(bs), st, "cache")
            if h and c:
                add(f"warm seq read ≥ 0.97 of cache dir, {bs // 1024} KiB reads, local, {st}",
                    f"{h / c:.2f}", h / c >= 0.97)
    for z in (100, 1000, 4000, 8000, 65536):
        h, n = med(S, "w2", "local", str(z), "hot", "hoardfs"), med(S, "w2", "local", str(z), "hot", "source")
        if h and n:
            add(f"warm pread {z} B ≤ 1.1× native", f"{h / n:.2f}× ({h:.0f} vs {n:.0f} ns)", h / n <= 1.1)
    for src in ("local", "slow"):
        for ph in ("ScanDir warm", "ReadAll warm"):
            h, n = med(S, "w5", src, ph, "", "hoardfs"), med(S, "w5", src, ph, "", "source")
            if h and n:
                add(f"{ph} ≤ 1.1× native ({src})", f"{h / n:.2f}×", h / n <= 1.1)
            req = EXTRA.get("w5req", {}).get(src, {}).get(ph)
            if req is not None:
                bad = {k: v for k, v in req.items() if k in ("lookup", "read", "getattr")}
                add(f"{ph}: zero lookups/reads reaching the daemon ({src})",
                    ", ".join(f"{k} {v}" for k, v in sorted(bad.items())) or "none", not bad)
        h, n = med(S, "w5", src, "ScanDir cold", "", "hoardfs"), med(S, "w5", src, "ScanDir cold", "", "source")
        if h and n:
            add(f"cold stat of every file ≤ 3× native ({src})", f"{h / n:.2f}×", h / n <= 3)
    for src in ("slow", "remote"):
        for bs in P["bs"]:
            h, n = med(S, "w1", src, str(bs), "cold", "hoardfs"), med(S, "w1", src, str(bs), "cold", "source")
            if h and n:
                add(f"cold seq read over {src} ≥ 0.95 of source, {bs // 1024} KiB", f"{h / n:.2f}", h / n >= 0.95)
        h, n = med(S, "w1", src, str(MIB), "warm", "hoardfs"), med(S, "w1", src, str(MIB), "cold", "source")
        if h and n:
            add(f"warm (page cache dropped) seq read over {src} ≥ 10× source", f"{h / n:.1f}×", h / n >= 10)
        h, n = med(S, "w4", src, "", "warm", "hoardfs"), med(S, "w4", src, "", "cold", "source")
        if h and n:
            add(f"warm grep -r over {src} ≥ 10× faster than source", f"{n / h:.1f}×", n / h >= 10)
    for bs in P["bs"]:
        h, r_ = med(S, "w1", "local", str(bs), "hot", "hoardfs"), med(S, "w1", "local", str(bs), "hot", "rclone")
        if h and r_:
            add(f"warm seq read ≥ 10× rclone, {bs // 1024} KiB", f"{h / r_:.1f}×", h / r_ >= 10)
    add("warm seq read ≥ 4× catfs", "catfs not built (see above)", None)
    ahead = []
    for (w, src, param, st, sy), v in S.items():
        if sy != "hoardfs" or w in ("w1",) or st not in ("warm", "hot", ""):
            continue
        if w == "w5" and "cold" in param:
            continue
        rv = S.get((w, src, param, st, "rclone"))
        if rv:
            better = v[0] >= rv[0] if w == "w1" else v[0] <= rv[0]
            ahead.append((f"{w} {src} {param} {st}".strip(), better))
    if ahead:
        lost = [n for n, ok in ahead if not ok]
        add("every other warm workload ahead of rclone",
            f"{len(ahead) - len(lost)}/{len(ahead)} ahead" + (f"; behind in: {', '.join(lost)}" if lost else ""),
            not lost)
    rss = EXTRA.get("w8rss")
    if rss:
        hwm = max(x[0] for x in rss)
        add(f"metadata walk: daemon RSS < 256 MiB (measured at {P['meta_files']:,} files)",
            f"peak {hwm / MIB:.1f} MiB", hwm < 256 * MIB)
    return "| target | measured | verdict |\n|---|---|---|\n" + "\n".join(rows)


def report(quick, elapsed):
    S = summarize()
    host = socket.gethostname()
    date = datetime.date.today().isoformat()
    stem = f"{date}-{host}" + ("-quick" if quick else "")
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, stem + ".json"), "w") as f:
        json.dump(dict(meta=META, params={k: v for k, v in P.items()}, results=RESULTS), f)
    try:
        pl = plots(S, stem)
    except Exception as e:  # plots are a nicety; the numbers are the report
        log("plots failed:", e)
        pl = []
    L = []
    a = L.append
    a(f"# hoardfs benchmark results: {date} on {host}{' (--quick smoke run: tiny sizes, 1 run; numbers not meaningful)' if quick else ''}")
    a("")
    a(f"Made by `bench/run{' --quick' if quick else ''}` in {elapsed / 60:.1f} min. Machine: {META.get('machine')}. "
      f"hoardfs {META.get('hoardfs')}.")
    a("")
    a("## Set-up")
    a(f"- **local**: a directory on the machine's disk ({META.get('localfs')}).")
    a(f"- **slow**: ext4 on a loop device (`losetup --direct-io=on`) over an image on the same disk, "
      f"throttled with {META.get('throttle')}.")
    a(f"- **remote**: {META.get('remote')}.")
    a("- Systems: **source** = the source read directly; **cache** = the hoardfs cache directory "
      "(`CACHE/data/...`) read directly, filled by a hoardfs mount first; **hoardfs** = "
      "`hoardfs SRC MNT --cache-dir DIR` (defaults: 8 MiB whole-file threshold, 1 MiB chunks, "
      "1 s TTLs, passthrough); **bindfs** = `bindfs SRC MNT` (no cache; floor of plain FUSE); "
      "**rclone** = `rclone mount :local:SRC MNT --vfs-cache-mode full --cache-dir DIR "
      "--vfs-cache-max-age 24h --dir-cache-time 5m` (Debian's rclone).")
    a(f"- **catfs**: left out. {META.get('catfs')}")
    a("- States: **cold** = empty persistent cache, fresh mount (and fresh SSHFS mount for the remote "
      "source), `echo 3 > /proc/sys/vm/drop_caches`; **warm** = persistent cache filled, page cache "
      "dropped (reads come from the local disk); **hot** = the same read repeated at once (page cache "
      "hot). Source and bindfs have no persistent cache, so they have no warm state: their ‘vs source’ "
      "reference in the warm rows is the cold source.")
    a(f"- Runs: {P['runs']} per measurement, systems interleaved (the order rotates every run); each "
      "system is the only one mounted while it runs.")
    a(f"- Sizes: sequential file {', '.join(f'{k} {v // MIB} MiB' for k, v in P['seq'].items())}"
      + ("" if quick or min(P["seq"].values()) >= 1024 * MIB else
         " (1 GiB only on the local source: the slow and remote sources were scaled down "
         "to keep the full run near an hour; `--issue-sizes` runs 1 GiB everywhere)") + ".")
    a("")
    if pl:
        a("## Plots")
        for t, f in pl:
            a(f"![{t}]({f})")
        a("")
    a("## W1: sequential read (MiB/s)")
    a(f"Command: `{CMDS.get('w1')}`. hoardfs-sr = hoardfs `--source-reads` (local and slow "
      "sources; its warm state is taken after the fill that follows the cold read).")
    a("")
    a(table(S, "w1", "MiB/s", True, param_label="read size"))
    a("")
    a("## W2: small preads (ns per call, local source, warm)")
    a(f"Command: `{CMDS.get('w2')}`. hoardfs-nopt = hoardfs `--no-passthrough`; "
      "hoardfs-ko (W4, W5) = hoardfs `--kernel-opens`; hoardfs-lease (W4, SSHFS source only) = "
      "hoardfs `--open-lease 60`.")
    a("")
    a(table(S, "w2", "ns per call", False, param_label="bytes"))
    a("")
    a("## W3: xCachefs read micro-benchmark (µs per page)")
    a(f"Command: `{CMDS.get('w3')}`. hoardfs-t0 = `--whole-file-threshold 0`, hoardfs-t400K = "
      "`--whole-file-threshold 400K`. With 1 MiB files and 1 MiB chunks both fetch each file whole "
      "on its first page read, so the two settings behave alike here (xCachefs's threshold mattered "
      "because its files were larger than its chunks).")
    a("")
    a(table(S, "w3", "µs per page", False))
    a("")
    a("## W4: grep -r over a real tree (seconds)")
    tree_desc = ("/usr/include/" + ",".join(P["tree"])) if P["tree"] else "/usr/include without node/ and llvm-14/"
    a(f"Tree: a copy of {tree_desc} ({META.get('tree_files')} files, {META.get('tree_mib')} MiB). "
      f"Command: `{CMDS.get('w4')}`.")
    a("")
    a(table(S, "w4", "seconds", False))
    a("")
    a("## W5: Andrew-style benchmark (seconds per phase)")
    a(CMDS.get("w5", ""))
    a("")
    a(table(S, "w5", "seconds", False, param_label="phase"))
    a("")
    for src, phs in EXTRA.get("w5req", {}).items():
        a(f"Requests that reached the hoardfs daemon per phase ({src} source, first run; from "
          "`hoardfs stats --json` deltas; the cold phases include the re-mount's own root lookups):")
        a("")
        a("| phase | requests |")
        a("|---|---|")
        for ph, req in phs.items():
            a(f"| {ph} | {', '.join(f'{k} {v}' for k, v in sorted(req.items(), key=lambda x: -x[1])) or 'none'} |")
        a("")
    a("## W6: Postmark (seconds)")
    if "w6" in CMDS:
        a(f"Command: {CMDS['w6']}" + ("" if quick or P["pm_tx"] >= 100000 else f" — {P['pm_tx']:,} transactions instead of the issue's 100,000, to fit the time budget (`--issue-sizes` runs 100,000)."))
        a("")
        a(table(S, "w6", "seconds", False))
    else:
        a(EXTRA.get("w6skip", "not run"))
    a("")
    a("## W7: symlink chains (ns per stat, local source, warm)")
    a(f"Command: `{CMDS.get('w7')}`. Absolute links point into each system's own mount.")
    if EXTRA.get("w7fail"):
        a(f"Could not run: {', '.join(sorted(EXTRA['w7fail']))} (rclone mount does not show symlinks "
          "of a local remote as symlinks; v1.60 has no --links for mount).")
    a("")
    a(table(S, "w7", "ns per stat", False, param_label="chain"))
    a("")
    a("## W8: metadata walk (seconds)")
    a(f"Command: `{CMDS.get('w8')}`" + ("" if quick or P["meta_files"] >= 1_000_000 else f" — {P['meta_files']:,} files instead of the issue's 1,000,000 (time budget; `--meta-files 1000000` runs the full size)") + ".")
    a("")
    a(table(S, "w8", "seconds", False))
    a("")
    if EXTRA.get("w8rss"):
        a("hoardfs daemon memory per run (peak RSS, RSS after the walks, RSS 2 s after "
          "`echo 2 > drop_caches`, inodes in its table after that):")
        a("")
        for hwm, rss, after, ino in EXTRA["w8rss"]:
            a(f"- peak {hwm / MIB:.1f} MiB, after walks {rss / MIB:.1f} MiB, after drop {after / MIB:.1f} MiB, inodes {ino}")
        a("")
    a("## Targets (from the issue; not asserted)")
    a("")
    a(targets(S))
    a("")
    if EXTRA.get("failed"):
        a("## Failures in this run")
        for x in EXTRA["failed"]:
            a(f"- {x}")
        a("")
    a("Raw data: `" + stem + ".json` beside this file.")
    path = os.path.join(RESULTS_DIR, stem + ".md")
    with open(path, "w") as f:
        f.write("\n".join(L) + "\n")
    log("wrote", path)


# ---------------------------------------------------------------------------------------

def main():
    global P, LOG
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--teardown", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated workloads (w1..w8)")
    ap.add_argument("--runs", type=int, help="runs per measurement (default 3; 1 with --quick)")
    ap.add_argument("--issue-sizes", action="store_true",
                    help="the issue's sizes: 1 GiB files on every source, 100,000 Postmark "
                         "transactions, 1,000,000 files in the metadata walk (several hours)")
    ap.add_argument("--meta-files", type=int, help="W8: files to walk (default 100,000)")
    ap.add_argument("--meta-systems", help="W8: comma-separated systems (default source,hoardfs,bindfs,rclone)")
    a = ap.parse_args()
    if a.teardown:
        teardown()
        return
    P = dict(QUICK if a.quick else FULL)
    if a.issue_sizes:
        P.update(seq={"local": 1024 * MIB, "slow": 1024 * MIB, "remote": 1024 * MIB},
                 pm_tx=100000, meta_files=1000000)
    if a.runs:
        P["runs"] = a.runs
    if a.meta_files:
        P["meta_files"] = a.meta_files
    if a.meta_systems:
        P["meta_systems"] = a.meta_systems.split(",")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    teardown()
    os.makedirs(WORK, exist_ok=True)
    LOG = open(os.path.join(WORK, "log.txt"), "w")
    t0 = time.time()
    try:
        sh(["cc", "-O2", "-o", BT, os.path.join(BENCH, "tools", "bt.c")])
        shutil.copy(HOARDFS_BUILT, HOARDFS)
        META["machine"] = (f"{os.cpu_count()} cores, {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB, "
                           f"Linux {os.uname().release}")
        META["hoardfs"] = sh(["git", "-C", REPO, "describe", "--always", "--dirty"], check=False).stdout.strip()
        META["catfs"] = open(CATFS_NOTE).read().strip() if os.path.exists(CATFS_NOTE) else "not attempted."
        srcs = setup_sources()
        META["localfs"] = sh(["findmnt", "-no", "FSTYPE,SOURCE", "-T", srcs["local"].path]).stdout.strip()
        tree = os.path.join(srcs["local"].path, "tree")
        META["tree_files"] = int(sh(f"find {tree} -type f | wc -l").stdout)
        META["tree_mib"] = int(sh(["du", "-sm", tree]).stdout.split()[0])
        work = [("w1", w1_seq), ("w2", w2_pread), ("w4", w4_grep), ("w5", w5_andrew),
                ("w3", w3_pages), ("w7", w7_symlinks), ("w6", w6_postmark), ("w8", w8_meta)]
        only = set(a.only.split(",")) if a.only else None
        for name, fn in work:
            if only and name not in only:
                continue
            log("=== workload", name)
            t = time.time()
            try:
                fn(srcs)
            except Exception as e:
                log(f"workload {name} FAILED: {e}")
                EXTRA.setdefault("failed", []).append(f"{name}: {str(e)[:300]}")
                for mp in mounts_under(os.path.join(WORK, "sys")):
                    umount(mp)
            log(f"=== {name} took {time.time() - t:.0f}s")
        report(a.quick, time.time() - t0)
    finally:
        teardown()
    if EXTRA.get("failed"):
        sys.exit(f"bench: {len(EXTRA['failed'])} workload(s) failed (see the report)")


if __name__ == "__main__":
    main()
