//! Command line: `hoardfs SOURCE MOUNTPOINT [options]` mounts; subcommands talk to a mount.
//! Every mount option exists both as a `--long-flag` and as a mount-style `-o key=value`,
//! so that an fstab line can carry it; explicit flags win over `-o`.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::{self, Config, parse_secs, parse_size};

const CACHING: &str = "Caching";
const KERNEL: &str = "Kernel caching and access";
const PROCESS: &str = "Process";
const OBJECT: &str = "Object-store sources";

#[derive(Debug, Parser)]
#[command(
    name = "hoardfs",
    version,
    about = "A persistent caching file system: mounts a slow SOURCE directory at MOUNTPOINT, \
             keeping file data in a local cache directory across restarts.",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
    #[command(flatten)]
    pub mount: MountArgs,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Show what reached the daemon of a mount: requests by type, hits, misses, bytes.
    Stats {
        /// The mount point of a running hoardfs.
        mountpoint: PathBuf,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Evict least-recently-used cached data now (down to the low watermark or --to).
    Clean {
        /// The mount point of a running hoardfs.
        mountpoint: PathBuf,
        /// Clean down to this size instead of the low watermark.
        #[arg(long, value_name = "SIZE", value_parser = parse_size)]
        to: Option<u64>,
    },
    /// Keep files or directory trees in the cache: the cleaner never evicts them.
    Pin {
        /// Paths inside a hoardfs mount.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Undo `pin`.
    Unpin {
        #[arg(required = true)]
        paths: Vec<PathBuf>,
    },
    /// Switch a mount to disconnected operation: only what the cache holds is served,
    /// changes fail with EROFS, nothing reaches the source until `hoardfs online`.
    Offline {
        /// The mount point of a running hoardfs.
        mountpoint: PathBuf,
    },
    /// End disconnected operation started by `hoardfs offline` (or `--offline`).
    Online {
        /// The mount point of a running hoardfs.
        mountpoint: PathBuf,
    },
    /// Fetch files or whole trees into the cache ahead of time (hoarding), in parallel,
    /// with progress; stops before the cache would pass its high watermark.
    Warm {
        /// Files or directories inside a hoardfs mount.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Also pin what is warmed, so the cleaner never evicts it.
        #[arg(long)]
        pin: bool,
        /// Files read at once.
        #[arg(short = 'j', long, default_value_t = 4)]
        jobs: usize,
    },
    /// Work with config files.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Write the man pages or a shell's completion script (for installing, packaging).
    Generate {
        #[command(subcommand)]
        what: Generate,
    },
    /// Change tunables of a running mount: cache_size=SIZE, high_watermark=PCT,
    /// low_watermark=PCT, min_free=SIZE, max_inodes=N, inode_free_min=N,
    /// inode_min_age=SECS, inode_max_age=SECS, inode_freeing=on|off, log=FILTER (the
    /// daemon's log level: error, warn, info, debug, trace, or a HOARDFS_LOG spec).
    Set {
        /// The mount point of a running hoardfs.
        mountpoint: PathBuf,
        /// KEY=VALUE pairs.
        #[arg(required = true)]
        settings: Vec<String>,
    },
}

#[derive(Debug, Subcommand)]
pub enum ConfigAction {
    /// Check a config file: every problem is printed as FILE:LINE:COLUMN: message.
    Check {
        /// The TOML file.
        file: PathBuf,
    },
}

#[derive(Debug, Subcommand)]
pub enum Generate {
    /// Write hoardfs.1 and a page per subcommand (hoardfs-stats.1, ...) into DIR, which
    /// must exist.
    Man { dir: PathBuf },
    /// Print the completion script for SHELL (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
}

#[derive(Debug, Args)]
pub struct MountArgs {
    /// The directory to cache (any POSIX file system: NFS, SMB, SSHFS, a slow disk), or an
    /// S3-compatible bucket as s3://BUCKET[/PREFIX].
    #[arg(required_unless_present = "mount_section")]
    pub source: Option<PathBuf>,
    /// Where to present the source's tree.
    #[arg(required_unless_present = "mount_section")]
    pub mountpoint: Option<PathBuf>,

    /// Where cached data lives [default: $XDG_CACHE_HOME/hoardfs/<source> or
    /// /var/cache/hoardfs/<source> for root].
    #[arg(long, help_heading = CACHING)]
    pub cache_dir: Option<PathBuf>,
    /// Files up to this size are fetched whole on first open [default: 8M].
    #[arg(long, value_parser = parse_size, help_heading = CACHING)]
    pub whole_file_threshold: Option<u64>,
    /// Chunk size for larger files, a power of two >= 4K [default: 1M].
    #[arg(long, value_parser = parse_size, help_heading = CACHING)]
    pub chunk_size: Option<u64>,
    /// Cache size limit [default: --cache-share of the cache's file system].
    #[arg(long, value_parser = parse_size, help_heading = CACHING)]
    pub cache_size: Option<u64>,
    /// Percent of the cache's file system the cache may use when --cache-size is not given [default: 80].
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=100), help_heading = CACHING)]
    pub cache_share: Option<u8>,
    /// The cleaner starts above this percent of the limit [default: 90].
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=100), help_heading = CACHING)]
    pub high_watermark: Option<u8>,
    /// The cleaner cleans down to this percent of the limit [default: 70].
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=99), help_heading = CACHING)]
    pub low_watermark: Option<u8>,
    /// Free space to leave on the cache's file system [default: 5% of it].
    #[arg(long, value_parser = parse_size, help_heading = CACHING)]
    pub min_free: Option<u64>,
    /// Trust the cache: do not compare cached files with the source on open.
    #[arg(long, help_heading = CACHING)]
    pub no_stale_check: bool,
    /// Threads fetching from the source in the background [default: one per CPU, 2..8;
    /// at least 8 on network and FUSE sources].
    #[arg(long, help_heading = CACHING)]
    pub fetch_workers: Option<usize>,
    /// Largest prefetch window of a sequential reader, in chunks; 0 turns prefetch off
    /// [default: 8].
    #[arg(long, help_heading = CACHING)]
    pub fetch_window: Option<u64>,
    /// Bytes of chunks queued for or being fetched by the workers [default: 64M].
    #[arg(long, value_parser = parse_size, help_heading = CACHING)]
    pub fetch_inflight: Option<u64>,
    /// Source files kept open for fetching; above it reads of further partially cached
    /// files go to the source uncached [default: 256].
    #[arg(long, help_heading = CACHING)]
    pub fetch_fds: Option<u64>,
    /// Files of a directory fetched whole in the background ahead of a reader opening
    /// them in listing order (grep -r, cp -r); 0 turns it off [default: 16].
    #[arg(long, help_heading = CACHING)]
    pub fetch_dir_prefetch: Option<u64>,

    /// Seconds the kernel may keep a name lookup [default: 60 in watched directories,
    /// 1 elsewhere].
    #[arg(long, value_parser = parse_secs, help_heading = KERNEL)]
    pub entry_ttl: Option<Duration>,
    /// Seconds the kernel may keep attributes [default: 60 where watched, 1 elsewhere].
    #[arg(long, value_parser = parse_secs, help_heading = KERNEL)]
    pub attr_ttl: Option<Duration>,
    /// Seconds the kernel may remember that a name does not exist [default: 60 where
    /// watched, 1 elsewhere].
    #[arg(long, value_parser = parse_secs, help_heading = KERNEL)]
    pub negative_ttl: Option<Duration>,
    /// Watch the source for changes made behind the mount (inotify) and invalidate the
    /// kernel's and the cache's copies; `auto` watches local file systems only.
    #[arg(long, value_enum, help_heading = KERNEL)]
    pub watch: Option<config::WatchMode>,
    /// Longest wait in seconds for one call to the source before the mount goes offline
    /// (0: none) [default: 10 on network and FUSE sources, none on local ones].
    #[arg(long, value_parser = parse_secs, help_heading = CACHING)]
    pub source_timeout: Option<Duration>,
    /// Start disconnected: serve only what the cache holds until `hoardfs online`.
    #[arg(long, help_heading = CACHING)]
    pub offline: bool,
    /// Changes while disconnected: `refuse` (EROFS) or `log` (applied to the cache, logged,
    /// replayed to the source on reconnection; conflicts keep both versions) [default: refuse].
    #[arg(long, value_enum, help_heading = CACHING)]
    pub offline_writes: Option<config::OfflineWrites>,
    /// An s3:// source's endpoint, http[s]://HOST[:PORT] [default: AWS_ENDPOINT_URL, the
    /// profile's endpoint_url, else AWS].
    #[arg(long, value_name = "URL", help_heading = OBJECT)]
    pub s3_endpoint: Option<String>,
    /// An s3:// source's region [default: AWS_REGION, the profile's, else us-east-1].
    #[arg(long, value_name = "REGION", help_heading = OBJECT)]
    pub s3_region: Option<String>,
    /// Address the bucket as BUCKET.HOST (virtual-hosted style) instead of HOST/BUCKET.
    #[arg(long, help_heading = OBJECT)]
    pub s3_virtual_hosted: bool,
    /// Serve reads of fully cached files through the daemon instead of FUSE passthrough.
    #[arg(long, help_heading = KERNEL)]
    pub no_passthrough: bool,
    /// Let other users than the mounting one use the mount (access is still checked
    /// against file modes: default_permissions is always on).
    #[arg(long, help_heading = KERNEL)]
    pub allow_other: bool,
    /// Mount read-only.
    #[arg(short = 'r', long, help_heading = KERNEL)]
    pub read_only: bool,
    /// Mount even if MOUNTPOINT is not empty (its files are hidden while mounted).
    #[arg(long, help_heading = KERNEL)]
    pub nonempty: bool,

    /// Soft maximum of inodes the daemon keeps; above it the kernel is asked to drop cold
    /// entries [default: what fits in 2% of RAM, 16Ki..256Ki].
    #[arg(long, help_heading = KERNEL)]
    pub max_inodes: Option<usize>,

    /// Stay in the foreground (do not daemonize).
    #[arg(short = 'f', long, help_heading = PROCESS)]
    pub foreground: bool,
    /// Read options from this TOML file (docs/CONFIGURATION.md); the command line wins.
    #[arg(long, value_name = "FILE", help_heading = PROCESS)]
    pub config: Option<PathBuf>,
    /// Mount the [mount.NAME] section of the --config file (NAME may also be its mount
    /// point); SOURCE and MOUNTPOINT then come from the section unless given.
    #[arg(long = "mount", value_name = "NAME", requires = "config", help_heading = PROCESS)]
    pub mount_section: Option<String>,
    /// Threads serving FUSE requests [default: 4].
    #[arg(long, help_heading = PROCESS)]
    pub threads: Option<usize>,
    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9560) [default: off].
    #[arg(long, value_name = "ADDR", help_heading = PROCESS)]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Mount options, comma separated, as in fstab: cache_dir=DIR, whole_file_threshold=SIZE,
    /// chunk_size=SIZE, entry_ttl=S, attr_ttl=S, negative_ttl=S, watch=auto|on|off,
    /// source_timeout=S, offline, offline_writes=refuse|log, no_stale_check,
    /// no_passthrough, allow_other, ro, rw, nonempty, threads=N, max_inodes=N, cache_size=SIZE,
    /// cache_share=PCT, high_watermark=PCT, low_watermark=PCT, min_free=SIZE,
    /// metrics_addr=ADDR, s3_endpoint=URL, s3_region=R, s3_virtual_hosted, fetch_workers=N, fetch_window=N, fetch_inflight=SIZE,
    /// fetch_fds=N, fetch_dir_prefetch=N; the generic mount(8) options
    /// (defaults, _netdev, nofail, auto, noauto, user, users, nodev, nosuid, noexec, ...)
    /// are accepted and ignored.
    #[arg(short = 'o', value_name = "OPTIONS", help_heading = PROCESS)]
    pub options: Vec<String>,
}

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

