//! The config file (`--config FILE`): TOML with every mount option of the command line.
//! Top-level keys apply to every mount; a `[mount.NAME]` section holds one mount's `source`,
//! `mountpoint` and options, selected with `--mount NAME` (or by its mount point).
//!
//! ```toml
//! cache_size = "20G"          # all mounts
//! [mount.media]
//! source = "/srv/nfs/media"
//! mountpoint = "/mnt/media"
//! attr_ttl = 5
//! ```
//!
//! Precedence: command-line flags, then `-o` options, then the mount's section, then the
//! top level. The file's values become `-o key=value` options placed before the command
//! line's, so they are parsed and validated by exactly the code that parses `-o`.
//! `hoardfs config check FILE` reports every problem as `FILE:LINE:COLUMN: message`.

use std::ops::Range;
use std::path::{Path, PathBuf};

use toml_edit::{ImDocument, Item, TableLike, Value};

use crate::options::{Form, Opt};

/// The keys of a file that are no mount options: `source` and `mountpoint` (the positional
/// arguments, only in a `[mount.NAME]` section) and `foreground` (`-f`). Every other key is
/// a row of `options::OPTIONS`.
const OWN_KEYS: &[&str] = &["source", "mountpoint", "foreground"];

/// Options checked against each other per mount rather than alone.
const CHECKED_TOGETHER: &[&str] = &["high_watermark", "low_watermark", "cache_share"];

/// The mount option of `key`, if it is one.
fn option(key: &str) -> Option<&'static Opt> {
    Opt::find(key).filter(|o| o.is_mount_option())
}

/// A problem in the file, at a byte range of it.
#[derive(Debug)]
pub struct Problem {
    pub span: Option<Range<usize>>,
    pub message: String,
}

/// What one table of the file says (or a mount's tables together), in command-line form.
#[derive(Debug, Default, Clone)]
pub struct Settings {
    /// `-o` options, in order (later ones win).
    pub options: Vec<String>,
    pub foreground: bool,
    pub source: Option<PathBuf>,
    pub mountpoint: Option<PathBuf>,
}

/// A parsed and checked file.
#[derive(Debug)]
pub struct ConfigFile {
    global: Settings,
    /// `[mount.NAME]` sections in file order.
    mounts: Vec<(String, Settings)>,
}

impl ConfigFile {
    /// Parses and checks `text`; every problem is reported, not just the first.
    pub fn parse(text: &str) -> Result<ConfigFile, Vec<Problem>> {
        let doc = ImDocument::parse(text).map_err(|e| {
            vec![Problem {
                span: e.span(),
                message: e.message().trim_end().to_string(),
            }]
        })?;
        let mut problems = Vec::new();
        let root = doc.as_table();
        let global = settings(root, false, &mut problems);
        let mut mounts = Vec::new();
        if let Some((key, item)) = root.get_key_value("mount") {
            match item.as_table_like() {
                Some(t) => {
                    for (name, item) in t.iter() {
                        match item.as_table_like() {
                            Some(section) => {
                                let s = settings(section, true, &mut problems);
                                for k in ["source", "mountpoint"] {
                                    if section.get(k).is_none() {
                                        problems.push(Problem {
                                            span: t.get_key_value(name).and_then(|(k, _)| k.span()),
                                            message: format!("[mount.{name}] has no `{k}`"),
                                        });
                                    }
                                }
                                // Options that are valid alone but not together (watermarks).
                                let mut all = global.options.clone();
                                all.extend(s.options.iter().cloned());
                                if let Err(e) = check_options(&all, true) {
                                    problems.push(Problem {
                                        span: t.get_key_value(name).and_then(|(k, _)| k.span()),
                                        message: format!("[mount.{name}]: {e}"),
                                    });
                                }
                                mounts.push((name.to_string(), s));
                            }
                            None => problems.push(Problem {
                                span: item.span(),
                                message: format!(
                                    "mount.{name} must be a table: [mount.{name}] with source, \
                                     mountpoint and options"
                                ),
                            }),
                        }
                    }
                }
                None => problems.push(Problem {
                    span: key.span(),
                    message: "`mount` must hold [mount.NAME] sections".into(),
                }),
            }
        }
        if mounts.is_empty()
            && problems.is_empty()
            && let Err(e) = check_options(&global.options, true)
        {
            problems.push(Problem {
                span: None,
                message: e,
            });
        }
        if problems.is_empty() {
            Ok(ConfigFile { global, mounts })
        } else {
            problems.sort_by_key(|p| p.span.as_ref().map(|s| s.start));
            Err(problems)
        }
    }

