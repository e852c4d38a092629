//! Prometheus metrics (`--metrics-addr HOST:PORT`): the counters of `hoardfs stats` and a
//! latency histogram per request type, in the text exposition format at `/metrics`.
//!
//! The server is a tiny HTTP/1.1 responder on one thread: one request per connection,
//! read and write timeouts, a bounded request head. A scraper that misbehaves can stall
//! only the next scrape, never the file system. Every name is listed in docs/METRICS.md
//! (a test checks that each rendered name is there).

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::stats::{CacheSnapshot, LATENCY_BUCKETS, Op, Snapshot, Stats};

/// What the endpoint reads on each scrape.
pub trait Source: Send + Sync + 'static {
    fn snapshot(&self) -> Snapshot;
    fn stats(&self) -> &Stats;
}

impl Source for crate::fs::CachingFs {
    fn snapshot(&self) -> Snapshot {
        crate::fs::CachingFs::snapshot(self)
    }
    fn stats(&self) -> &Stats {
        &self.stats
    }
}

/// Longest request head we read; a GET from a scraper is a few hundred bytes.
const MAX_REQUEST: usize = 8 << 10;
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// Binds the endpoint's address: done before mounting, so that a busy port fails the
/// mount instead of leaving a mount without its endpoint.
pub fn bind(addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).with_context(|| format!("cannot listen for metrics on {addr}"))
}

/// Serves scrapes on a thread until the process exits; returns the bound address.
pub fn serve(listener: TcpListener, source: Arc<dyn Source>) -> anyhow::Result<SocketAddr> {
    let bound = listener.local_addr()?;
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                let Ok(conn) = conn else { continue };
                if let Err(e) = answer(conn, source.as_ref()) {
                    tracing::debug!("metrics request: {e}");
                }
            }
        })?;
    tracing::info!(%bound, "serving metrics");
    Ok(bound)
}

fn answer(mut conn: TcpStream, source: &dyn Source) -> std::io::Result<()> {
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST {
            return respond(&mut conn, "431 Request Header Fields Too Large", "", "");
        }
    }
    let line = String::from_utf8_lossy(&head);
    let mut words = line.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    match (method, path) {
        ("GET" | "HEAD", "/metrics") => {
            let body = render(&source.snapshot(), source.stats());
            let body = if method == "HEAD" { "" } else { body.as_str() };
            respond(
                &mut conn,
                "200 OK",
                "text/plain; version=0.0.4; charset=utf-8",
                body,
            )
        }
        ("GET" | "HEAD", "/") => respond(
            &mut conn,
            "200 OK",
            "text/plain; charset=utf-8",
            "hoardfs metrics: /metrics\n",
        ),
        ("GET" | "HEAD", _) => respond(&mut conn, "404 Not Found", "text/plain", "not found\n"),
        _ => respond(
            &mut conn,
            "405 Method Not Allowed",
            "text/plain",
            "GET only\n",
        ),
    }
}

fn respond(conn: &mut TcpStream, status: &str, ctype: &str, body: &str) -> std::io::Result<()> {
    let mut msg = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if !ctype.is_empty() {
        let _ = write!(msg, "Content-Type: {ctype}\r\n");
    }
    msg.push_str("\r\n");
    msg.push_str(body);
    conn.write_all(msg.as_bytes())?;
    conn.flush()
}

/// Escapes a label value (backslash, quote, newline), as the text format requires.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

struct Out(String);

impl Out {
    fn header(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.0, "# HELP {name} {help}");
        let _ = writeln!(self.0, "# TYPE {name} {kind}");
    }
    fn one(&mut self, name: &str, kind: &str, help: &str, v: u64) {
        self.header(name, kind, help);
        let _ = writeln!(self.0, "{name} {v}");
    }
}

