//! The option table: every mount option and every live setting of a mount, declared once.
//!
//! One row per key says how it is written (a `key=VALUE` value or a switch), its default,
//! its help text, where it goes in `Config` and whether `hoardfs set` changes it on a
//! running mount. The row drives:
//! - the `--long-flag`s of the command line (`cli.rs` adds one clap argument per row),
//! - the `-o key=value` parser and its help text,
//! - the TOML config file's keys (`config_file.rs`: a file's values become `-o` options),
//! - the merge of file, `-o` and flags (all applied in order by `apply`, the last wins),
//! - `hoardfs set`: its keys, their parsing into a typed `Live` setting (which the core
//!   applies with one exhaustive `match`), its help text and its unknown-key error,
//! - the docs check (`tests` below: docs/CONFIGURATION.md names every key).
//!
//! `auto` stands for an option's default wherever the option has one, at mount time and
//! on a live mount alike: `hoardfs set MNT cache_size=auto` restores the limit the mount
//! would have had without `--cache-size`.

use std::path::PathBuf;
use std::time::Duration;

use crate::config::{self, Config, parse_secs, parse_size};

mod help;
pub use help::{o_help, set_help, set_long_help};

pub const CACHING: &str = "Caching";
pub const KERNEL: &str = "Kernel caching and access";
pub const PROCESS: &str = "Process";
pub const OBJECT: &str = "Object-store sources";

/// How an option is written.
#[derive(Clone, Copy)]
pub enum Form {
    /// `key=VALUE`, `--key VALUE`, TOML `key = VALUE`; `set` puts it into a `Config`.
    Value {
        set: fn(&mut Config, &str) -> Result<(), String>,
    },
    /// A switch: `--key` or `-o ON` turns it on, `-o OFF` off again; TOML `key = true` is
    /// `ON`, `false` is `OFF` (nothing where there is no `OFF`).
    Switch {
        on: &'static str,
        off: Option<&'static str>,
        short: Option<char>,
        set: fn(&mut Config, bool),
    },
    /// A setting of a running mount only (`hoardfs set`); no mount option.
    LiveOnly,
}

/// Parses a value of a live setting.
pub type ParseLive = fn(&str) -> Result<Live, String>;

/// One option.
pub struct Opt {
    /// The `-o` and config-file key, and the `hoardfs set` key; the long flag is the key
    /// with `-` for `_`.
    pub key: &'static str,
    pub form: Form,
    /// The value's name in help texts (`SIZE`, `SECS`, ...); empty for switches.
    pub arg: &'static str,
    /// Values clap lists (and completes); empty: any the parser takes.
    pub choices: &'static [&'static str],
    /// The default, written as a value the option takes; `auto` where it is computed
    /// (then `auto_means` says how); empty where there is none (unset).
    pub default: &'static str,
    pub auto_means: &'static str,
    /// `--help`'s group.
    pub heading: &'static str,
    pub help: &'static str,
    /// Parses a value for `hoardfs set` (`None`: fixed at mount time).
    pub live: Option<ParseLive>,
}

/// A setting of a running mount, parsed and checked (`hoardfs set KEY=VALUE`). `None`
/// stands for `auto`: the core computes the default as it does at mount time.
#[derive(Clone, Debug, PartialEq)]
pub enum Live {
    EntryTtl(Option<Duration>),
    AttrTtl(Option<Duration>),
    NegativeTtl(Option<Duration>),
    StaleCheck(bool),
    CloseToOpen(bool),
    OpenLease(Duration),
    Watch(bool),
    /// Zero: no timeout.
    SourceTimeout(Option<Duration>),
    Online(bool),
    FetchWindow(u64),
    FetchInflight(u64),
    FetchFds(u64),
    FetchDirPrefetch(u64),
    CacheSize(Option<u64>),
    MinFree(Option<u64>),
    HighWatermark(u8),
    LowWatermark(u8),
    MaxInodes(usize),
    InodeFreeMin(Option<usize>),
    InodeMinAge(Option<Duration>),
    InodeMaxAge(Option<Duration>),
    InodeFreeing(bool),
    /// The daemon's log filter; `None`: `HOARDFS_LOG`'s, else `info`.
    Log(Option<String>),
}

// Value parsers, shared by rows.

