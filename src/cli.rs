//! Command line: `hoardfs SOURCE MOUNTPOINT [options]` mounts; subcommands talk to a mount.
//! Every mount option exists both as a `--long-flag` and as a mount-style `-o key=value`,
//! so that an fstab line can carry it; explicit flags win over `-o`. The options' flags are
//! made from the option table (`options::OPTIONS`, see `OptionArgs`); clap derive describes
//! the rest (subcommands, SOURCE, MOUNTPOINT, `-f`, `--config`, `--mount`).

use std::path::PathBuf;

use clap::builder::PossibleValuesParser;
use clap::{Arg, ArgAction, ArgMatches, Args, FromArgMatches, Parser, Subcommand};

use crate::config::{Config, parse_size};
use crate::options::{self, Form, OPTIONS, PROCESS};

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
    /// Clear a hoardfs mount whose daemon is dead or hung: abort its FUSE connection and
    /// detach it (a new mount there does this by itself; the systemd unit runs it after a
    /// stop). A mount whose daemon answers is left alone.
    Abort {
        /// The mount point, or with --config the name of a [mount.NAME] section.
        mount: PathBuf,
        /// Read MOUNT's mount point from this config file's [mount.MOUNT] section.
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
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
    /// Change settings of a running mount, KEY=VALUE (KEY=auto restores a default).
    Set {
        /// The mount point of a running hoardfs.
        mountpoint: PathBuf,
        #[arg(
            required = true,
            value_name = "KEY=VALUE",
            help = options::set_help(),
            long_help = options::set_long_help()
        )]
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

    /// A flag per mount option of `options::OPTIONS`, and `-o`.
    #[command(flatten)]
    pub options: OptionArgs,

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
}

/// The mount options given on the command line: a `--long-flag` per row of
/// `options::OPTIONS` (generated from the table: its help, value name and parser), and
/// `-o`. Both are kept in `-o` form, so that one parser (`options::apply`) reads them all.
#[derive(Debug, Default, Clone)]
pub struct OptionArgs {
    /// `-o` arguments as given (comma-separated options).
    pub options: Vec<String>,
    /// The flags given, each as one `-o` option: `--cache-size 20G` is `cache_size=20G`,
    /// `--read-only` is `ro`.
    pub flags: Vec<String>,
}

/// `--key-name` and its value's name (`KEY_NAME`, as clap derive names values) of each
/// row, made once (clap keeps `&'static str`s).
fn flag_names() -> &'static [(&'static str, &'static str)] {
    static NAMES: std::sync::OnceLock<Vec<(&'static str, &'static str)>> =
        std::sync::OnceLock::new();
    let leak = |s: String| &*Box::leak(s.into_boxed_str());
    NAMES.get_or_init(|| {
        OPTIONS
            .iter()
            .map(|o| (leak(o.long()), leak(o.key.to_uppercase())))
            .collect()
    })
}

impl Args for OptionArgs {
    fn augment_args(mut cmd: clap::Command) -> clap::Command {
        for (opt, (long, value)) in OPTIONS.iter().zip(flag_names()) {
            let arg = Arg::new(opt.key)
                .long(*long)
                .help(opt.flag_help())
                .help_heading(opt.heading);
            let arg = match opt.form {
                Form::LiveOnly => continue,
                Form::Switch { short, .. } => {
                    let arg = arg.action(ArgAction::SetTrue);
                    match short {
                        Some(c) => arg.short(c),
                        None => arg,
                    }
                }
                Form::Value { .. } if !opt.choices.is_empty() => arg
                    .value_name(*value)
                    .value_parser(PossibleValuesParser::new(opt.choices)),
                Form::Value { .. } => {
                    arg.value_name(*value)
                        .value_parser(move |v: &str| -> Result<String, String> {
                            let mut scratch = Config::new("/".into(), "/".into());
                            opt.set(&mut scratch, v).map(|()| v.to_string())
                        })
                }
            };
            cmd = cmd.arg(arg);
        }
        cmd.arg(
            Arg::new("options")
                .short('o')
                .value_name("OPTIONS")
                .action(ArgAction::Append)
                .help(options::o_help())
                .help_heading(PROCESS),
        )
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl FromArgMatches for OptionArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let mut a = OptionArgs::default();
        a.update_from_arg_matches(m)?;
        Ok(a)
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        if let Some(o) = m.get_many::<String>("options") {
            self.options = o.cloned().collect();
        }
        for opt in OPTIONS {
            match opt.form {
                Form::Switch { on, .. } if m.get_flag(opt.key) => self.flags.push(on.into()),
                Form::Value { .. } => {
                    if let Some(v) = m.get_one::<String>(opt.key) {
                        self.flags.push(format!("{}={v}", opt.key));
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }
}

impl MountArgs {
    /// Puts what `file` says for the mount (its top level, then `section`) under the
    /// command line's options.
    pub fn apply_file(
        &mut self,
        file: &crate::config_file::ConfigFile,
        section: Option<&str>,
    ) -> Result<(), String> {
        let mut layer = file.select(section)?;
        layer.options.append(&mut self.options.options);
        self.options.options = layer.options;
        self.foreground |= layer.foreground;
        self.source = self.source.take().or(layer.source);
        self.mountpoint = self.mountpoint.take().or(layer.mountpoint);
        Ok(())
    }

    /// The mount's configuration: the config file's options (its top level, then the
    /// section), then `-o`, then the flags; the last word on a key wins.
    pub fn into_config(mut self) -> Result<Config, String> {
        if let Some(path) = self.config.take() {
            let file = crate::config_file::load(&path)?;
            let section = self.mount_section.take();
            self.apply_file(&file, section.as_deref())?;
        }
        let options = &self.options.options;
        let source = self
            .source
            .ok_or("no SOURCE: give it, or `source` in the config file's [mount.NAME]")?;
        let mountpoint = self
            .mountpoint
            .ok_or("no MOUNTPOINT: give it, or `mountpoint` in the config file's [mount.NAME]")?;
        let mut c = options::config(source, mountpoint, options, &self.options.flags)?;
        c.foreground = self.foreground;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config;

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