/// The whole exposition for one scrape.
pub fn render(snap: &Snapshot, stats: &Stats) -> String {
    let mut o = Out(String::with_capacity(64 << 10));
    o.header(
        "hoardfs_info",
        "gauge",
        "Constant 1; labels describe the mount.",
    );
    let _ = writeln!(
        o.0,
        "hoardfs_info{{version=\"{}\",source=\"{}\",mountpoint=\"{}\",cache_dir=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION"),
        label(&snap.source),
        label(&snap.mountpoint),
        label(&snap.cache_dir)
    );

    o.header(
        "hoardfs_requests_total",
        "counter",
        "FUSE requests that reached the daemon, by operation.",
    );
    for op in Op::ALL {
        let _ = writeln!(
            o.0,
            "hoardfs_requests_total{{op=\"{}\"}} {}",
            op.name(),
            stats.op_count(*op)
        );
    }
    o.header(
        "hoardfs_request_duration_seconds",
        "histogram",
        "Time the daemon spent handling a request, by operation.",
    );
    for op in Op::ALL {
        let (buckets, sum_us) = stats.latency[*op as usize].snapshot();
        let mut cumulative = 0;
        for (k, n) in buckets.iter().enumerate().take(LATENCY_BUCKETS) {
            cumulative += n;
            let le = (1u64 << k) as f64 / 1e6;
            let _ = writeln!(
                o.0,
                "hoardfs_request_duration_seconds_bucket{{op=\"{}\",le=\"{le}\"}} {cumulative}",
                op.name()
            );
        }
        let count = cumulative + buckets[LATENCY_BUCKETS];
        let _ = writeln!(
            o.0,
            "hoardfs_request_duration_seconds_bucket{{op=\"{}\",le=\"+Inf\"}} {count}",
            op.name()
        );
        let _ = writeln!(
            o.0,
            "hoardfs_request_duration_seconds_sum{{op=\"{}\"}} {}",
            op.name(),
            sum_us as f64 / 1e6
        );
        let _ = writeln!(
            o.0,
            "hoardfs_request_duration_seconds_count{{op=\"{}\"}} {count}",
            op.name()
        );
    }

    // Cache counters are rendered from the counter table itself, so a counter added to
    // `stats.rs` shows up here (and the docs test asks for its line in METRICS.md).
    for ((name, v), (_, help)) in snap.cache.rows().into_iter().zip(CacheSnapshot::DOCS) {
        let help = format!("{}{}.", help[..1].to_uppercase(), &help[1..]);
        o.one(&format!("hoardfs_{name}_total"), "counter", &help, v);
    }

    o.one(
        "hoardfs_cache_bytes",
        "gauge",
        "Bytes of cached data (allocated blocks of the data files).",
        snap.cache_bytes,
    );
    o.one(
        "hoardfs_cache_files",
        "gauge",
        "Files with cached data.",
        snap.cache_files,
    );
    let c = &snap.cleaner;
    for (name, kind, help, v) in [
        (
            "hoardfs_cache_limit_bytes",
            "gauge",
            "The cache's size limit.",
            c.limit_bytes,
        ),
        (
            "hoardfs_cache_high_watermark_bytes",
            "gauge",
            "The cleaner starts above this usage.",
            c.high_watermark_bytes,
        ),
        (
            "hoardfs_cache_low_watermark_bytes",
            "gauge",
            "The cleaner cleans down to this usage.",
            c.low_watermark_bytes,
        ),
        (
            "hoardfs_cache_min_free_bytes",
            "gauge",
            "Free space kept on the cache's file system.",
            c.min_free_bytes,
        ),
        (
            "hoardfs_cache_pinned_bytes",
            "gauge",
            "Cached bytes of pinned files.",
            c.pinned_bytes,
        ),
        (
            "hoardfs_cleaner_runs_total",
            "counter",
            "Cleaner passes that evicted or tried to.",
            c.cleans,
        ),
        (
            "hoardfs_evicted_files_total",
            "counter",
            "Files evicted whole.",
            c.evicted_files,
        ),
        (
            "hoardfs_evicted_chunks_total",
            "counter",
            "Chunks evicted from partially kept files.",
            c.evicted_chunks,
        ),
        (
            "hoardfs_evicted_bytes_total",
            "counter",
            "Bytes freed by eviction.",
            c.evicted_bytes,
        ),
        (
            "hoardfs_chunks_not_cached_when_full_total",
            "counter",
            "Fetches served from the source without caching, the cache being full.",
            c.chunks_not_cached_when_full,
        ),
    ] {
        o.one(name, kind, help, v);
    }

    o.one(
        "hoardfs_open_handles",
        "gauge",
        "Open file and directory handles.",
        snap.open_handles,
    );
    let t = &snap.inode_table;
    for (name, kind, help, v) in [
        (
            "hoardfs_inodes",
            "gauge",
            "Entries in the inode table (referenced plus free).",
            t.entries,
        ),
        (
            "hoardfs_inodes_referenced",
            "gauge",
            "Inode-table entries the kernel holds.",
            t.referenced,
        ),
        (
            "hoardfs_inodes_free",
            "gauge",
            "Inode-table entries on the free list.",
            t.free,
        ),
        (
            "hoardfs_inodes_max",
            "gauge",
            "Soft maximum of the inode table.",
            t.max_inodes,
        ),
        (
            "hoardfs_inode_allocations_total",
            "counter",
            "Inode-table entries allocated.",
            t.allocations,
        ),
        (
            "hoardfs_inode_frees_total",
            "counter",
            "Inode-table entries freed.",
            t.frees,
        ),
        (
            "hoardfs_inode_reuses_total",
            "counter",
            "Lookups that revived a free entry.",
            t.reuses,
        ),
        (
            "hoardfs_inode_lookups_total",
            "counter",
            "Lookups served by the inode table.",
            t.lookups,
        ),
        (
            "hoardfs_inode_misses_after_free_total",
            "counter",
            "New entries for an object freed recently.",
            t.misses_after_free,
        ),
        (
            "hoardfs_inode_invalidations_total",
            "counter",
            "Entries the kernel was asked to drop (over the soft maximum).",
            t.invalidations,
        ),
    ] {
        o.one(name, kind, help, v);
    }
    let hs = &snap.health;
    for (name, kind, help, v) in [
        (
            "hoardfs_source_online",
            "gauge",
            "1 while the source answers; 0 in disconnected mode.",
            hs.online as u64,
        ),
        (
            "hoardfs_source_timeouts_total",
            "counter",
            "Source calls that ran past the source timeout.",
            hs.timeouts,
        ),
        (
            "hoardfs_source_stuck_calls",
            "gauge",
            "Source calls still running past their timeout.",
            hs.stuck_calls,
        ),
        (
            "hoardfs_offline_switches_total",
            "counter",
            "Switches to disconnected mode.",
            hs.went_offline,
        ),
        (
            "hoardfs_offline_requests_total",
            "counter",
            "Requests answered from the cache, or refused, while offline.",
            hs.offline_requests,
        ),
        (
            "hoardfs_offline_log_pending",
            "gauge",
            "Changes made offline not yet replayed to the source.",
            hs.log_pending,
        ),
        (
            "hoardfs_offline_log_replayed_total",
            "counter",
            "Offline changes replayed to the source.",
            hs.log_replayed,
        ),
        (
            "hoardfs_reintegration_conflicts_total",
            "counter",
            "Conflicts met replaying offline changes (both versions kept).",
            hs.conflicts,
        ),
    ] {
        o.one(name, kind, help, v);
    }
    let h = &snap.coherence;
    for (name, kind, help, v) in [
        (
            "hoardfs_watcher_active",
            "gauge",
            "1 if the source watcher reports changes made behind the mount.",
            h.watching as u64,
        ),
        (
            "hoardfs_watched_dirs",
            "gauge",
            "Source directories watched.",
            h.watched_dirs,
        ),
        (
            "hoardfs_watcher_events_total",
            "counter",
            "inotify events received from the source.",
            h.watcher_events,
        ),
        (
            "hoardfs_watcher_overflows_total",
            "counter",
            "Times the watcher lost events and invalidated everything.",
            h.watcher_overflows,
        ),
        (
            "hoardfs_source_changes_total",
            "counter",
            "Changes made behind the mount that invalidated cached data.",
            h.changes_detected,
        ),
        (
            "hoardfs_kernel_inval_inode_total",
            "counter",
            "Kernel notifications dropping attributes, data or listings.",
            h.inval_inode,
        ),
        (
            "hoardfs_kernel_inval_entry_total",
            "counter",
            "Kernel notifications dropping names.",
            h.inval_entry,
        ),
        (
            "hoardfs_leases_active",
            "gauge",
            "Validation leases held by open files (sources without a watcher).",
            h.leases_active,
        ),
        (
            "hoardfs_leases_expired_total",
            "counter",
            "Leases expired and revalidated against the source.",
            h.leases_expired,
        ),
    ] {
        o.one(name, kind, help, v);
    }
    o.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (Snapshot, Stats) {
        let stats = Stats::default();
        drop(stats.start(Op::Read));
        drop(stats.start(Op::Read));
        let mut snap = Snapshot {
            mountpoint: "/mnt/a \"b\"".into(),
            ..Default::default()
        };
        snap.cache.bytes_from_source = 42;
        (snap, stats)
    }

    #[test]
    fn exposition_is_well_formed() {
        let (snap, stats) = sample();
        let text = render(&snap, &stats);
        assert!(text.contains("hoardfs_requests_total{op=\"read\"} 2\n"));
        assert!(text.contains("hoardfs_request_duration_seconds_count{op=\"read\"} 2\n"));
        assert!(
            text.contains("hoardfs_request_duration_seconds_bucket{op=\"read\",le=\"+Inf\"} 2\n")
        );
        assert!(text.contains("hoardfs_bytes_from_source_total 42\n"));
        assert!(text.contains("mountpoint=\"/mnt/a \\\"b\\\"\""));
        // Every sample line belongs to a family declared with # TYPE before it.
        let mut declared = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(declared.insert(name.to_string()), "{name} declared twice");
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|f| declared.contains(*f)))
                    .unwrap_or(name);
                assert!(declared.contains(family), "{name} has no # TYPE");
                let value = line.rsplit(' ').next().unwrap();
                assert!(value.parse::<f64>().is_ok(), "bad value in {line:?}");
            }
        }
    }

    #[test]
    fn histogram_buckets_are_cumulative() {
        let (snap, stats) = sample();
        let text = render(&snap, &stats);
        let counts: Vec<u64> = text
            .lines()
            .filter(|l| l.starts_with("hoardfs_request_duration_seconds_bucket{op=\"read\""))
            .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
            .collect();
        assert_eq!(counts.len(), LATENCY_BUCKETS + 1);
        assert!(counts.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*counts.last().unwrap(), 2);
    }

    #[test]
    fn every_metric_is_documented() {
        let doc = include_str!("../docs/METRICS.md");
        let (snap, stats) = sample();
        for line in render(&snap, &stats).lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(
                    doc.contains(&format!("`{name}`")),
                    "{name} is not listed in docs/METRICS.md"
                );
            }
        }
    }

    #[test]
    fn the_endpoint_answers_http() {
        struct Fake(Stats);
        impl Source for Fake {
            fn snapshot(&self) -> Snapshot {
                Snapshot::default()
            }
            fn stats(&self) -> &Stats {
                &self.0
            }
        }
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = serve(listener, Arc::new(Fake(Stats::default()))).unwrap();
        let get = |req: &str| {
            let mut c = TcpStream::connect(addr).unwrap();
            c.write_all(req.as_bytes()).unwrap();
            let mut s = String::new();
            c.read_to_string(&mut s).unwrap();
            s
        };
        let ok = get("GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(ok.contains("hoardfs_requests_total{op=\"lookup\"} 0"));
        let (head, body) = ok.split_once("\r\n\r\n").unwrap();
        assert!(head.contains(&format!("Content-Length: {}", body.len())));
        assert!(get("GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get("POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    }
}