fn put<T>(slot: &mut T, v: Result<T, String>) -> Result<(), String> {
    *slot = v?;
    Ok(())
}

fn auto<T>(v: &str, parse: impl Fn(&str) -> Result<T, String>) -> Result<Option<T>, String> {
    if v == "auto" {
        Ok(None)
    } else {
        parse(v).map(Some)
    }
}

fn num<T: std::str::FromStr>(v: &str) -> Result<T, String> {
    v.parse().map_err(|_| format!("invalid number {v:?}"))
}

fn pct(v: &str, lo: u8, hi: u8) -> Result<u8, String> {
    let p: u8 = v
        .trim_end_matches('%')
        .parse()
        .map_err(|_| format!("invalid percentage {v:?}"))?;
    if (lo..=hi).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{p} is not in {lo}..={hi}"))
    }
}

fn on_off(v: &str) -> Result<bool, String> {
    match v {
        "on" | "true" | "1" | "yes" => Ok(true),
        "off" | "false" | "0" | "no" => Ok(false),
        _ => Err(format!("on or off, not {v:?}")),
    }
}

fn secs_or_auto(v: &str) -> Result<Option<Duration>, String> {
    auto(v, parse_secs)
}

fn size_or_auto(v: &str) -> Result<Option<u64>, String> {
    auto(v, parse_size)
}

fn watch_mode(v: &str) -> Result<config::WatchMode, String> {
    v.parse()
}

fn max_inodes(v: &str) -> Result<usize, String> {
    Ok(auto(v, num)?.unwrap_or_else(config::default_max_inodes))
}

fn text(v: &str) -> Result<String, String> {
    if v.is_empty() {
        return Err("needs a value".into());
    }
    Ok(v.to_string())
}

