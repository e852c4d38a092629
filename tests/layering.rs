//! The layering of `src/` stays what docs/ARCHITECTURE.md says it is: every module sits on
//! one layer of the list in its "Layers" section, and imports only modules on layers below
//! its own. The imports are every `crate::NAME` path in a module's files (tests aside),
//! `use crate::{a, b::c}` groups included; a cycle is one kind of import that is not
//! downwards, so this also keeps the graph acyclic. Files stay under 800 lines (tests aside).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 800;

/// The layers from docs/ARCHITECTURE.md, bottom first: lines `N. `a` `b` — description`
/// in the "### Layers" section; a layer's modules are the backticked names before the dash.
fn documented_layers() -> BTreeMap<String, usize> {
    let doc =
        fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/ARCHITECTURE.md"))
            .expect("docs/ARCHITECTURE.md");
    let section = doc
        .split("### Layers")
        .nth(1)
        .expect("a \"### Layers\" section in docs/ARCHITECTURE.md");
    let section = section.split("\n#").next().unwrap();
    let mut layers = BTreeMap::new();
    for line in section.lines() {
        let Some((number, rest)) = line.split_once(". ") else {
            continue;
        };
        let Ok(layer) = number.trim().parse::<usize>() else {
            continue;
        };
        let names = rest.split(" — ").next().unwrap();
        for name in names.split('`').skip(1).step_by(2) {
            let before = layers.insert(name.to_string(), layer);
            assert!(
                before.is_none(),
                "docs/ARCHITECTURE.md places `{name}` on layers {} and {layer}",
                before.unwrap()
            );
        }
    }
    assert!(
        layers.len() > 10,
        "docs/ARCHITECTURE.md's layers list only {layers:?}: is the format `N. `a` `b` — text`?"
    );
    layers
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`fs/open.rs` → `fs`); `None` for the
/// crate roots.
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    match name {
        "lib" | "main" => None,
        // Built as `object_tree` without the `s3` feature (`#[path]` in lib.rs).
        "object_tree_off" => Some("object_tree".into()),
        _ => Some(name.into()),
    }
}

/// The part of a file before its first `#[cfg(test)]`: what the build of the crate uses.
fn without_tests(text: &str) -> &str {
    text.split("#[cfg(test)]").next().unwrap()
}

/// The top-level modules named by `crate::` paths in `code`.
fn imports(code: &str) -> BTreeSet<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = BTreeSet::new();
    for (i, _) in code.match_indices("crate::") {
        // `hoardfs_crate::` and the like are not this crate.
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[i + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            // The first name of each item at the group's top level.
            let (mut depth, mut item_start) = (0, true);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if item_start && !c.is_whitespace() => {
                        out.insert(ident(&group[j..]));
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident(rest));
        }
    }
    out.retain(|m| !m.is_empty());
    out
}

#[test]
fn every_import_goes_down_the_documented_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let layers = documented_layers();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut problems = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let text = fs::read_to_string(file).unwrap();
        let code = without_tests(&text);
        let lines = code.lines().count();
        if lines > MAX_LINES {
            problems.push(format!(
                "src/{} has {lines} lines (tests aside), over {MAX_LINES}",
                rel.display()
            ));
        }
        let Some(module) = module_of(rel) else {
            continue;
        };
        let Some(&layer) = layers.get(&module) else {
            problems.push(format!(
                "module `{module}` (src/{}) is on no layer of docs/ARCHITECTURE.md",
                rel.display()
            ));
            continue;
        };
        for target in imports(code) {
            if target == module {
                continue;
            }
            edges
                .entry(module.clone())
                .or_default()
                .insert(target.clone());
            match layers.get(&target) {
                None => problems.push(format!(
                    "src/{} uses `crate::{target}`, which is on no documented layer",
                    rel.display()
                )),
                Some(&t) if t >= layer => problems.push(format!(
                    "src/{} (`{module}`, layer {layer}) uses `crate::{target}` (layer {t}): \
                     imports go to lower layers only",
                    rel.display()
                )),
                Some(_) => {}
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the layering of src/ is not what docs/ARCHITECTURE.md says:\n  {}\n\nthe imports: {edges:#?}",
        problems.join("\n  ")
    );
}

#[test]
fn import_groups_are_read_item_by_item() {
    let code = "use crate::{cache::{Record, Store}, source,\n    stats::Stats};\n\
                let x = crate::fetch::go(); let y = my_crate::other;";
    let want: BTreeSet<String> = ["cache", "fetch", "source", "stats"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(imports(code), want);
}
