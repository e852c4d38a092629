//! Man pages and shell completions, generated from the clap definition so that they say
//! what the binary accepts (`hoardfs generate man DIR`, `hoardfs generate completions SHELL`).

use clap::{Arg, ArgAction, Command, CommandFactory};

use crate::cli::{Cli, Generate};

pub fn generate(what: Generate) -> anyhow::Result<()> {
    let cmd = Cli::command();
    match what {
        Generate::Man { dir } => {
            if !dir.is_dir() {
                anyhow::bail!(
                    "{}: the directory does not exist (make it first: install -d {0})",
                    dir.display()
                );
            }
            clap_mangen::generate_to(with_synopses(cmd, "hoardfs"), &dir)?;
        }
        Generate::Completions { shell } => {
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "hoardfs",
                &mut std::io::stdout(),
            );
            drop(cmd);
        }
    }
    Ok(())
}

/// clap_mangen's SYNOPSIS names options without their values (`[--cache-dir]`): give each
/// command a usage line that has them (`[--cache-dir DIR]`), for the man pages only.
fn with_synopses(cmd: Command, path: &str) -> Command {
    let mut line = vec![path.to_string()];
    for a in cmd
        .get_arguments()
        .filter(|a| !a.is_hide_set() && !a.is_positional())
    {
        line.push(format!("[{}]", option_synopsis(a)));
    }
    // Positionals bare: SOURCE and MOUNTPOINT are optional to clap only because a config
    // file's section may give them.
    for a in cmd.get_positionals().filter(|a| !a.is_hide_set()) {
        line.push(value_names(a));
    }
    let mut usage = line.join(" ");
    if cmd.has_subcommands() {
        usage.push_str(&format!("\n{path} COMMAND [ARGS]"));
    }
    let names: Vec<String> = cmd
        .get_subcommands()
        .map(|c| c.get_name().to_string())
        .collect();
    let mut cmd = cmd.override_usage(usage);
    for name in names {
        let sub_path = format!("{path} {name}");
        cmd = cmd.mut_subcommand(&name, |c| with_synopses(c, &sub_path));
    }
    cmd
}

/// `-o OPTIONS`, `--cache-dir DIR`, `-r|--read-only`.
fn option_synopsis(a: &Arg) -> String {
    let flag = match (a.get_short(), a.get_long()) {
        (Some(s), Some(l)) => format!("-{s}|--{l}"),
        (Some(s), None) => format!("-{s}"),
        (None, Some(l)) => format!("--{l}"),
        (None, None) => a.get_id().to_string(),
    };
    if a.get_action().takes_values() && !matches!(a.get_action(), ArgAction::Count) {
        format!("{flag} {}", value_names(a))
    } else {
        flag
    }
}

/// The value's name as `--help` shows it: the declared one, else the id in capitals.
fn value_names(a: &Arg) -> String {
    match a.get_value_names() {
        Some(v) => v.iter().map(|n| n.as_str()).collect::<Vec<_>>().join(" "),
        None => a.get_id().as_str().to_uppercase(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn man_pages_cover_the_command_and_its_subcommands() {
        let dir = tempfile::tempdir().unwrap();
        generate(Generate::Man {
            dir: dir.path().to_path_buf(),
        })
        .unwrap();
        let main = std::fs::read_to_string(dir.path().join("hoardfs.1")).unwrap();
        assert!(main.starts_with(".ie"), "roff: {}", &main[..40]);
        assert!(main.contains("cache\\-size"), "options are in the page");
        for sub in ["stats", "clean", "pin", "set", "config"] {
            assert!(
                dir.path().join(format!("hoardfs-{sub}.1")).exists(),
                "{sub}"
            );
        }
        assert!(dir.path().join("hoardfs-generate.1").exists());
    }
}