/// Every option. The order is `--help`'s and the docs'.
pub static OPTIONS: &[Opt] = &[
    Opt::value("cache_dir", "DIR", CACHING, |c, v| {
        put(&mut c.cache_dir, text(v).map(PathBuf::from))
    })
    .help(
        "Where cached data lives [default: $XDG_CACHE_HOME/hoardfs/<source> or \
         /var/cache/hoardfs/<source> for root]",
    ),
    Opt::value("whole_file_threshold", "SIZE", CACHING, |c, v| {
        put(&mut c.whole_file_threshold, parse_size(v))
    })
    .help("Files up to this size are fetched whole on first open")
    .default("8M"),
    Opt::value("chunk_size", "SIZE", CACHING, |c, v| {
        let d = config::default_chunk_size(&c.source);
        put(
            &mut c.chunk_size,
            auto(v, parse_size).map(|s| s.unwrap_or(d)),
        )
    })
    .help("Chunk size for larger files, a power of two >= 4K")
    .auto("1M; 8M for s3://"),
    Opt::value("cache_size", "SIZE", CACHING, |c, v| {
        put(&mut c.cache_size, size_or_auto(v))
    })
    .help("Cache size limit")
    .auto("--cache-share of the cache's file system")
    .settable(|v| Ok(Live::CacheSize(size_or_auto(v)?))),
    Opt::value("cache_share", "PCT", CACHING, |c, v| {
        put(&mut c.cache_share, pct(v, 1, 100))
    })
    .help("Percent of the cache's file system the cache may use when --cache-size is not given")
    .default("80"),
    Opt::value("high_watermark", "PCT", CACHING, |c, v| {
        put(&mut c.high_watermark, pct(v, 1, 100))
    })
    .help("The cleaner starts above this percent of the limit")
    .default("90")
    .settable(|v| Ok(Live::HighWatermark(pct(v, 1, 100)?))),
    Opt::value("low_watermark", "PCT", CACHING, |c, v| {
        put(&mut c.low_watermark, pct(v, 0, 99))
    })
    .help("The cleaner cleans down to this percent of the limit")
    .default("70")
    .settable(|v| Ok(Live::LowWatermark(pct(v, 0, 99)?))),
    Opt::value("min_free", "SIZE", CACHING, |c, v| {
        put(&mut c.min_free, size_or_auto(v))
    })
    .help("Free space to leave on the cache's file system")
    .auto("5% of the cache's file system")
    .settable(|v| Ok(Live::MinFree(size_or_auto(v)?))),
    Opt::switch(
        "no_stale_check",
        "no_stale_check",
        Some("stale_check"),
        CACHING,
        |c, on| c.stale_check = !on,
    )
    .help("Trust the cache: do not compare cached files with the source on open"),
    Opt::live_only("stale_check", "on|off", CACHING, |v| {
        Ok(Live::StaleCheck(on_off(v)?))
    })
    .help("Compare cached files with the source on open (--no-stale-check turns it off)")
    .default("on"),
    Opt::value("close_to_open", "on|off", CACHING, |c, v| {
        put(&mut c.close_to_open, on_off(v))
    })
    .help(
        "Every open asks the source (close-to-open), also where the watcher covers the file \
         and its callback would answer",
    )
    .default("off")
    .settable(|v| Ok(Live::CloseToOpen(on_off(v)?))),
    Opt::value("open_lease", "SECS", CACHING, |c, v| {
        put(&mut c.open_lease, parse_secs(v))
    })
    .help(
        "Where nothing is watched (network, FUSE and object-store sources), an open for \
         reading of a file looked at within this many seconds asks the source nothing; 0: \
         every open asks (close-to-open)",
    )
    .default("0")
    .settable(|v| Ok(Live::OpenLease(parse_secs(v)?))),
    Opt::value("fetch_workers", "N", CACHING, |c, v| {
        put(&mut c.fetch_workers, auto(v, num))
    })
    .help("Threads fetching from the source in the background")
    .auto("one per CPU, 2..8; at least 8 on network and FUSE sources"),
    Opt::value("fetch_window", "N", CACHING, |c, v| {
        put(&mut c.fetch_window, num(v))
    })
    .help("Largest prefetch window of a sequential reader, in chunks; 0 turns prefetch off")
    .default("8")
    .settable(|v| Ok(Live::FetchWindow(num(v)?))),
    Opt::value("fetch_inflight", "SIZE", CACHING, |c, v| {
        put(&mut c.fetch_inflight, parse_size(v))
    })
    .help("Bytes of chunks queued for or being fetched by the workers")
    .default("64M")
    .settable(|v| Ok(Live::FetchInflight(parse_size(v)?))),
    Opt::value("fetch_fds", "N", CACHING, |c, v| {
        put(&mut c.fetch_fds, num(v))
    })
    .help(
        "Source files kept open for fetching; above it reads of further partially cached \
             files go to the source uncached",
    )
    .default("256")
    .settable(|v| Ok(Live::FetchFds(num(v)?))),
    Opt::value("fetch_dir_prefetch", "N", CACHING, |c, v| {
        put(&mut c.fetch_dir_prefetch, num(v))
    })
    .help(
        "Files of a directory fetched whole in the background ahead of a reader opening them \
         in listing order (grep -r, cp -r); 0 turns it off",
    )
    .default("16")
    .settable(|v| Ok(Live::FetchDirPrefetch(num(v)?))),
    Opt::value("entry_ttl", "SECS", KERNEL, |c, v| {
        put(&mut c.entry_ttl, secs_or_auto(v))
    })
    .help("Seconds the kernel may keep a name lookup")
    .auto("60 in watched directories, 1 elsewhere")
    .settable(|v| Ok(Live::EntryTtl(secs_or_auto(v)?))),
    Opt::value("attr_ttl", "SECS", KERNEL, |c, v| {
        put(&mut c.attr_ttl, secs_or_auto(v))
    })
    .help("Seconds the kernel may keep attributes")
    .auto("60 where watched, 1 elsewhere")
    .settable(|v| Ok(Live::AttrTtl(secs_or_auto(v)?))),
    Opt::value("negative_ttl", "SECS", KERNEL, |c, v| {
        put(&mut c.negative_ttl, secs_or_auto(v))
    })
    .help("Seconds the kernel may remember that a name does not exist")
    .auto("60 where watched, 1 elsewhere")
    .settable(|v| Ok(Live::NegativeTtl(secs_or_auto(v)?))),
    Opt::value("watch", "MODE", KERNEL, |c, v| {
        put(&mut c.watch, watch_mode(v))
    })
    .help(
        "Watch the source for changes made behind the mount (inotify) and invalidate the \
             kernel's and the cache's copies; `auto` watches local file systems only (live: \
             whether watch events are acted on)",
    )
    .default("auto")
    .choices(&["auto", "on", "off"])
    .settable(|v| {
        let on = match watch_mode(v) {
            Ok(m) => m != config::WatchMode::Off,
            Err(e) => on_off(v).map_err(|_| e)?,
        };
        Ok(Live::Watch(on))
    }),
    Opt::value("source_timeout", "SECS", CACHING, |c, v| {
        put(&mut c.source_timeout, secs_or_auto(v))
    })
    .help(
        "Longest wait in seconds for one call to the source before the mount goes offline \
         (0: none)",
    )
    .auto("10 on network and FUSE sources, none on local ones")
    .settable(|v| Ok(Live::SourceTimeout(secs_or_auto(v)?))),
    Opt::value("timestamp_granularity", "SECS", CACHING, |c, v| {
        put(&mut c.timestamp_granularity, secs_or_auto(v))
    })
    .help(
        "How coarse the source's timestamps are: a version read less than this long after \
         its mtime is checked again at the next open, as a rewrite within the same tick \
         would look the same (git's racily clean)",
    )
    .auto("1 on network and FUSE sources (whole seconds over sftp, no ctime), 0 on local ones and object stores (ETags)"),
    Opt::switch("offline", "offline", None, CACHING, |c, on| {
        c.start_offline |= on
    })
    .help("Start disconnected: serve only what the cache holds until `hoardfs online`"),
    Opt::live_only("online", "on|off", CACHING, |v| {
        Ok(Live::Online(on_off(v)?))
    })
    .help(
        "Reconnect to the source (on) or go disconnected (off), as `hoardfs online` and \
         `hoardfs offline` do",
    ),
    Opt::value("offline_writes", "MODE", CACHING, |c, v| {
        put(&mut c.offline_writes, v.parse())
    })
    .help(
        "Changes while disconnected: `refuse` (EROFS) or `log` (applied to the cache, logged, \
         replayed to the source on reconnection; conflicts keep both versions)",
    )
    .default("refuse")
    .choices(&["refuse", "log"]),
    Opt::value("s3_endpoint", "URL", OBJECT, |c, v| {
        put(&mut c.s3.endpoint, text(v).map(Some))
    })
    .help(
        "An s3:// source's endpoint, http[s]://HOST[:PORT] [default: AWS_ENDPOINT_URL, the \
         profile's endpoint_url, else AWS]",
    ),
    Opt::value("s3_region", "REGION", OBJECT, |c, v| {
        put(&mut c.s3.region, text(v).map(Some))
    })
    .help("An s3:// source's region [default: AWS_REGION, the profile's, else us-east-1]"),
    Opt::switch(
        "s3_virtual_hosted",
        "s3_virtual_hosted",
        None,
        OBJECT,
        |c, on| c.s3.virtual_hosted |= on,
    )
    .help("Address the bucket as BUCKET.HOST (virtual-hosted style) instead of HOST/BUCKET"),
    Opt::switch(
        "no_passthrough",
        "no_passthrough",
        Some("passthrough"),
        KERNEL,
        |c, on| c.passthrough = !on,
    )
    .help("Serve reads of fully cached files through the daemon instead of FUSE passthrough"),
    Opt::switch("kernel_opens", "kernel_opens", None, KERNEL, |c, on| {
        c.kernel_opens |= on
    })
    .help(
        "Let the kernel open files itself and keep their pages between opens: no request \
         per open or close, for trees of small files read again and again. Changes behind \
         the mount reach readers by the watcher's notices or the attribute TTL, not at \
         open; no passthrough; locks are local to this machine (README, \"Kernel opens\")",
    ),
    Opt::switch("kernel_dir_opens", "kernel_dir_opens", None, KERNEL, |c, on| {
        c.kernel_dir_opens |= on
    })
    .help(
        "Let the kernel open directories itself and keep their listings between opens \
         (files are opened as usual): no request per opendir or closedir, for trees that \
         are walked again and again. A change behind the mount reaches listings by the \
         watcher's notices or the attribute TTL (README, \"Kernel opens\")",
    ),
    Opt::switch("source_reads", "source_reads", None, KERNEL, |c, on| {
        c.source_reads |= on
    })
    .help(
        "Have the kernel read large files not yet cached straight from the source (FUSE \
         passthrough to the source file), and copy what was read into the cache when the \
         file is closed: cold sequential reads at the source's speed. Sources without a \
         source timeout (local ones) only; elsewhere it is off (README, \"Source reads\")",
    ),
    Opt::switch("source_writes", "source_writes", None, KERNEL, |c, on| {
        c.source_writes |= on
    })
    .help(
        "Have the kernel write files straight to the source (FUSE passthrough to the \
         source file) instead of sending each write to hoardfs, and copy what was written \
         into the cache when the last writer closes: writes at the source's speed. Sources \
         without a source timeout (local ones) only; not for set-user-ID or set-group-ID \
         files (README, \"Source writes\")",
    ),
    Opt::switch("allow_other", "allow_other", None, KERNEL, |c, on| {
        c.allow_other |= on
    })
    .help(
        "Let other users than the mounting one use the mount (access is still checked \
         against file modes: default_permissions is always on)",
    ),
    Opt::switch("read_only", "ro", Some("rw"), KERNEL, |c, on| {
        c.read_only = on
    })
    .help("Mount read-only")
    .short('r'),
    Opt::switch("nonempty", "nonempty", None, KERNEL, |c, on| {
        c.nonempty |= on
    })
    .help("Mount even if MOUNTPOINT is not empty (its files are hidden while mounted)"),
    Opt::value("max_inodes", "N", KERNEL, |c, v| {
        put(&mut c.max_inodes, max_inodes(v))
    })
    .help(
        "Soft maximum of inodes the daemon keeps; above it the kernel is asked to drop \
             cold entries",
    )
    .auto("what fits in 2% of RAM, 16Ki..256Ki")
    .settable(|v| Ok(Live::MaxInodes(max_inodes(v)?))),
    Opt::live_only("inode_free_min", "N", KERNEL, |v| {
        Ok(Live::InodeFreeMin(auto(v, num)?))
    })
    .help("Free inode-table entries kept for reuse regardless of inode_min_age")
    .auto("max_inodes/16, 1..64Ki"),
    Opt::live_only("inode_min_age", "SECS", KERNEL, |v| {
        Ok(Live::InodeMinAge(secs_or_auto(v)?))
    })
    .help("A free inode-table entry younger than this is kept while the table is under max_inodes")
    .auto("10"),
    Opt::live_only("inode_max_age", "SECS", KERNEL, |v| {
        Ok(Live::InodeMaxAge(secs_or_auto(v)?))
    })
    .help("A free inode-table entry older than this is freed")
    .auto("30"),
    Opt::live_only("inode_freeing", "on|off", KERNEL, |v| {
        Ok(Live::InodeFreeing(on_off(v)?))
    })
    .help(
        "Free inode-table entries and ask the kernel to drop cold ones (off: the table only \
         grows)",
    )
    .default("on"),
    Opt::value("threads", "N", PROCESS, |c, v| put(&mut c.threads, num(v)))
        .help("Threads serving FUSE requests (with the io_uring transport: per CPU)")
        .default("4"),
    Opt::value("fuse_ring", "on|off", PROCESS, |c, v| put(&mut c.fuse_ring, on_off(v)))
        .help(
            "Take FUSE requests over io_uring where the kernel allows it (Linux 6.14+, \
             fuse.enable_uring=1): a request is served on its caller's CPU; off: /dev/fuse",
        )
        .default("on"),
    Opt::value("metrics_addr", "ADDR", PROCESS, |c, v| {
        let addr = v
            .parse()
            .map_err(|_| format!("invalid address {v:?} (HOST:PORT)"));
        put(&mut c.metrics_addr, addr.map(Some))
    })
    .help("Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9560) [default: off]"),
    Opt::live_only("log", "FILTER", PROCESS, |v| Ok(Live::Log(auto(v, text)?)))
        .help("The daemon's log filter: error, warn, info, debug, trace, or a HOARDFS_LOG spec")
        .auto("HOARDFS_LOG's at start, else info"),
];

