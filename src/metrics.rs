//! Prometheus metrics (`--metrics-addr HOST:PORT`): the counters of `hoardfs stats` and a
//! latency histogram per request type, in the Prometheus text exposition format (0.0.4)
//! at `/metrics`.
//!
//! The exposition is written by the `prometheus-client` crate: a [`Collector`] reads the
//! daemon's own counters ([`Stats`], [`Snapshot`]) on each scrape and hands them to the
//! crate's encoder as constant metrics, so no value is stored twice.
//!
//! The server is a tiny HTTP/1.1 responder on one thread: one request per connection,
//! read and write timeouts, a bounded request head. A scraper that misbehaves can stall
//! only the next scrape, never the file system. Every name is listed in docs/METRICS.md
//! (a test checks that each rendered name is there).

use std::fmt::{self, Write as _};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet, prometheus_text};
use prometheus_client::metrics::MetricType::{self, Counter, Gauge, Histogram, Info};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::{Registry, Unit};

use crate::stats::{CacheSnapshot, LATENCY_BUCKETS, Op, Snapshot, Stats, errno_name};
use crate::threads::Threads;

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

/// Serves scrapes on a thread of the returned group until it stops; returns the bound
/// address too.
pub fn serve(
    listener: TcpListener,
    source: Arc<dyn Source>,
) -> anyhow::Result<(SocketAddr, Threads)> {
    let bound = listener.local_addr()?;
    let registry = registry(source);
    let threads = Threads::new("metrics");
    // A connection of our own ends the thread's wait in accept.
    threads.on_stop(move || drop(TcpStream::connect_timeout(&bound, IO_TIMEOUT)));
    threads.spawn("metrics", move |stop| {
        for conn in listener.incoming() {
            if stop.is_set() {
                return;
            }
            let Ok(conn) = conn else { continue };
            if let Err(e) = answer(conn, &registry) {
                tracing::debug!("metrics request: {e}");
            }
        }
    })?;
    tracing::info!(%bound, "serving metrics");
    Ok((bound, threads))
}

fn answer(mut conn: TcpStream, registry: &Registry) -> std::io::Result<()> {
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
            let body = render(registry);
            let body = if method == "HEAD" { "" } else { body.as_str() };
            respond(&mut conn, "200 OK", prometheus_text::CONTENT_TYPE, body)
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

/// The registry the endpoint encodes: one collector, reading `source` on each scrape.
fn registry(source: Arc<dyn Source>) -> Registry {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(source)));
    registry
}

/// The whole exposition for one scrape, in the Prometheus text format (0.0.4).
fn render(registry: &Registry) -> String {
    let mut text = String::with_capacity(64 << 10);
    prometheus_text::encode(&mut text, registry).expect("writing to a String cannot fail");
    text
}

/// Reads the daemon's counters when scraped; keeps no values of its own.
struct Scrape(Arc<dyn Source>);

impl fmt::Debug for Scrape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Scrape")
    }
}

impl Collector for Scrape {
    fn encode(&self, mut e: DescriptorEncoder) -> fmt::Result {
        encode(&mut e, &self.0.snapshot(), self.0.stats())
    }
}

/// The crate builds a scraped name from a base, a unit and the type's suffix (`_total`
/// for a counter, `_info` for an info): takes a name as scraped (as listed in
/// docs/METRICS.md) apart into those.
fn descriptor(name: &str, kind: MetricType) -> (&str, Option<Unit>) {
    let suffix = match kind {
        Counter => "_total",
        Info => "_info",
        _ => "",
    };
    let name = name
        .strip_suffix(suffix)
        .unwrap_or_else(|| panic!("a {} name ends in {suffix}: {name}", kind.as_str()));
    for (unit_suffix, unit) in [("_bytes", Unit::Bytes), ("_seconds", Unit::Seconds)] {
        if let Some(base) = name.strip_suffix(unit_suffix) {
            return (base, Some(unit));
        }
    }
    (name, None)
}

