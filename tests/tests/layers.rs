//! The layout the crate READMEs and docs/architecture.md describe, checked
//! from the sources: neither the agent's nor the kernel's modules import each
//! other in a circle, and no import in the agent runs up a floor.
//!
//! An import is any `crate::` or `super::` path outside the test modules,
//! resolved to the deepest module it names. A module and its own submodules
//! may use each other (a `mod.rs` declares what its files use).

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
};

/// The agent's floors, top first: a module imports only from its own floor
/// or below (docs/architecture.md, "Crates and floors").
const AGENT_FLOORS: &[&[&str]] = &[
    &["cli"],
    &["agent", "preflight"],
    &["lb"],
    &["k8s"],
    &["dataplane"],
    &["os", "state", "prom"],
    &["net"],
];

type Graph = BTreeMap<String, BTreeSet<String>>;

fn src(krate: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(krate)
        .join("src")
}

/// Every `.rs` file under `dir`, as (module path, text).
fn modules(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let rel = path.strip_prefix(root).unwrap().with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
            if parts.last().is_some_and(|p| p == "mod") {
                parts.pop();
            }
            if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
                parts.clear();
            }
            // Binaries beside the library (src/bin/...) are not its modules.
            if parts.first().is_some_and(|p| p == "bin") {
                continue;
            }
            out.insert(parts.join("::"), fs::read_to_string(&path).unwrap());
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

/// The text without comments and without the test module (`#[cfg(test)]`
/// followed by a `mod`, to the end of the file, where this code base keeps
/// it).
fn code(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        let t = line.trim_start();
        if t == "#[cfg(test)]" && lines.peek().is_some_and(|n| n.contains("mod ")) {
            break;
        }
        if t.starts_with("//") {
            continue;
        }
        out.push_str(line.split(" // ").next().unwrap());
        out.push('\n');
    }
    out
}

/// The paths a `crate::`/`super::` path expression at the start of `s`
/// names, `{a, b::{c, d}}` groups expanded (`self` names the group's
/// prefix).
fn expand(s: &str) -> Vec<Vec<String>> {
    fn ident(s: &[u8], i: &mut usize) -> String {
        let start = *i;
        while *i < s.len() && (s[*i].is_ascii_alphanumeric() || s[*i] == b'_') {
            *i += 1;
        }
        String::from_utf8_lossy(&s[start..*i]).into_owned()
    }
    fn skip_ws(s: &[u8], i: &mut usize) {
        while *i < s.len() && s[*i].is_ascii_whitespace() {
            *i += 1;
        }
    }
    fn path(s: &[u8], i: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let mut p = prefix;
        loop {
            skip_ws(s, i);
            if *i < s.len() && s[*i] == b'{' {
                *i += 1;
                loop {
                    skip_ws(s, i);
                    if *i >= s.len() || s[*i] == b'}' {
                        *i += 1;
                        return;
                    }
                    path(s, i, p.clone(), out);
                    skip_ws(s, i);
                    if *i < s.len() && s[*i] == b',' {
                        *i += 1;
                    }
                }
            }
            let id = ident(s, i);
            if id.is_empty() {
                out.push(p);
                return;
            }
            if id != "self" {
                p.push(id);
            }
            if s[*i..].starts_with(b"::") {
                *i += 2;
            } else {
                // `as name`, generics, a call: the path ends here.
                while *i < s.len() && !matches!(s[*i], b',' | b'}' | b';' | b'\n') {
                    if s[*i] == b'{' || s[*i] == b'(' || s[*i] == b'<' {
                        break;
                    }
                    *i += 1;
                }
                out.push(p);
                return;
            }
        }
    }
    let mut out = Vec::new();
    path(s.as_bytes(), &mut 0, Vec::new(), &mut out);
    out
}