/// Options of mount(8) and fstab that concern mount(8) itself, not hoardfs.
const IGNORED_MOUNT_OPTIONS: &[&str] = &[
    "defaults",
    "_netdev",
    "nofail",
    "auto",
    "noauto",
    "user",
    "nouser",
    "users",
    "owner",
    "dev",
    "nodev",
    "suid",
    "nosuid",
    "exec",
    "noexec",
    "atime",
    "noatime",
    "relatime",
    "nodiratime",
    "diratime",
    "async",
    "sync",
    "default_permissions",
    "x-systemd.automount",
];

/// The table's constructors: an option, then what it has besides its key and form.
impl Opt {
    const fn new(key: &'static str, form: Form, arg: &'static str, heading: &'static str) -> Opt {
        Opt {
            key,
            form,
            arg,
            choices: &[],
            default: "",
            auto_means: "",
            heading,
            help: "",
            live: None,
        }
    }

    /// `key=ARG`, put into a `Config` by `set`.
    const fn value(
        key: &'static str,
        arg: &'static str,
        heading: &'static str,
        set: fn(&mut Config, &str) -> Result<(), String>,
    ) -> Opt {
        Opt::new(key, Form::Value { set }, arg, heading)
    }

    /// A switch turned on by `-o ON` (and `--key`), off by `-o OFF`.
    const fn switch(
        key: &'static str,
        on: &'static str,
        off: Option<&'static str>,
        heading: &'static str,
        set: fn(&mut Config, bool),
    ) -> Opt {
        let short = None;
        Opt::new(
            key,
            Form::Switch {
                on,
                off,
                short,
                set,
            },
            "",
            heading,
        )
    }

