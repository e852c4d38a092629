//! systemd's readiness protocol (sd_notify(3)): one datagram of `KEY=VALUE` lines to the
//! Unix socket named by `$NOTIFY_SOCKET` (a path, or `@name` for the abstract namespace).
//! Without `$NOTIFY_SOCKET` (not started by systemd) every call does nothing. A few lines of
//! std instead of libsystemd: the daemon must not depend on systemd being there.

use std::os::unix::net::UnixDatagram;
use std::path::PathBuf;
use std::sync::OnceLock;

/// How often the daemon refreshes its `STATUS=` line.
pub const STATUS_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// Where notifications go, read once. The variable stays in the environment: hoardfs
/// starts no programs that could misuse it, and changing the environment of a threaded
/// process is unsound.
fn target() -> Option<PathBuf> {
    static TARGET: OnceLock<Option<PathBuf>> = OnceLock::new();
    TARGET
        .get_or_init(|| {
            std::env::var_os("NOTIFY_SOCKET")
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        })
        .clone()
}

/// Is anyone listening (was `$NOTIFY_SOCKET` set)?
pub fn enabled() -> bool {
    target().is_some()
}

/// Sends `state` (e.g. `"READY=1\nSTATUS=serving"`). Errors are logged, never fatal: a
/// service manager that went away must not take the mount with it.
pub fn notify(state: &str) {
    let Some(path) = target() else { return };
    if let Err(e) = send(&path, state) {
        tracing::warn!("sd_notify to {}: {e}", path.display());
    }
}

fn send(path: &std::path::Path, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    let bytes = path.as_os_str().as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), path)?;
    }
    Ok(())
}

/// The `STATUS=` line: what `systemctl status` shows under the unit.
pub fn status_line(s: &crate::stats::Snapshot) -> String {
    let c = &s.cache;
    let opens = c.open_hits + c.open_misses;
    format!(
        "{}; cache {} in {} files (limit {}); opens {} ({} hits); from source {}, from cache {}",
        if s.health.online { "online" } else { "OFFLINE" },
        human(s.cache_bytes),
        s.cache_files,
        human(s.cleaner.limit_bytes),
        opens,
        c.open_hits,
        human(c.bytes_from_source),
        human(c.bytes_from_cache),
    )
}

fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_to_path_and_abstract_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        send(&path, "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");

        use std::os::linux::net::SocketAddrExt;
        let name = format!("hoardfs-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        send(std::path::Path::new(&format!("@{name}")), "STOPPING=1").unwrap();
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"STOPPING=1");
    }

    #[test]
    fn status_line_reads_like_a_sentence() {
        let mut s = crate::stats::Snapshot {
            cache_bytes: 3 << 20,
            cache_files: 2,
            ..Default::default()
        };
        s.cache.open_hits = 5;
        s.cache.open_misses = 1;
        let line = status_line(&s);
        assert!(line.contains("cache 3.0 MiB in 2 files"), "{line}");
        assert!(line.contains("opens 6 (5 hits)"), "{line}");
        assert!(!line.contains('\n'));
    }
}