/// The import graph between the modules of a crate's `src`.
fn graph(root: &Path) -> Graph {
    let mods = modules(root);
    let mut g = Graph::new();
    for (name, text) in &mods {
        let own: Vec<String> = if name.is_empty() {
            Vec::new()
        } else {
            name.split("::").map(String::from).collect()
        };
        let mut edges = BTreeSet::new();
        let text = code(text);
        for (kw, base) in [
            ("crate::", Vec::new()),
            ("super::", own[..own.len().saturating_sub(1)].to_vec()),
        ] {
            for (at, _) in text.match_indices(kw) {
                // `dataplane_common::` etc. end in the same letters.
                if text[..at].ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
                    continue;
                }
                for rest in expand(&text[at + kw.len()..]) {
                    let full: Vec<String> = base.iter().cloned().chain(rest).collect();
                    let target = (1..=full.len())
                        .rev()
                        .map(|n| full[..n].join("::"))
                        .find(|m| mods.contains_key(m));
                    let Some(target) = target else { continue };
                    let related =
                        |a: &str, b: &str| a == b || a.starts_with(&format!("{b}::")) || b.is_empty();
                    if !related(name, &target) && !related(&target, name) {
                        edges.insert(target);
                    }
                }
            }
        }
        g.insert(name.clone(), edges);
    }
    g
}

/// The groups of modules that import each other in a circle (strongly
/// connected components of more than one module).
fn circles(g: &Graph) -> Vec<Vec<String>> {
    // Reachability by search from every module: the graphs are small.
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(m) = todo.pop() {
            for n in g.get(&m).into_iter().flatten() {
                if seen.insert(n.clone()) {
                    todo.push(n.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = g.keys().map(|m| (m, reach(m))).collect();
    let mut done = BTreeSet::new();
    let mut out = Vec::new();
    for m in g.keys() {
        if done.contains(m) {
            continue;
        }
        let group: Vec<String> = g
            .keys()
            .filter(|n| *n == m || (reaches[m].contains(*n) && reaches[*n].contains(m)))
            .cloned()
            .collect();
        done.extend(group.iter().cloned());
        if group.len() > 1 {
            out.push(group);
        }
    }
    out
}

#[test]
fn the_kernel_modules_import_each_other_without_a_circle() {
    let g = graph(&src("dataplane-ebpf"));
    // The parser sees the modules it must: an empty graph would pass.
    assert!(
        g["path"].contains("nat") && g["nat"].contains("ctx") && g["parse"].contains("hdr"),
        "{g:#?}"
    );
    assert_eq!(circles(&g), Vec::<Vec<String>>::new(), "{g:#?}");
}

#[test]
fn the_agent_modules_import_each_other_without_a_circle() {
    let g = graph(&src("dataplane-agent"));
    assert!(g["agent::run"].contains("agent::control") && g["preflight"].contains("os::pod_discovery"));
    assert_eq!(circles(&g), Vec::<Vec<String>>::new(), "{g:#?}");
}

#[test]
fn no_agent_import_runs_up_a_floor() {
    let g = graph(&src("dataplane-agent"));
    let floor = |m: &str| {
        let top = m.split("::").next().unwrap();
        AGENT_FLOORS.iter().position(|f| f.contains(&top))
    };
    let mut up = Vec::new();
    for (from, tos) in &g {
        if from.is_empty() {
            continue;
        }
        let Some(f) = floor(from) else {
            panic!("module `{from}` is on no floor: place it in AGENT_FLOORS (and docs/architecture.md)");
        };
        for to in tos {
            if floor(to).is_some_and(|t| t < f) {
                up.push(format!("{from} -> {to}"));
            }
        }
    }
    assert_eq!(up, Vec::<String>::new(), "imports that run up a floor");
}

#[test]
fn the_import_reader_finds_grouped_and_nested_paths() {
    let paths = |s| expand(s).into_iter().map(|p| p.join("::")).collect::<Vec<_>>();
    assert_eq!(
        paths("a::{b, c::{d, self}, e as f};"),
        ["a::b", "a::c::d", "a::c", "a::e"]
    );
    assert_eq!(paths("x::y::z(1)"), ["x::y::z"]);
    assert_eq!(paths("x::Y<T>::new()"), ["x::Y"]);
    let g: Graph = [("a", &["b"][..]), ("b", &["c"]), ("c", &["a"]), ("d", &["a"])]
        .into_iter()
        .map(|(m, e)| (m.to_owned(), e.iter().map(|s| s.to_string()).collect()))
        .collect();
    assert_eq!(circles(&g), [["a", "b", "c"]]);
}