    /// A setting of a running mount only.
    const fn live_only(
        key: &'static str,
        arg: &'static str,
        heading: &'static str,
        live: ParseLive,
    ) -> Opt {
        Opt::new(key, Form::LiveOnly, arg, heading).settable(live)
    }

    const fn help(mut self, help: &'static str) -> Opt {
        self.help = help;
        self
    }

    const fn default(mut self, default: &'static str) -> Opt {
        self.default = default;
        self
    }

    /// A computed default: `auto`, which means `means`.
    const fn auto(mut self, means: &'static str) -> Opt {
        self.default = "auto";
        self.auto_means = means;
        self
    }

    /// Settable on a running mount, with `parse`.
    const fn settable(mut self, parse: ParseLive) -> Opt {
        self.live = Some(parse);
        self
    }

    const fn choices(mut self, choices: &'static [&'static str]) -> Opt {
        self.choices = choices;
        self
    }

    const fn short(mut self, c: char) -> Opt {
        if let Form::Switch { ref mut short, .. } = self.form {
            *short = Some(c);
        }
        self
    }
}

impl Opt {
    /// The row of `key` (mount options, config keys and live keys alike).
    pub fn find(key: &str) -> Option<&'static Opt> {
        OPTIONS.iter().find(|o| o.key == key)
    }

    /// `--key`'s name.
    pub fn long(&self) -> String {
        self.key.replace('_', "-")
    }

    pub fn is_mount_option(&self) -> bool {
        !matches!(self.form, Form::LiveOnly)
    }

    /// `auto` is the default's text for options with a fixed default.
    fn resolve<'a>(&self, value: &'a str) -> &'a str {
        if value == "auto" && !self.default.is_empty() && self.default != "auto" {
            self.default
        } else {
            value
        }
    }

    /// Puts `value` into `c` (a value option).
    pub fn set(&self, c: &mut Config, value: &str) -> Result<(), String> {
        match self.form {
            Form::Value { set } => set(c, self.resolve(value)).map_err(|e| self.error(e)),
            Form::Switch { .. } | Form::LiveOnly => {
                Err(format!("{} takes no value here", self.key))
            }
        }
    }

    /// Parses `value` for a running mount.
    pub fn live(&self, value: &str) -> Result<Live, String> {
        match self.live {
            Some(parse) => parse(self.resolve(value)).map_err(|e| self.error(e)),
            None => Err(format!(
                "{} is fixed at mount time; settings of a running mount: {}",
                self.key,
                live_keys().collect::<Vec<_>>().join(", ")
            )),
        }
    }

    fn error(&self, e: String) -> String {
        if e.starts_with(self.key) {
            e
        } else {
            format!("{}: {e}", self.key)
        }
    }

    /// The default as help texts show it.
    pub fn default_text(&self) -> Option<&'static str> {
        match (self.default, self.auto_means) {
            ("", _) => None,
            ("auto", "") => Some("auto"),
            ("auto", means) => Some(means),
            (d, _) => Some(d),
        }
    }

    /// `--help`'s text: the help and the default.
    pub fn flag_help(&self) -> String {
        match self.default_text() {
            Some(d) => format!("{} [default: {d}]", self.help),
            None => self.help.to_string(),
        }
    }

    /// `key=ARG`, or the switch's words (`ro`, `rw`).
    pub fn usage(&self) -> String {
        match self.form {
            Form::Switch {
                on, off: Some(off), ..
            } => format!("{on}, {off}"),
            Form::Switch { on, off: None, .. } => on.to_string(),
            _ => format!("{}={}", self.key, self.arg),
        }
    }
}

