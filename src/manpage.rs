//! Man pages and shell completions, generated from the clap definition so that they say
//! what the binary accepts (`hoardfs generate man DIR`, `hoardfs generate completions SHELL`).

use clap::CommandFactory;

use crate::cli::{Cli, Generate};

pub fn generate(what: Generate) -> anyhow::Result<()> {
    let cmd = Cli::command();
    match what {
        Generate::Man { dir } => {
            std::fs::create_dir_all(&dir)?;
            clap_mangen::generate_to(cmd, &dir)?;
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
        assert!(!dir.path().join("hoardfs-generate.1").exists(), "hidden");
    }
}
