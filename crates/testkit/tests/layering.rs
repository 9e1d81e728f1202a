//! The modules of each crate form layers: no module uses another that
//! (directly or through others) uses it back. Read from the sources: a
//! module `m` uses `n` when its files name `crate::n`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Each top-level module of the crate in `src` and the modules it names.
fn uses(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            if p.extension().is_none_or(|x| x != "rs") {
                continue;
            }
            let rel = p.strip_prefix(src).unwrap();
            let module = rel.components().next().unwrap().as_os_str().to_string_lossy().trim_end_matches(".rs").to_string();
            if module == "lib" || module == "main" || module == "bin" {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap();
            let named = text
                .split("crate::")
                .skip(1)
                .map(|rest| rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect::<String>());
            let entry = out.entry(module.clone()).or_default();
            entry.extend(named.filter(|n| !n.is_empty() && *n != module && n.chars().next().is_some_and(|c| c.is_ascii_lowercase())));
        }
    }
    out
}

/// A cycle through `start`, if any: the path of modules back to it.
fn cycle_from(graph: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![(start.to_string(), vec![start.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((m, path)) = stack.pop() {
        for n in graph.get(&m).into_iter().flatten() {
            if n == start {
                return Some([path.clone(), vec![n.clone()]].concat());
            }
            if graph.contains_key(n) && seen.insert(n.clone()) {
                stack.push((n.clone(), [path.clone(), vec![n.clone()]].concat()));
            }
        }
    }
    None
}

#[test]
fn no_crate_has_a_cycle_between_its_modules() {
    let crates = dmover_testkit::repo().join("crates");
    let mut cycles = Vec::new();
    for c in std::fs::read_dir(&crates).unwrap() {
        let src = c.unwrap().path().join("src");
        if !src.is_dir() {
            continue;
        }
        let graph = uses(&src);
        for m in graph.keys() {
            if let Some(path) = cycle_from(&graph, m) {
                cycles.push(format!("{}: {}", src.display(), path.join(" → ")));
            }
        }
    }
    assert!(cycles.is_empty(), "modules that use each other:\n{}", cycles.join("\n"));
}