/// Every key `hoardfs set` takes.
pub fn live_keys() -> impl Iterator<Item = &'static str> {
    OPTIONS.iter().filter(|o| o.live.is_some()).map(|o| o.key)
}

/// Parses `hoardfs set KEY=VALUE` (in the client, to fail early, and in the daemon).
pub fn parse_live(key: &str, value: &str) -> Result<Live, String> {
    match Opt::find(key) {
        Some(o) => o.live(value),
        None => Err(format!(
            "unknown setting {key:?} ({})",
            live_keys().collect::<Vec<_>>().join(", ")
        )),
    }
}

/// Applies one `-o` option (`key=value` or a switch's word) to `c`. The generic mount(8)
/// options are ignored.
pub fn apply(c: &mut Config, opt: &str) -> Result<(), String> {
    let (key, value) = match opt.split_once('=') {
        Some((k, v)) => (k, Some(v)),
        None => (opt, None),
    };
    for o in OPTIONS {
        match o.form {
            Form::Switch { on, off, set, .. } if key == on || Some(key) == off => {
                set(c, key == on);
                return Ok(());
            }
            Form::Value { .. } if key == o.key => {
                let v = value.ok_or_else(|| format!("mount option {key} needs a value"))?;
                return o.set(c, v);
            }
            _ => {}
        }
    }
    if IGNORED_MOUNT_OPTIONS.contains(&key) || key.starts_with("x-") || key == "comment" {
        return Ok(());
    }
    Err(format!("unknown mount option {opt:?}"))
}