    pub fn mount_names(&self) -> impl Iterator<Item = &str> {
        self.mounts.iter().map(|(n, _)| n.as_str())
    }

    /// The section called `name`, or else the one whose mount point is `name` (so that a
    /// systemd instance can be an escaped mount point).
    fn section(&self, name: &str) -> Option<&Settings> {
        self.mounts
            .iter()
            .find(|(n, _)| n == name)
            .or_else(|| {
                self.mounts
                    .iter()
                    .find(|(_, s)| s.mountpoint.as_deref() == Some(Path::new(name)))
            })
            .map(|(_, s)| s)
    }

    /// What the file says for a mount: its top level, then the section `section` (by
    /// name or mount point) if given; the command line goes on top.
    pub fn select(&self, section: Option<&str>) -> Result<Settings, String> {
        let mut layers = vec![&self.global];
        if let Some(name) = section {
            let names: Vec<&str> = self.mount_names().collect();
            layers.push(self.section(name).ok_or_else(|| {
                format!(
                    "no [mount.{name}] section (nor one with mountpoint = {name:?}); the file has: {}",
                    if names.is_empty() {
                        "none".into()
                    } else {
                        names.join(", ")
                    }
                )
            })?);
        }
        let mut out = Settings::default();
        for s in layers {
            out.options.extend(s.options.iter().cloned());
            out.foreground |= s.foreground;
            out.source = s.source.clone().or(out.source);
            out.mountpoint = s.mountpoint.clone().or(out.mountpoint);
        }
        Ok(out)
    }
}

/// Reads `path`; problems come back as `PATH:LINE:COLUMN: message` lines.
pub fn load(path: &Path) -> Result<ConfigFile, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    ConfigFile::parse(&text).map_err(|problems| render(path, &text, &problems))
}