/// One counter or gauge without labels.
fn one(e: &mut DescriptorEncoder, name: &str, kind: MetricType, help: &str, v: u64) -> fmt::Result {
    let (base, unit) = descriptor(name, kind);
    let m = e.encode_descriptor(base, help, unit.as_ref(), kind)?;
    match kind {
        Counter => ConstCounter::new(v).encode(m),
        _ => ConstGauge::new(v).encode(m),
    }
}

fn encode(e: &mut DescriptorEncoder, snap: &Snapshot, stats: &Stats) -> fmt::Result {
    let (base, _) = descriptor("hoardfs_info", Info);
    e.encode_descriptor(base, "Constant 1; labels describe the mount.", None, Info)?
        .encode_info(&[
            ("version", env!("CARGO_PKG_VERSION")),
            ("source", &snap.source),
            ("mountpoint", &snap.mountpoint),
            ("cache_dir", &snap.cache_dir),
        ])?;

    let (base, unit) = descriptor("hoardfs_requests_total", Counter);
    let mut m = e.encode_descriptor(
        base,
        "FUSE requests that reached the daemon, by operation.",
        unit.as_ref(),
        Counter,
    )?;
    for op in Op::ALL {
        ConstCounter::new(stats.op_count(*op)).encode(m.encode_family(&[("op", op.name())])?)?;
    }

    let (base, unit) = descriptor("hoardfs_errors_total", Counter);
    let mut m = e.encode_descriptor(
        base,
        "FUSE requests answered with an error, by operation and errno.",
        unit.as_ref(),
        Counter,
    )?;
    for (op, errno, n) in stats.errors() {
        let errno = errno_name(errno);
        ConstCounter::new(n).encode(m.encode_family(&[("op", op.name()), ("errno", &errno)])?)?;
    }

    let (base, unit) = descriptor("hoardfs_request_duration_seconds", Histogram);
    let mut m = e.encode_descriptor(
        base,
        "Time the daemon spent handling a request, by operation.",
        unit.as_ref(),
        Histogram,
    )?;
    for op in Op::ALL {
        // Per-bucket counts, bounds 2^k µs; the crate makes them cumulative and adds the
        // +Inf bucket (the overflow bucket is in `count` only).
        let (counts, sum_us) = stats.latency[*op as usize].snapshot();
        let buckets: Vec<(f64, u64)> = (0..LATENCY_BUCKETS)
            .map(|k| ((1u64 << k) as f64 / 1e6, counts[k]))
            .collect();
        m.encode_family(&[("op", op.name())])?
            .encode_histogram::<NoLabelSet>(
                sum_us as f64 / 1e6,
                counts.iter().sum(),
                &buckets,
                None,
            )?;
    }

    // Cache counters are rendered from the counter table itself, so a counter added to
    // `stats.rs` shows up here (and the docs test asks for its line in METRICS.md).
    for ((name, v), (_, help)) in snap.cache.rows().into_iter().zip(CacheSnapshot::DOCS) {
        let help = format!("{}{}.", help[..1].to_uppercase(), &help[1..]);
        one(e, &format!("hoardfs_{name}_total"), Counter, &help, v)?;
    }

    let c = &snap.cleaner;
    let t = &snap.inode_table;
    let hs = &snap.health;
    let h = &snap.coherence;
    for (name, kind, help, v) in [
        (
            "hoardfs_cache_bytes",
            Gauge,
            "Bytes of cached data (allocated blocks of the data files).",
            snap.cache_bytes,
        ),
        (
            "hoardfs_cache_files",
            Gauge,
            "Files with cached data.",
            snap.cache_files,
        ),
        (
            "hoardfs_cache_limit_bytes",
            Gauge,
            "The cache's size limit.",
            c.limit_bytes,
        ),
        (
            "hoardfs_cache_high_watermark_bytes",
            Gauge,
            "The cleaner starts above this usage.",
            c.high_watermark_bytes,
        ),
        (
            "hoardfs_cache_low_watermark_bytes",
            Gauge,
            "The cleaner cleans down to this usage.",
            c.low_watermark_bytes,
        ),
        (
            "hoardfs_cache_min_free_bytes",
            Gauge,
            "Free space kept on the cache's file system.",
            c.min_free_bytes,
        ),
        (
            "hoardfs_cache_pinned_bytes",
            Gauge,
            "Cached bytes of pinned files.",
            c.pinned_bytes,
        ),
        (
            "hoardfs_cleaner_runs_total",
            Counter,
            "Cleaner passes that evicted or tried to.",
            c.cleans,
        ),
        (
            "hoardfs_evicted_files_total",
            Counter,
            "Files evicted whole.",
            c.evicted_files,
        ),
        (
            "hoardfs_evicted_chunks_total",
            Counter,
            "Chunks evicted from partially kept files.",
            c.evicted_chunks,
        ),
        (
            "hoardfs_evicted_bytes_total",
            Counter,
            "Bytes freed by eviction.",
            c.evicted_bytes,
        ),
        (
            "hoardfs_chunks_not_cached_when_full_total",
            Counter,
            "Fetches served from the source without caching, the cache being full.",
            c.chunks_not_cached_when_full,
        ),
        (
            "hoardfs_open_handles",
            Gauge,
            "Open file and directory handles.",
            snap.open_handles,
        ),
        (
            "hoardfs_inodes",
            Gauge,
            "Entries in the inode table (referenced plus free).",
            t.entries,
        ),
        (
            "hoardfs_inodes_referenced",
            Gauge,
            "Inode-table entries the kernel holds.",
            t.referenced,
        ),
        (
            "hoardfs_inodes_free",
            Gauge,
            "Inode-table entries on the free list.",
            t.free,
        ),
        (
            "hoardfs_inodes_max",
            Gauge,
            "Soft maximum of the inode table.",
            t.max_inodes,
        ),
        (
            "hoardfs_inode_allocations_total",
            Counter,
            "Inode-table entries allocated.",
            t.allocations,
        ),
        (
            "hoardfs_inode_frees_total",
            Counter,
            "Inode-table entries freed.",
            t.frees,
        ),
        (
            "hoardfs_inode_reuses_total",
            Counter,
            "Lookups that revived a free entry.",
            t.reuses,
        ),
        (
            "hoardfs_inode_lookups_total",
            Counter,
            "Lookups served by the inode table.",
            t.lookups,
        ),
        (
            "hoardfs_inode_misses_after_free_total",
            Counter,
            "New entries for an object freed recently.",
            t.misses_after_free,
        ),
        (
            "hoardfs_inode_invalidations_total",
            Counter,
            "Entries the kernel was asked to drop (over the soft maximum).",
            t.invalidations,
        ),
        (
            "hoardfs_source_online",
            Gauge,
            "1 while the source answers; 0 in disconnected mode.",
            hs.online as u64,
        ),
        (
            "hoardfs_source_timeouts_total",
            Counter,
            "Source calls that ran past the source timeout.",
            hs.timeouts,
        ),
        (
            "hoardfs_source_stuck_calls",
            Gauge,
            "Source calls still running past their timeout.",
            hs.stuck_calls,
        ),
        (
            "hoardfs_offline_switches_total",
            Counter,
            "Switches to disconnected mode.",
            hs.went_offline,
        ),
        (
            "hoardfs_offline_requests_total",
            Counter,
            "Requests answered from the cache, or refused, while offline.",
            hs.offline_requests,
        ),
        (
            "hoardfs_offline_log_pending",
            Gauge,
            "Changes made offline not yet replayed to the source.",
            hs.log_pending,
        ),
        (
            "hoardfs_offline_log_replayed_total",
            Counter,
            "Offline changes replayed to the source.",
            hs.log_replayed,
        ),
        (
            "hoardfs_reintegration_conflicts_total",
            Counter,
            "Conflicts met replaying offline changes (both versions kept).",
            hs.conflicts,
        ),
        (
            "hoardfs_watcher_active",
            Gauge,
            "1 if the source watcher reports changes made behind the mount.",
            h.watching as u64,
        ),
        (
            "hoardfs_watched_dirs",
            Gauge,
            "Source directories watched.",
            h.watched_dirs,
        ),
        (
            "hoardfs_watcher_events_total",
            Counter,
            "inotify events received from the source.",
            h.watcher_events,
        ),
        (
            "hoardfs_watcher_overflows_total",
            Counter,
            "Times the watcher lost events and invalidated everything.",
            h.watcher_overflows,
        ),
        (
            "hoardfs_source_changes_total",
            Counter,
            "Changes made behind the mount that invalidated cached data.",
            h.changes_detected,
        ),
        (
            "hoardfs_kernel_inval_inode_total",
            Counter,
            "Kernel notifications dropping attributes, data or listings.",
            h.inval_inode,
        ),
        (
            "hoardfs_kernel_attr_drops_total",
            Counter,
            "Opens that made the kernel drop a file's attributes first (it held another size).",
            h.attr_drops,
        ),
        (
            "hoardfs_kernel_listing_drops_total",
            Counter,
            "Listings that made the kernel drop a directory's cached listing before their end (it changed meanwhile).",
            h.listing_drops,
        ),
        (
            "hoardfs_kernel_inval_entry_total",
            Counter,
            "Kernel notifications dropping names.",
            h.inval_entry,
        ),
        (
            "hoardfs_leases_active",
            Gauge,
            "Validation leases held by open files (sources without a watcher).",
            h.leases_active,
        ),
        (
            "hoardfs_leases_expired_total",
            Counter,
            "Leases expired and revalidated against the source.",
            h.leases_expired,
        ),
        (
            "hoardfs_callbacks_granted_total",
            Counter,
            "Callbacks granted: looks at a watched file that stand until an event breaks them.",
            h.callbacks_granted,
        ),
        (
            "hoardfs_callbacks_broken_total",
            Counter,
            "Callbacks broken by an event on the file or its name.",
            h.callbacks_broken,
        ),
        (
            "hoardfs_callback_hits_total",
            Counter,
            "Opens, getattrs and lookups answered by a callback without asking the source.",
            h.callback_hits,
        ),
        (
            "hoardfs_callback_names_total",
            Counter,
            "Lookups answered by a callback without asking the source.",
            h.callback_names,
        ),
        (
            "hoardfs_listing_hits_total",
            Counter,
            "Opendirs answered by a listing held under callback, without reading the source.",
            h.listing_hits,
        ),
        (
            "hoardfs_open_leases_granted_total",
            Counter,
            "Looks at files where nothing is watched that stood for --open-lease.",
            h.open_leases_granted,
        ),
        (
            "hoardfs_open_lease_hits_total",
            Counter,
            "Opens answered by an open lease without asking the source.",
            h.open_lease_hits,
        ),
        (
            "hoardfs_watched_files",
            Gauge,
            "Source files watched themselves (they hold callbacks).",
            h.watched_files,
        ),
    ] {
        one(e, name, kind, help, v)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source with a fixed snapshot and live counters.
    struct Fixed(Snapshot, Stats);

    impl Source for Fixed {
        fn snapshot(&self) -> Snapshot {
            self.0.clone()
        }
        fn stats(&self) -> &Stats {
            &self.1
        }
    }

    fn sample() -> Arc<Fixed> {
        let stats = Stats::default();
        drop(stats.start(Op::Read));
        stats.start(Op::Read).failed(libc::EIO);
        let mut snap = Snapshot {
            mountpoint: "/mnt/a \"b\"".into(),
            ..Default::default()
        };
        snap.cache.bytes_from_source = 42;
        Arc::new(Fixed(snap, stats))
    }

    fn scrape(source: Arc<Fixed>) -> String {
        render(&registry(source))
    }

    #[test]
    fn exposition_is_well_formed() {
        let text = scrape(sample());
        assert!(text.contains("hoardfs_requests_total{op=\"read\"} 2\n"));
        assert!(text.contains("hoardfs_request_duration_seconds_count{op=\"read\"} 2\n"));
        assert!(
            text.contains("hoardfs_request_duration_seconds_bucket{op=\"read\",le=\"+Inf\"} 2\n")
        );
        assert!(text.contains("hoardfs_bytes_from_source_total 42\n"));
        assert!(text.contains("hoardfs_errors_total{op=\"read\",errno=\"EIO\"} 1\n"));
        assert!(!text.contains("hoardfs_errors_total{op=\"lookup\""));
        assert!(text.contains("mountpoint=\"/mnt/a \\\"b\\\"\""));
        assert!(text.contains("# TYPE hoardfs_info gauge\n"));
        assert!(text.contains("# TYPE hoardfs_cache_bytes gauge\n"));
        assert!(text.contains("# HELP hoardfs_evicted_bytes_total Bytes freed by eviction.\n"));
        // Every sample line belongs to a family declared with # HELP and # TYPE before it.
        let mut helped = std::collections::HashSet::new();
        let mut declared = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                helped.insert(rest.split(' ').next().unwrap().to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                assert!(helped.contains(name), "{name} has no # HELP");
                assert!(declared.insert(name.to_string()), "{name} declared twice");
            } else {
                assert!(!line.starts_with('#'), "{line:?}");
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
        let text = scrape(sample());
        let (bounds, counts): (Vec<f64>, Vec<u64>) = text
            .lines()
            .filter_map(|l| l.strip_prefix("hoardfs_request_duration_seconds_bucket{op=\"read\","))
            .map(|l| {
                let (le, n) = l.split_once("} ").unwrap();
                let le = le.strip_prefix("le=\"").unwrap().strip_suffix('"').unwrap();
                (le.parse::<f64>().unwrap(), n.parse::<u64>().unwrap())
            })
            .unzip();
        assert_eq!(counts.len(), LATENCY_BUCKETS + 1);
        assert!(counts.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(*counts.last().unwrap(), 2);
        // Bounds: 2^k µs, then +Inf.
        for (k, le) in bounds.iter().take(LATENCY_BUCKETS).enumerate() {
            assert_eq!(*le, (1u64 << k) as f64 / 1e6);
        }
        assert_eq!(bounds[LATENCY_BUCKETS], f64::INFINITY);
    }

    #[test]
    fn scrapes_read_the_counters_live() {
        let source = sample();
        let registry = registry(source.clone());
        assert!(render(&registry).contains("hoardfs_requests_total{op=\"read\"} 2\n"));
        drop(source.1.start(Op::Read));
        source.1.latency[Op::Read as usize].record(Duration::from_secs(3600));
        let text = render(&registry);
        assert!(text.contains("hoardfs_requests_total{op=\"read\"} 3\n"));
        // An hour is above every bound: counted in +Inf and _count only.
        assert!(text.contains("{op=\"read\",le=\"16.777216\"} 3\n"));
        assert!(text.contains("{op=\"read\",le=\"+Inf\"} 4\n"));
        assert!(text.contains("hoardfs_request_duration_seconds_count{op=\"read\"} 4\n"));
    }

    #[test]
    fn every_metric_is_documented() {
        let doc = include_str!("../docs/METRICS.md");
        let text = scrape(sample());
        let mut names = 0;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let name = rest.split(' ').next().unwrap();
                names += 1;
                assert!(
                    doc.contains(&format!("`{name}`")),
                    "{name} is not listed in docs/METRICS.md"
                );
            }
        }
        assert!(names > 50, "only {names} metrics rendered");
    }

    #[test]
    fn the_endpoint_answers_http() {
        let listener = bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let source = Arc::new(Fixed(Snapshot::default(), Stats::default()));
        let (addr, _threads) = serve(listener, source).unwrap();
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
        assert!(head.contains("\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8"));
        assert!(get("GET /nope HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
        assert!(get("POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    }
}
