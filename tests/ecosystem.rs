//! How hoardfs fits the system around it: the metrics endpoint of a real mount, systemd's
//! readiness protocol, mount(8) and fstab, the config file, generated docs.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{BIN, TestMount, is_mounted};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn scrape(port: u16) -> String {
    let mut c = TcpStream::connect(("127.0.0.1", port)).expect("connect to metrics");
    c.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut s = String::new();
    c.read_to_string(&mut s).unwrap();
    assert!(s.starts_with("HTTP/1.1 200 OK\r\n"), "{s}");
    s.split_once("\r\n\r\n").unwrap().1.to_string()
}

/// The value of the sample whose name and labels are exactly `series`.
fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .unwrap_or_else(|| panic!("no sample {series}"))
        .parse()
        .unwrap()
}

#[test]
fn metrics_of_a_real_mount_move_when_files_are_read() {
    let port = free_port();
    let mut m = TestMount::new(&["--metrics-addr", &format!("127.0.0.1:{port}")]);
    for i in 0..5 {
        std::fs::write(m.s(&format!("f{i}")), common::pattern(100_000, i)).unwrap();
    }
    let before = scrape(port);
    assert_eq!(sample(&before, "hoardfs_bytes_from_source_total"), 0.0);

    for i in 0..5 {
        let data = std::fs::read(m.m(&format!("f{i}"))).unwrap();
        assert_eq!(data, common::pattern(100_000, i));
    }
    let after = scrape(port);
    let opens = r#"hoardfs_requests_total{op="open"}"#;
    assert!(sample(&after, opens) >= sample(&before, opens) + 5.0);
    assert_eq!(
        sample(&after, "hoardfs_bytes_from_source_total"),
        500_000.0,
        "each file fetched once, whole"
    );
    assert_eq!(sample(&after, "hoardfs_open_misses_total"), 5.0);
    assert!(sample(&after, "hoardfs_cache_bytes") >= 500_000.0);
    assert!(
        sample(
            &after,
            r#"hoardfs_request_duration_seconds_count{op="open"}"#
        ) >= 5.0
    );
    assert!(sample(&after, "hoardfs_inodes") >= 6.0);

    // Read again: hits now, nothing more from the source.
    for i in 0..5 {
        std::fs::read(m.m(&format!("f{i}"))).unwrap();
    }
    let again = scrape(port);
    assert_eq!(sample(&again, "hoardfs_open_hits_total"), 5.0);
    assert_eq!(sample(&again, "hoardfs_bytes_from_source_total"), 500_000.0);
    m.unmount();
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the endpoint goes away with the daemon"
    );
}

#[test]
fn a_busy_metrics_port_fails_the_mount_with_a_message() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dirs = tempfile::tempdir().unwrap();
    for d in ["src", "mnt"] {
        std::fs::create_dir(dirs.path().join(d)).unwrap();
    }
    let out = Command::new(BIN)
        .arg(dirs.path().join("src"))
        .arg(dirs.path().join("mnt"))
        .arg("--cache-dir")
        .arg(dirs.path().join("cache"))
        .args(["--metrics-addr", &format!("127.0.0.1:{port}")])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot listen for metrics"), "{err}");
    assert!(!is_mounted(&dirs.path().join("mnt")));
}

/// Receives datagrams until one contains `want`, or fails after `secs`.
fn recv_until(sock: &UnixDatagram, want: &str, secs: u64) -> String {
    sock.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut buf = vec![0u8; 4096];
    loop {
        if let Ok(n) = sock.recv(&mut buf) {
            let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
            if msg.lines().any(|l| l == want) {
                return msg;
            }
        }
        assert!(Instant::now() < deadline, "no {want} within {secs} s");
    }
}

/// Unmounts and kills a daemon a test started, if the test ends (or panics) first.
struct Daemon<'a> {
    /// `None` once the test has reaped it (the pid may be reused).
    pid: Option<u32>,
    mnt: &'a std::path::Path,
}

