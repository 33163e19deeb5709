//! Imports point down: every module of `src/` is in one layer of the list
//! in ARCHITECTURE.md ("## Layers"), and its code names only modules of
//! the layers below its own. Comments are not code (a doc link may point
//! anywhere); tests inside `src/` are code.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The layers, top first, as ARCHITECTURE.md lists them: the indented lines
/// of its "## Layers" section, each a layer of modules separated by spaces.
fn layers(architecture: &str) -> Vec<Vec<String>> {
    let section = architecture
        .split("\n## ")
        .find(|s| s.starts_with("Layers"))
        .expect("ARCHITECTURE.md has a \"## Layers\" section");
    section
        .lines()
        .filter(|l| l.starts_with("    ") && !l.trim().is_empty())
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// Every `.rs` file under `dir`.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("readable source folder") {
        let path = entry.expect("readable entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file of `src/` belongs to (`main.rs` is the
/// command, `cli`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let first = rel.components().next().expect("a file").as_os_str();
    let name = first.to_str().expect("utf-8 path").trim_end_matches(".rs");
    match name {
        "main" => "cli".into(),
        n => n.into(),
    }
}

/// `text` without its comments (`//` to the end of the line, `/* */`),
/// string literals kept (a path in a string is no import, but nothing here
/// writes `crate::` in one).
fn code_of(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while !rest.is_empty() {
        if rest.starts_with("//") {
            rest = rest.find('\n').map_or("", |i| &rest[i..]);
        } else if rest.starts_with("/*") {
            rest = rest.find("*/").map_or("", |i| &rest[i + 2..]);
        } else {
            let c = rest.chars().next().expect("not empty");
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
    }
    out
}

/// The module path of a file of `src/` (`src/model/gpt2/kv.rs` is
/// `model::gpt2::kv`, a `mod.rs` its folder's).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).expect("under src");
    let mut path: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_str().expect("utf-8 path").to_string())
        .collect();
    let last = path.pop().expect("a file");
    if last != "mod.rs" {
        path.push(last.trim_end_matches(".rs").to_string());
    }
    path
}

/// The crate's modules `code` (of the module at `path`) names: the first
/// segment after each `crate::` (or `distgpt::`, from the command), every
/// item of a `crate::{a::x, b}` group, and the segment a chain of
/// `super::` reaches the crate's root with. `$crate::` (a macro's own
/// path) is not an import.
fn named_modules(code: &str, path: &[String]) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = Vec::new();
    for root in ["crate::", "distgpt::"] {
        for (i, _) in code.match_indices(root) {
            let before = code[..i].chars().next_back();
            if before.is_some_and(|c| c == '$' || c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            let after = code[i + root.len()..].trim_start();
            if let Some(group) = after.strip_prefix('{') {
                // the items at depth 1 of the group
                let mut depth = 1;
                let mut item_start = true;
                for (j, c) in group.char_indices() {
                    match c {
                        '{' => depth += 1,
                        '}' if depth == 1 => break,
                        '}' => depth -= 1,
                        ',' if depth == 1 => item_start = true,
                        c if item_start && depth == 1 && !c.is_whitespace() => {
                            found.push(ident(&group[j..]));
                            item_start = false;
                        }
                        _ => {}
                    }
                }
            } else {
                found.push(ident(after));
            }
        }
    }
    // super::super::x climbing to the root from a module `depth` deep
    for (i, _) in code.match_indices("super::") {
        if code[..i].ends_with("super::") {
            continue; // counted from the chain's first
        }
        let mut rest = &code[i..];
        let mut up = 0;
        while let Some(r) = rest.strip_prefix("super::") {
            (up, rest) = (up + 1, r.trim_start());
        }
        if up >= path.len() {
            found.push(ident(rest));
        }
    }
    found.retain(|m| !m.is_empty() && m.chars().next().is_some_and(|c| c.is_ascii_lowercase()));
    found
}

/// Each upward or sideways import, as "file: module (layer) names module (layer)".
fn violations(root: &Path) -> Vec<String> {
    let architecture =
        std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let layers = layers(&architecture);
    let mut level = BTreeMap::new();
    for (i, layer) in layers.iter().enumerate() {
        for m in layer {
            assert!(
                level.insert(m.clone(), i).is_none(),
                "{m} is in two layers of ARCHITECTURE.md"
            );
        }
    }
    let src = root.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut bad = Vec::new();
    for file in files {
        if file == src.join("lib.rs") {
            continue; // the root, which declares the modules
        }
        let shown = file
            .strip_prefix(root)
            .unwrap_or(&file)
            .display()
            .to_string();
        let module = module_of(&src, &file);
        let Some(&own) = level.get(&module) else {
            bad.push(format!(
                "{shown}: module {module} is in no layer of ARCHITECTURE.md"
            ));
            continue;
        };
        let code = code_of(&std::fs::read_to_string(&file).expect("readable source"));
        let mut named = named_modules(&code, &module_path(&src, &file));
        named.sort();
        named.dedup();
        for m in named {
            if m == module {
                continue;
            }
            match level.get(&m) {
                Some(&l) if l > own => {}
                Some(&l) => bad.push(format!(
                    "{shown}: {module} (layer {own}) names {m} (layer {l}), which is not below it"
                )),
                // a macro exported at the crate's root, or an item of lib.rs
                None => {}
            }
        }
    }
    bad
}

#[test]
fn every_import_points_down_the_layers_architecture_md_lists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let bad = violations(root);
    assert!(
        bad.is_empty(),
        "{} import(s) against the layers:\n{}",
        bad.len(),
        bad.join("\n")
    );
}

#[test]
fn the_check_reads_groups_and_skips_comments_and_macro_paths() {
    let code = code_of(
        "use crate::{backend::{Backend, Dst}, data::Batch};\n\
         // use crate::train::x;\n\
         /* crate::plan */ let e = $crate::errln!(); let p = crate::model::X; let q = distgpt::cli::y;\n\
         use super::super::train::Task; use super::unit::UnitModel;",
    );
    // in src/model/gpt2/kv.rs: two supers stay in model, three reach the root
    let path = ["model", "gpt2", "kv"].map(String::from);
    let mut named = named_modules(&code, &path);
    named.sort();
    assert_eq!(named, ["backend", "cli", "data", "model"]);
    let mut named = named_modules(&code, &path[..2]);
    named.sort();
    assert_eq!(named, ["backend", "cli", "data", "model", "train"]);
}