impl MountArgs {
    pub fn into_config(mut self) -> Result<Config, String> {
        if let Some(path) = self.config.take() {
            let file = crate::config_file::load(&path)?;
            let section = self.mount_section.take();
            file.apply(&mut self, section.as_deref())?;
        }
        let source = self
            .source
            .ok_or("no SOURCE: give it, or `source` in the config file's [mount.NAME]")?;
        let mountpoint = self
            .mountpoint
            .ok_or("no MOUNTPOINT: give it, or `mountpoint` in the config file's [mount.NAME]")?;
        let chunk_size = config::default_chunk_size(&source);
        let mut c = Config {
            cache_dir: PathBuf::new(),
            source,
            mountpoint,
            whole_file_threshold: config::DEFAULT_WHOLE_FILE_THRESHOLD,
            chunk_size,
            entry_ttl: None,
            attr_ttl: None,
            negative_ttl: None,
            watch: config::WatchMode::Auto,
            source_timeout: None,
            start_offline: false,
            offline_writes: config::OfflineWrites::Refuse,
            stale_check: true,
            passthrough: true,
            allow_other: false,
            read_only: false,
            nonempty: false,
            foreground: false,
            threads: 4,
            checkpoint_chunks: config::DEFAULT_CHECKPOINT_CHUNKS,
            fetch_workers: None,
            fetch_window: config::DEFAULT_FETCH_WINDOW,
            fetch_inflight: config::DEFAULT_FETCH_INFLIGHT,
            fetch_fds: config::DEFAULT_FETCH_FDS,
            fetch_dir_prefetch: config::DEFAULT_FETCH_DIR_PREFETCH,
            max_inodes: 0,
            cache_size: None,
            cache_share: config::DEFAULT_CACHE_SHARE,
            high_watermark: config::DEFAULT_HIGH_WATERMARK,
            low_watermark: config::DEFAULT_LOW_WATERMARK,
            min_free: None,
            metrics_addr: None,
            s3: config::S3Settings::default(),
        };
        let mut max_inodes = None;
        let mut cache_dir = None;
        for opt in self
            .options
            .iter()
            .flat_map(|o| o.split(','))
            .filter(|o| !o.is_empty())
        {
            let (key, value) = match opt.split_once('=') {
                Some((k, v)) => (k, Some(v)),
                None => (opt, None),
            };
            let need = |v: Option<&'_ str>| -> Result<String, String> {
                v.map(str::to_owned)
                    .ok_or_else(|| format!("mount option {key} needs a value"))
            };
            match key {
                "cache_dir" => cache_dir = Some(PathBuf::from(need(value)?)),
                "whole_file_threshold" => c.whole_file_threshold = parse_size(&need(value)?)?,
                "chunk_size" => c.chunk_size = parse_size(&need(value)?)?,
                "entry_ttl" => c.entry_ttl = Some(parse_secs(&need(value)?)?),
                "attr_ttl" => c.attr_ttl = Some(parse_secs(&need(value)?)?),
                "negative_ttl" => c.negative_ttl = Some(parse_secs(&need(value)?)?),
                "watch" => c.watch = need(value)?.parse()?,
                "source_timeout" => c.source_timeout = Some(parse_secs(&need(value)?)?),
                "offline" => c.start_offline = true,
                "offline_writes" => c.offline_writes = need(value)?.parse()?,
                "threads" => {
                    c.threads = need(value)?
                        .parse()
                        .map_err(|_| format!("invalid threads in {opt:?}"))?
                }
                "max_inodes" => {
                    max_inodes = Some(
                        need(value)?
                            .parse()
                            .map_err(|_| format!("invalid max_inodes in {opt:?}"))?,
                    )
                }
                "cache_size" => c.cache_size = Some(parse_size(&need(value)?)?),
                "fetch_inflight" => c.fetch_inflight = parse_size(&need(value)?)?,
                "fetch_workers" | "fetch_window" | "fetch_fds" | "fetch_dir_prefetch" => {
                    let v: u64 = need(value)?
                        .parse()
                        .map_err(|_| format!("invalid number in {opt:?}"))?;
                    match key {
                        "fetch_workers" => c.fetch_workers = Some(v as usize),
                        "fetch_window" => c.fetch_window = v,
                        "fetch_dir_prefetch" => c.fetch_dir_prefetch = v,
                        _ => c.fetch_fds = v,
                    }
                }
                "metrics_addr" => {
                    c.metrics_addr = Some(
                        need(value)?
                            .parse()
                            .map_err(|_| format!("invalid address in {opt:?} (HOST:PORT)"))?,
                    )
                }
                "min_free" => c.min_free = Some(parse_size(&need(value)?)?),
                "cache_share" | "high_watermark" | "low_watermark" => {
                    let v: u8 = need(value)?
                        .trim_end_matches('%')
                        .parse()
                        .map_err(|_| format!("invalid percentage in {opt:?}"))?;
                    match key {
                        "cache_share" => c.cache_share = v,
                        "high_watermark" => c.high_watermark = v,
                        _ => c.low_watermark = v,
                    }
                }
                "s3_endpoint" => c.s3.endpoint = Some(need(value)?),
                "s3_region" => c.s3.region = Some(need(value)?),
                "s3_virtual_hosted" => c.s3.virtual_hosted = true,
                "no_stale_check" => c.stale_check = false,
                "stale_check" => c.stale_check = true,
                "no_passthrough" => c.passthrough = false,
                "passthrough" => c.passthrough = true,
                "allow_other" => c.allow_other = true,
                "nonempty" => c.nonempty = true,
                "ro" => c.read_only = true,
                "rw" => c.read_only = false,
                k if IGNORED_MOUNT_OPTIONS.contains(&k)
                    || k.starts_with("x-")
                    || k.starts_with("comment=") => {}
                _ => return Err(format!("unknown mount option {opt:?}")),
            }
        }
        if let Some(d) = self.cache_dir {
            cache_dir = Some(d);
        }
        if let Some(v) = self.whole_file_threshold {
            c.whole_file_threshold = v;
        }
        if let Some(v) = self.chunk_size {
            c.chunk_size = v;
        }
        if let Some(v) = self.entry_ttl {
            c.entry_ttl = Some(v);
        }
        if let Some(v) = self.attr_ttl {
            c.attr_ttl = Some(v);
        }
        if let Some(v) = self.negative_ttl {
            c.negative_ttl = Some(v);
        }
        if let Some(v) = self.watch {
            c.watch = v;
        }
        if let Some(v) = self.source_timeout {
            c.source_timeout = Some(v);
        }
        c.start_offline |= self.offline;
        if let Some(v) = self.offline_writes {
            c.offline_writes = v;
        }
        if let Some(v) = self.threads {
            c.threads = v;
        }
        c.fetch_workers = self.fetch_workers.or(c.fetch_workers);
        c.fetch_window = self.fetch_window.unwrap_or(c.fetch_window);
        c.fetch_inflight = self.fetch_inflight.unwrap_or(c.fetch_inflight);
        c.fetch_fds = self.fetch_fds.unwrap_or(c.fetch_fds);
        c.fetch_dir_prefetch = self.fetch_dir_prefetch.unwrap_or(c.fetch_dir_prefetch);
        c.metrics_addr = self.metrics_addr.or(c.metrics_addr);
        c.cache_size = self.cache_size.or(c.cache_size);
        c.min_free = self.min_free.or(c.min_free);
        c.cache_share = self.cache_share.unwrap_or(c.cache_share);
        c.high_watermark = self.high_watermark.unwrap_or(c.high_watermark);
        c.low_watermark = self.low_watermark.unwrap_or(c.low_watermark);
        c.max_inodes = self
            .max_inodes
            .or(max_inodes)
            .unwrap_or_else(config::default_max_inodes);
        c.s3.endpoint = self.s3_endpoint.or(c.s3.endpoint);
        c.s3.region = self.s3_region.or(c.s3.region);
        c.s3.virtual_hosted |= self.s3_virtual_hosted;
        c.stale_check &= !self.no_stale_check;
        c.passthrough &= !self.no_passthrough;
        c.allow_other |= self.allow_other;
        c.read_only |= self.read_only;
        c.nonempty |= self.nonempty;
        c.foreground = self.foreground;
        c.cache_dir = match cache_dir {
            Some(d) => d,
            None if c.is_object_source() => config::default_cache_dir(&c.source),
            None => {
                let abs = std::fs::canonicalize(&c.source).unwrap_or_else(|_| c.source.clone());
                config::default_cache_dir(&abs)
            }
        };
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Config, String> {
        let cli = Cli::try_parse_from(args).map_err(|e| e.to_string())?;
        cli.mount.into_config()
    }