impl Drop for Daemon<'_> {
    fn drop(&mut self) {
        if is_mounted(self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(self.mnt).status();
        }
        if let Some(pid) = self.pid {
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

#[test]
fn readiness_and_stopping_reach_notify_socket() {
    let dirs = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(dirs.path()).unwrap();
    let (src, mnt) = (base.join("src"), base.join("mnt"));
    for d in [&src, &mnt] {
        std::fs::create_dir(d).unwrap();
    }
    std::fs::write(src.join("hello"), b"hi").unwrap();
    let sock_path = base.join("notify");
    let sock = UnixDatagram::bind(&sock_path).unwrap();
    let mut child = Command::new(BIN)
        .arg(&src)
        .arg(&mnt)
        .arg("--cache-dir")
        .arg(base.join("cache"))
        .arg("-f")
        .env("NOTIFY_SOCKET", &sock_path)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut guard = Daemon {
        pid: Some(child.id()),
        mnt: &mnt,
    };
    let ready = recv_until(&sock, "READY=1", 20);
    // Readiness means the mount answers now, without waiting.
    assert!(is_mounted(&mnt), "READY=1 before the mount exists");
    assert_eq!(std::fs::read(mnt.join("hello")).unwrap(), b"hi");
    assert!(
        ready.contains(&format!("MAINPID={}", child.id())),
        "{ready}"
    );
    assert!(
        ready
            .lines()
            .any(|l| l.starts_with("STATUS=online; cache ")),
        "{ready}"
    );
    assert!(hoardfs::control::request_stats(&mnt).is_ok());

    // SIGTERM, as systemd stops a service.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    recv_until(&sock, "STOPPING=1", 20);
    let status = child.wait().unwrap();
    guard.pid = None;
    assert!(status.success(), "{status}");
    assert!(!is_mounted(&mnt));
}

#[test]
fn a_daemonized_mount_notifies_an_abstract_socket_with_its_own_pid() {
    use std::os::linux::net::SocketAddrExt;
    let dirs = tempfile::tempdir().unwrap();
    let base = std::fs::canonicalize(dirs.path()).unwrap();
    let (src, mnt) = (base.join("src"), base.join("mnt"));
    for d in [&src, &mnt] {
        std::fs::create_dir(d).unwrap();
    }
    let name = format!("hoardfs-ecosystem-{}", std::process::id());
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let sock = UnixDatagram::bind_addr(&addr).unwrap();
    let status = Command::new(BIN)
        .arg(&src)
        .arg(&mnt)
        .arg("--cache-dir")
        .arg(base.join("cache"))
        .env("NOTIFY_SOCKET", format!("@{name}"))
        .status()
        .unwrap();
    assert!(status.success());
    let ready = recv_until(&sock, "READY=1", 20);
    let pid: u32 = ready
        .lines()
        .find_map(|l| l.strip_prefix("MAINPID="))
        .expect("MAINPID")
        .parse()
        .unwrap();
    assert!(Path::new(&format!("/proc/{pid}")).exists(), "{ready}");
    assert!(is_mounted(&mnt));
    // The cache's housekeeping threads run in the daemon: threads started before its fork
    // would not have survived it.
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .collect();
    for want in ["reaper", "cache-removals"] {
        assert!(
            threads.iter().any(|t| t == want),
            "no {want} in {threads:?}"
        );
    }
    assert!(Command::new("umount").arg(&mnt).status().unwrap().success());
    recv_until(&sock, "STOPPING=1", 20);
    let deadline = Instant::now() + Duration::from_secs(20);
    // Orphaned daemons are reaped by whatever PID 1 is here, maybe late: a zombie counts.
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .is_ok_and(|s| s.rsplit(')').next().is_some_and(|r| !r.starts_with(" Z")))
    };
    while alive(pid) {
        assert!(Instant::now() < deadline, "daemon {pid} did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Source, cache and mount point for tests that start the daemon themselves.
struct Dirs {
    _tmp: tempfile::TempDir,
    src: std::path::PathBuf,
    cache: std::path::PathBuf,
    mnt: std::path::PathBuf,
}

impl Dirs {
    fn new() -> Dirs {
        let tmp = tempfile::Builder::new()
            .prefix("hoardfs-eco")
            .tempdir()
            .unwrap();
        let base = std::fs::canonicalize(tmp.path()).unwrap();
        let d = Dirs {
            src: base.join("src"),
            cache: base.join("cache"),
            mnt: base.join("mnt"),
            _tmp: tmp,
        };
        for p in [&d.src, &d.mnt] {
            std::fs::create_dir(p).unwrap();
        }
        d
    }

    /// Unmounts and waits for the mount to go (the daemon exits with it).
    fn unmount(&self) {
        assert!(
            Command::new("umount")
                .arg(&self.mnt)
                .status()
                .unwrap()
                .success()
        );
        assert!(!is_mounted(&self.mnt));
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        if is_mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
    }
}

fn hoardfs(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().unwrap()
}

#[test]
fn the_log_level_of_a_live_mount_can_be_raised() {
    let d = Dirs::new();
    let st = Command::new(BIN)
        .arg(&d.src)
        .arg(&d.mnt)
        .arg("--cache-dir")
        .arg(&d.cache)
        .env("HOARDFS_LOG", "warn")
        .status()
        .unwrap();
    assert!(st.success());
    let log = d.cache.join("hoardfs.log");
    let mnt = d.mnt.to_str().unwrap();
    let bad = hoardfs(&["set", mnt, "log=debug[["]);
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("log:"));
    assert!(
        !std::fs::read_to_string(&log).unwrap().contains("mounted"),
        "info lines are filtered at warn"
    );
    let ok = hoardfs(&["set", mnt, "log=info"]);
    assert!(ok.status.success(), "{ok:?}");
    d.unmount();
    // The daemon logs "unmounted" as it exits: wait for it.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("unmounted") {
            assert!(text.contains(r#"log filter is now "info""#), "{text}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no 'unmounted' in the log: {text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `mount -t fuse.hoardfs` and `mount -a` with an fstab, through mount(8) and fuse3's
/// mount.fuse3, which runs `hoardfs SOURCE MOUNTPOINT -o OPTIONS` from the PATH that
/// mount(8) gives helpers (none: /bin/sh's default, which has /usr/local/bin). The test runs
/// in its own mount namespace with a directory holding `hoardfs` bound over
/// /usr/local/bin, so it neither installs anything nor depends on an installed hoardfs.
#[test]
fn mount_8_and_fstab_mount_through_mount_fuse3() {
    let d = Dirs::new();
    std::fs::write(d.src.join("hello"), b"from fstab").unwrap();
    let base = d.src.parent().unwrap();
    let bin = base.join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(BIN, bin.join("hoardfs")).unwrap();
    let (auto_mnt, noauto_mnt) = (base.join("auto"), base.join("noauto"));
    for p in [&auto_mnt, &noauto_mnt] {
        std::fs::create_dir(p).unwrap();
    }
    let fstab = base.join("fstab");
    std::fs::write(
        &fstab,
        format!(
            "# a temporary fstab for mount -T\n\
             {src} {auto} fuse.hoardfs cache_dir={cache}2,_netdev,nofail,x-systemd.requires=network-online.target,noatime,defaults 0 0\n\
             {src} {noauto} fuse.hoardfs cache_dir={cache}3,noauto,_netdev 0 0\n",
            src = d.src.display(),
            auto = auto_mnt.display(),
            noauto = noauto_mnt.display(),
            cache = d.cache.display(),
        ),
    )
    .unwrap();
    let script = format!(
        r#"set -eu
# Copies of other FUSE mounts in this namespace would keep their daemons alive after
# their tests unmount them: drop the copies first.
awk '$3 ~ /^fuse/ {{print $2}}' /proc/self/mounts | while read -r m; do umount -l "$m"; done
mount --bind {bin} /usr/local/bin
mount -t fuse.hoardfs {src} {mnt} -o cache_dir={cache},_netdev,nofail,x-systemd.automount,user
grep -q " {mnt} fuse.hoardfs " /proc/self/mounts
test "$(cat {mnt}/hello)" = "from fstab"
hoardfs stats {mnt} | grep -q "open_misses *1$"
umount {mnt}
mount -T {fstab} -a
test "$(cat {auto}/hello)" = "from fstab"
grep " {auto} fuse.hoardfs " /proc/self/mounts
if mountpoint -q {noauto}; then echo "noauto line was mounted"; exit 1; fi
umount {auto}
echo done
"#,
        bin = bin.display(),
        src = d.src.display(),
        mnt = d.mnt.display(),
        cache = d.cache.display(),
        fstab = fstab.display(),
        auto = auto_mnt.display(),
        noauto = noauto_mnt.display(),
    );
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    // Each daemon removes its control socket as it exits.
    let deadline = Instant::now() + Duration::from_secs(20);
    for m in [&d.mnt, &auto_mnt] {
        while hoardfs::control::socket_path(m).exists() {
            assert!(
                Instant::now() < deadline,
                "daemon of {} did not exit",
                m.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert!(
        out.status.success() && stdout.ends_with("done\n"),
        "{}\nstdout: {stdout}\nstderr: {stderr}",
        out.status
    );
    assert!(
        stdout.contains("rw,nosuid,nodev"),
        "mounted with the default safe flags: {stdout}"
    );
    // mount.fuse3 hands the options on; the daemon logs what it mounted.
    assert!(d.cache.join("hoardfs.log").exists());
}

/// The units in contrib/ pass `systemd-analyze verify` without a single warning (skipped
/// where systemd is not installed). hoardfs is put on the unit's search path in a private
/// mount namespace, as for the fstab test.
#[test]
fn contrib_units_pass_systemd_analyze_verify() {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("systemd-analyze is not installed: units not verified");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let bin = tmp.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    std::os::unix::fs::symlink(BIN, bin.join("hoardfs")).unwrap();
    let contrib = Path::new(env!("CARGO_MANIFEST_DIR")).join("contrib");
    for unit in ["hoardfs@.service", "mnt-media.mount"] {
        std::fs::copy(contrib.join(unit), tmp.path().join(unit)).unwrap();
    }
    let script = format!(
        "mount --bind {} /usr/local/bin && cd {} && \
         systemd-analyze verify --man=no ./hoardfs@media.service ./mnt-media.mount",
        bin.display(),
        tmp.path().display()
    );
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c", &script])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && stderr.trim().is_empty(), "{stderr}");
}

#[test]
fn config_check_reports_lines_and_a_valid_file_mounts_by_section() {
    let d = Dirs::new();
    let bad = d.src.parent().unwrap().join("bad.toml");
    std::fs::write(
        &bad,
        "[mount.a]\nsource = \"/s\"\nmountpoint = \"/m\"\ncache-size = \"1G\"\n",
    )
    .unwrap();
    let out = hoardfs(&["config", "check", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(&format!("{}:4:1: unknown key `cache-size`", bad.display())),
        "{err}"
    );

    std::fs::write(d.src.join("f"), b"data").unwrap();
    let good = d.src.parent().unwrap().join("good.toml");
    std::fs::write(
        &good,
        format!(
            "chunk_size = \"64K\"\n[mount.test]\nsource = \"{}\"\nmountpoint = \"{}\"\n\
             cache_dir = \"{}\"\n",
            d.src.display(),
            d.mnt.display(),
            d.cache.display()
        ),
    )
    .unwrap();
    let out = hoardfs(&["config", "check", good.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("mounts: test"));
    let out = hoardfs(&["--config", good.to_str().unwrap(), "--mount", "test"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::read(d.mnt.join("f")).unwrap(), b"data");
    assert!(d.cache.join("data/f").exists(), "cache_dir from the file");
    d.unmount();
}