/// A `Config` for `source` and `mountpoint` after `options` (`-o` form, each split at
/// commas: a config file's and the command line's) and then `flags` (whole options: a
/// flag's value may hold a comma). The last word on a key wins.
pub fn config(
    source: PathBuf,
    mountpoint: PathBuf,
    options: &[String],
    flags: &[String],
) -> Result<Config, String> {
    let mut c = Config::new(source, mountpoint);
    for o in options
        .iter()
        .flat_map(|o| o.split(','))
        .filter(|o| !o.is_empty())
    {
        apply(&mut c, o)?;
    }
    for f in flags {
        apply(&mut c, f)?;
    }
    if c.cache_dir.as_os_str().is_empty() {
        c.cache_dir = if c.is_object_source() {
            config::default_cache_dir(&c.source)
        } else {
            let abs = std::fs::canonicalize(&c.source).unwrap_or_else(|_| c.source.clone());
            config::default_cache_dir(&abs)
        };
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> Config {
        Config::new("/src".into(), "/mnt".into())
    }

    #[test]
    fn every_default_parses_and_is_the_default() {
        for o in OPTIONS {
            if o.default.is_empty() {
                assert!(
                    matches!(o.form, Form::Switch { .. }) || o.live.is_none() || o.key == "online",
                    "{}: a live key without a default cannot take auto",
                    o.key
                );
                continue;
            }
            if o.is_mount_option() {
                let mut c = fresh();
                o.set(&mut c, o.default).unwrap();
                assert_eq!(
                    format!("{c:?}"),
                    format!("{:?}", fresh()),
                    "{}={} is not the default",
                    o.key,
                    o.default
                );
                let mut a = fresh();
                o.set(&mut a, "auto").unwrap();
                assert_eq!(format!("{a:?}"), format!("{c:?}"), "{}=auto", o.key);
            }
            if o.live.is_some() {
                let d = o.live(o.default).unwrap();
                assert_eq!(o.live("auto").unwrap(), d, "{}=auto", o.key);
            }
        }
    }

    #[test]
    fn auto_restores_computed_defaults_live() {
        assert_eq!(parse_live("cache_size", "auto"), Ok(Live::CacheSize(None)));
        assert_eq!(
            parse_live("cache_size", "1G"),
            Ok(Live::CacheSize(Some(1 << 30)))
        );
        assert_eq!(parse_live("min_free", "auto"), Ok(Live::MinFree(None)));
        assert_eq!(parse_live("attr_ttl", "auto"), Ok(Live::AttrTtl(None)));
        assert_eq!(
            parse_live("source_timeout", "auto"),
            Ok(Live::SourceTimeout(None))
        );
        assert_eq!(
            parse_live("high_watermark", "auto"),
            Ok(Live::HighWatermark(90))
        );
        assert_eq!(parse_live("fetch_window", "auto"), Ok(Live::FetchWindow(8)));
        assert_eq!(parse_live("log", "auto"), Ok(Live::Log(None)));
        assert_eq!(parse_live("watch", "off"), Ok(Live::Watch(false)));
        assert_eq!(parse_live("watch", "auto"), Ok(Live::Watch(true)));
        assert_eq!(parse_live("watch", "yes"), Ok(Live::Watch(true)));
        assert!(parse_live("watch", "maybe").is_err());
        assert!(
            parse_live("fetch_fds", "many")
                .unwrap_err()
                .contains("fetch_fds")
        );
        assert!(parse_live("online", "auto").is_err());
        let mut c = fresh();
        apply(&mut c, "cache_size=1G").unwrap();
        apply(&mut c, "cache_size=auto").unwrap();
        assert_eq!(c.cache_size, None);
    }

    #[test]
    fn unknown_and_mount_only_keys_name_every_live_key() {
        for (key, start) in [
            ("foo", "unknown setting \"foo\""),
            ("chunk_size", "chunk_size is fixed"),
        ] {
            let e = parse_live(key, "1").unwrap_err();
            assert!(e.starts_with(start), "{e}");
            for k in live_keys() {
                assert!(e.contains(k), "{k} missing from {e}");
            }
        }
        assert!(
            apply(&mut fresh(), "foo=1")
                .unwrap_err()
                .contains("unknown mount option")
        );
        assert!(
            apply(&mut fresh(), "inode_freeing=on")
                .unwrap_err()
                .contains("unknown")
        );
        assert!(
            apply(&mut fresh(), "cache_size")
                .unwrap_err()
                .contains("needs a value")
        );
    }

    #[test]
    fn the_set_help_names_every_live_key() {
        let (short, long) = (set_help(), set_long_help());
        for k in live_keys() {
            assert!(short.contains(&format!("{k}=")), "{k} not in {short}");
            assert!(long.contains(&format!("{k}=")), "{k} not in {long}");
        }
        let o = o_help();
        for opt in OPTIONS.iter().filter(|o| o.is_mount_option()) {
            assert!(o.contains(&opt.usage()), "{} not in the -o help", opt.key);
        }
    }

    /// docs/CONFIGURATION.md names every option with its flag, and every live key.
    #[test]
    fn every_option_is_documented() {
        let doc = include_str!("../docs/CONFIGURATION.md");
        for o in OPTIONS {
            assert!(
                !o.is_mount_option() || doc.contains(&format!("`{}`", o.key)),
                "`{}` is not documented",
                o.key
            );
            if o.is_mount_option() {
                let long = o.long();
                assert!(
                    doc.contains(&format!("`--{long}`")) || doc.contains(&format!("`--{long} ")),
                    "--{long} is not documented"
                );
            }
            if o.live.is_some() {
                assert!(
                    doc.contains(&format!("| `{}` |", o.key))
                        || doc.contains(&format!("| `{}=", o.key)),
                    "live key {} is not in the table of live settings",
                    o.key
                );
            }
        }
    }

    #[test]
    fn keys_are_unique() {
        let mut words: Vec<&str> = Vec::new();
        for o in OPTIONS {
            words.push(o.key);
            if let Form::Switch { on, off, .. } = o.form {
                if on != o.key {
                    words.push(on);
                }
                words.extend(off.filter(|w| Opt::find(w).is_none()));
            }
        }
        let n = words.len();
        words.sort();
        words.dedup();
        assert_eq!(words.len(), n, "a key or switch word twice");
    }
}