    #[test]
    fn mount_options_and_flags() {
        let c = parse(&[
            "hoardfs",
            "/src",
            "/mnt",
            "-o",
            "cache_dir=/c,chunk_size=64K,ro,_netdev",
            "--chunk-size",
            "2M",
        ])
        .unwrap();
        assert_eq!(c.cache_dir, PathBuf::from("/c"));
        assert_eq!(c.chunk_size, 2 << 20, "flags win over -o");
        assert!(c.read_only);
        assert!(!c.nonempty);
        let c = parse(&["hoardfs", "/src", "/mnt", "-o", "nonempty"]).unwrap();
        assert!(c.nonempty);
        let c = parse(&["hoardfs", "/src", "/mnt", "--nonempty"]).unwrap();
        assert!(c.nonempty);
        assert!(
            parse(&["hoardfs", "/src", "/mnt", "-o", "bogus"])
                .unwrap_err()
                .contains("bogus")
        );
        assert!(parse(&["hoardfs", "/src"]).is_err());
    }

    #[test]
    fn object_sources_default_to_larger_chunks() {
        let c = parse(&["hoardfs", "/src", "/mnt"]).unwrap();
        assert_eq!(c.chunk_size, config::DEFAULT_CHUNK_SIZE);
        let c = parse(&["hoardfs", "s3://bucket/p", "/mnt"]).unwrap();
        assert_eq!(c.chunk_size, config::OBJECT_CHUNK_SIZE);
        let c = parse(&["hoardfs", "s3://bucket", "/mnt", "-o", "chunk_size=1M"]).unwrap();
        assert_eq!(c.chunk_size, 1 << 20, "an explicit size wins");
    }

    #[test]
    fn max_inodes_option() {
        let c = parse(&["hoardfs", "/src", "/mnt", "-o", "max_inodes=5000"]).unwrap();
        assert_eq!(c.max_inodes, 5000);
        let c = parse(&[
            "hoardfs",
            "/src",
            "/mnt",
            "--max-inodes",
            "7",
            "-o",
            "max_inodes=5",
        ]);
        assert_eq!(c.unwrap().max_inodes, 7, "flags win over -o");
        let d = parse(&["hoardfs", "/src", "/mnt"]).unwrap().max_inodes;
        assert!((16 << 10..=256 << 10).contains(&d), "default {d}");
    }

    #[test]
    fn stats_subcommand() {
        let cli = Cli::try_parse_from(["hoardfs", "stats", "/mnt", "--json"]).unwrap();
        assert!(matches!(
            cli.command,
            Some(Command::Stats { json: true, .. })
        ));
        let cli = Cli::try_parse_from(["hoardfs", "set", "/mnt", "max_inodes=10"]).unwrap();
        assert!(matches!(cli.command, Some(Command::Set { .. })));
    }
}