/// `PATH:LINE:COLUMN: message`, one line per problem (lines and columns count from 1).
pub fn render(path: &Path, text: &str, problems: &[Problem]) -> String {
    problems
        .iter()
        .map(|p| match &p.span {
            Some(span) => {
                let before = &text[..span.start.min(text.len())];
                let line = before.matches('\n').count() + 1;
                let col = before.chars().rev().take_while(|c| *c != '\n').count() + 1;
                format!("{}:{line}:{col}: {}", path.display(), p.message)
            }
            None => format!("{}: {}", path.display(), p.message),
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Checks one table's keys and turns them into command-line form.
fn settings(table: &dyn TableLike, in_section: bool, problems: &mut Vec<Problem>) -> Settings {
    let mut s = Settings::default();
    for (key, item) in table.iter() {
        if key == "mount" && !in_section {
            continue;
        }
        let key_span = table.get_key_value(key).and_then(|(k, _)| k.span());
        let known = |k: &str| OWN_KEYS.contains(&k) || option(k).is_some();
        if !known(key) {
            let hint = if known(&key.replace('-', "_")) {
                format!(" (did you mean `{}`?)", key.replace('-', "_"))
            } else {
                String::new()
            };
            problems.push(Problem {
                span: key_span,
                message: format!("unknown key `{key}`{hint}"),
            });
            continue;
        };
        let span = item.span().or(key_span.clone());
        let mut bad = |message: String| {
            problems.push(Problem {
                span: span.clone(),
                message,
            })
        };
        let value = match item {
            Item::Value(v) => v,
            _ => {
                bad(format!("`{key}` must be a value, not a table"));
                continue;
            }
        };
        let form = option(key).map(|o| o.form);
        match (key, form) {
            ("source" | "mountpoint", _) if !in_section => bad(format!(
                "`{key}` belongs in a [mount.NAME] section, not at the top level"
            )),
            ("source" | "mountpoint", _) => match value.as_str() {
                Some(p)
                    if Path::new(p).is_absolute()
                        || (key == "source" && p.starts_with("s3://")) =>
                {
                    let p = Some(PathBuf::from(p));
                    if key == "source" {
                        s.source = p;
                    } else {
                        s.mountpoint = p;
                    }
                }
                _ => bad(format!("`{key}` must be an absolute path in quotes")),
            },
            ("foreground", _) => match value.as_bool() {
                Some(b) => s.foreground = b,
                None => bad(format!("`{key}` must be true or false")),
            },
            (_, Some(Form::Switch { on, off, .. })) => match value.as_bool() {
                Some(true) => s.options.push(on.into()),
                Some(false) => s.options.extend(off.map(String::from)),
                None => bad(format!("`{key}` must be true or false")),
            },
            _ => {
                let text = match value {
                    Value::String(v) => v.value().clone(),
                    Value::Integer(v) => v.value().to_string(),
                    Value::Float(v) => v.value().to_string(),
                    _ => {
                        bad(format!("`{key}` must be a string or a number"));
                        continue;
                    }
                };
                if text.contains(',') {
                    bad(format!("`{key}`: values cannot contain ','"));
                    continue;
                }
                let opt = format!("{key}={text}");
                // The very parser of `-o`, on this one option (the watermarks are checked
                // against each other per mount, below).
                let alone = !CHECKED_TOGETHER.contains(&key);
                match check_options(std::slice::from_ref(&opt), alone) {
                    Ok(()) => s.options.push(opt),
                    Err(e) => {
                        let e = e.strip_prefix(&format!("{key}: ")).unwrap_or(&e);
                        bad(format!("`{key}`: {e}"))
                    }
                }
            }
        }
    }
    s
}

/// Whether `opts` (`-o` form) make a valid mount, alone (`check_values`: with the checks
/// of values against each other too).
fn check_options(opts: &[String], check_values: bool) -> Result<(), String> {
    let c = crate::options::config("/".into(), "/".into(), opts, &[])?;
    if check_values {
        c.check_values().map_err(|e| e.to_string())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::OPTIONS;
    use clap::{CommandFactory, Parser};

    fn config_of(args: &[&str]) -> Result<crate::config::Config, String> {
        crate::cli::Cli::try_parse_from(args)
            .map_err(|e| e.to_string())?
            .mount
            .into_config()
    }

    fn problems(text: &str) -> String {
        match ConfigFile::parse(text) {
            Ok(_) => String::new(),
            Err(p) => render(Path::new("f.toml"), text, &p),
        }
    }

    #[test]
    fn errors_name_line_and_column() {
        let text = "cache_size = \"20G\"\n\
                    chunk_size = \"3K\"\n\
                    [mount.a]\n\
                    source = \"/s\"\n\
                    mountpoint = \"/m\"\n\
                    \x20 attr-ttl = 2\n\
                    threads = true\n\
                    [mount.b]\n\
                    source = \"relative\"\n";
        let out = problems(text);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 5, "{out}");
        assert!(lines[0].starts_with("f.toml:2:14: `chunk_size`:"), "{out}");
        assert!(
            lines[1].starts_with("f.toml:6:3: unknown key `attr-ttl` (did you mean `attr_ttl`?)"),
            "{out}"
        );
        assert!(
            lines[2].starts_with("f.toml:7:11: `threads` must be a string or a number"),
            "{out}"
        );
        assert!(lines[3].contains("[mount.b] has no `mountpoint`"), "{out}");
        assert!(
            lines[4].starts_with("f.toml:9:10: `source` must be an absolute path"),
            "{out}"
        );
    }

    #[test]
    fn watermarks_are_checked_together_per_mount() {
        let ok = "high_watermark = 98\n[mount.a]\nsource = \"/s\"\nmountpoint = \"/m\"\n\
                  low_watermark = 95\n";
        assert_eq!(problems(ok), "");
        let bad = ok.replace("98", "90");
        let out = problems(&bad);
        assert!(
            out.starts_with("f.toml:2:8: [mount.a]: watermarks"),
            "{out}"
        );
    }

    #[test]
    fn syntax_errors_have_a_position() {
        let out = problems("a = 1\nb = \n");
        assert!(out.starts_with("f.toml:2:5: "), "{out}");
    }

    #[test]
    fn sections_fill_in_and_the_command_line_wins() {
        let file = ConfigFile::parse(
            "chunk_size = \"64K\"\nattr_ttl = 3\nread_only = true\n\
             [mount.media]\nsource = \"/srv/m\"\nmountpoint = \"/mnt/m\"\n\
             attr_ttl = 0.5\nno_passthrough = true\nforeground = true\n",
        )
        .unwrap();
        let mut cli = crate::cli::Cli::try_parse_from(["hoardfs", "-o", "chunk_size=128K"]);
        // SOURCE and MOUNTPOINT are required without --mount: give the section.
        assert!(cli.is_err());
        cli = crate::cli::Cli::try_parse_from([
            "hoardfs",
            "--config",
            "/dev/null",
            "--mount",
            "media",
            "-o",
            "chunk_size=128K",
            "--entry-ttl",
            "7",
        ]);
        let mut args = cli.unwrap().mount;
        args.config = None;
        args.apply_file(&file, Some("media")).unwrap();
        let c = args.into_config().unwrap();
        assert_eq!(c.source, PathBuf::from("/srv/m"));
        assert_eq!(c.mountpoint, PathBuf::from("/mnt/m"));
        assert_eq!(c.chunk_size, 128 << 10, "-o wins over the file");
        assert_eq!(
            c.attr_ttl.unwrap().as_millis(),
            500,
            "the section wins over the top"
        );
        assert_eq!(c.entry_ttl.unwrap().as_secs(), 7);
        assert!(c.read_only && !c.passthrough && c.foreground);

        let mut args = crate::cli::Cli::try_parse_from(["hoardfs", "/a", "/b"])
            .unwrap()
            .mount;
        args.apply_file(&file, Some("/mnt/m")).unwrap();
        assert_eq!(args.into_config().unwrap().source, PathBuf::from("/a"));
        let mut args = crate::cli::Cli::try_parse_from(["hoardfs", "/a", "/b"])
            .unwrap()
            .mount;
        let e = args.apply_file(&file, Some("nope")).unwrap_err();
        assert!(e.contains("media"), "{e}");
    }

    #[test]
    fn a_file_with_every_key_gives_the_same_config_as_the_flags() {
        let text = r#"
            cache_dir = "/c"
            whole_file_threshold = "4M"
            chunk_size = "256K"
            cache_size = "10G"
            cache_share = 50
            high_watermark = 80
            low_watermark = 60
            min_free = "1G"
            no_stale_check = true
            entry_ttl = 2
            attr_ttl = 3
            negative_ttl = 0
            no_passthrough = true
            allow_other = true
            read_only = true
            max_inodes = 1000
            foreground = true
            threads = 2
            metrics_addr = "127.0.0.1:9560"
            [mount.x]
            source = "/s"
            mountpoint = "/m"
        "#;
        let file = ConfigFile::parse(text).unwrap();
        let mut args =
            crate::cli::Cli::try_parse_from(["hoardfs", "--config", "f", "--mount", "x"])
                .unwrap()
                .mount;
        args.config = None;
        args.apply_file(&file, Some("x")).unwrap();
        let from_file = args.into_config().unwrap();
        let from_flags = config_of(&[
            "hoardfs",
            "/s",
            "/m",
            "--cache-dir=/c",
            "--whole-file-threshold=4M",
            "--chunk-size=256K",
            "--cache-size=10G",
            "--cache-share=50",
            "--high-watermark=80",
            "--low-watermark=60",
            "--min-free=1G",
            "--no-stale-check",
            "--entry-ttl=2",
            "--attr-ttl=3",
            "--negative-ttl=0",
            "--no-passthrough",
            "--allow-other",
            "--read-only",
            "--max-inodes=1000",
            "--foreground",
            "--threads=2",
            "--metrics-addr=127.0.0.1:9560",
        ])
        .unwrap();
        assert_eq!(format!("{from_file:?}"), format!("{from_flags:?}"));
    }

    /// The file, the command line and docs/CONFIGURATION.md cannot drift apart.
    #[test]
    fn every_flag_is_a_key_and_documented() {
        let doc = include_str!("../docs/CONFIGURATION.md");
        let cmd = crate::cli::Cli::command();
        let mut flags = Vec::new();
        for arg in cmd.get_arguments() {
            let Some(long) = arg.get_long() else { continue };
            if ["help", "version", "config", "mount"].contains(&long) {
                continue;
            }
            let key = long.replace('-', "_");
            assert!(
                known(&key),
                "--{long} has no config key `{key}` (options::OPTIONS)"
            );
            assert!(
                (doc.contains(&format!("`--{long}`")) || doc.contains(&format!("`--{long} ")))
                    && doc.contains(&format!("`{key}`")),
                "--{long} / `{key}` is not in docs/CONFIGURATION.md"
            );
            flags.push(key);
        }
        let keys = OPTIONS
            .iter()
            .filter(|o| o.is_mount_option())
            .map(|o| o.key)
            .chain(OWN_KEYS.iter().copied());
        for key in keys {
            assert!(
                ["source", "mountpoint"].contains(&key) || flags.contains(&key.to_string()),
                "config key `{key}` has no flag"
            );
            assert!(
                doc.contains(&format!("`{key}`")),
                "`{key}` is not documented"
            );
        }
        for long in ["config", "mount"] {
            assert!(doc.contains(&format!("`--{long}")), "--{long} undocumented");
        }
    }

    fn known(key: &str) -> bool {
        OWN_KEYS.contains(&key) || option(key).is_some()
    }

    #[test]
    fn the_documented_example_is_valid() {
        let doc = include_str!("../docs/CONFIGURATION.md");
        let example = doc
            .split("```toml\n")
            .nth(1)
            .and_then(|s| s.split("```").next())
            .expect("a ```toml example in docs/CONFIGURATION.md");
        let file = ConfigFile::parse(example)
            .map_err(|p| render(Path::new("example"), example, &p))
            .unwrap();
        assert!(file.mount_names().count() >= 1);
    }
}
