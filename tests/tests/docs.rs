//! Docs as code: the crate READMEs name every module of their crate and no
//! module that is gone, and every map name the docs, READMEs and module
//! docs give is a map of the object as built (or a former name, said as
//! such), whose maps are the ones the agent pins.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use dataplane_agent::dataplane::EBPF_OBJECT;
use dataplane_common::names;
use object::{Object, ObjectSection, ObjectSymbol};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_owned()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The modules `mod` declares in `file` (`mod x;` or `pub mod x;`, not
/// inline test modules).
fn declared(file: &Path) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let rest = l.strip_prefix("pub mod ").or_else(|| l.strip_prefix("mod "))?;
            rest.strip_suffix(';').map(str::to_owned)
        })
        .collect()
}

/// The `word`s written `` `word` `` in `text` that look like module names
/// (lowercase, digits, underscores; a directory with its slash).
fn backticked(text: &str) -> BTreeSet<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(|w| w.trim_end_matches('/'))
        .filter(|w| {
            !w.is_empty()
                && w.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_ebpf_readme_names_every_module() {
    let readme = read("dataplane-ebpf/README.md");
    let named = backticked(&readme);
    let modules = declared(&root().join("dataplane-ebpf/src/main.rs"));
    let missing: Vec<&String> = modules.iter().filter(|m| !named.contains(*m)).collect();
    assert!(
        missing.is_empty(),
        "dataplane-ebpf/README.md does not name {missing:?}"
    );
    // Each list item names its modules as `name`: ...
    let listed: BTreeSet<String> = readme
        .split('`')
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[1].starts_with(':'))
        .map(|w| w[0].to_owned())
        .collect();
    let gone: Vec<&String> = listed.iter().filter(|m| !modules.contains(m)).collect();
    assert!(
        gone.is_empty(),
        "dataplane-ebpf/README.md lists modules that do not exist: {gone:?}"
    );
}

#[test]
fn the_agent_readme_names_every_module() {
    let readme = read("dataplane-agent/README.md");
    let named = backticked(&readme);
    let src = root().join("dataplane-agent/src");
    let mut all = BTreeSet::new();
    let mut missing = Vec::new();
    for top in declared(&src.join("lib.rs")) {
        all.insert(top.clone());
        if !named.contains(&top) {
            missing.push(top.clone());
        }
        let dir = src.join(&top);
        if dir.is_dir() {
            for sub in declared(&dir.join("mod.rs")) {
                all.insert(sub.clone());
                if !named.contains(&sub) {
                    missing.push(format!("{top}::{sub}"));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "dataplane-agent/README.md does not name {missing:?}"
    );
    let gone: Vec<&String> = named.iter().filter(|w| !all.contains(*w)).collect();
    assert!(
        gone.is_empty(),
        "dataplane-agent/README.md names modules that do not exist: {gone:?}"
    );
}

#[test]
fn the_bench_readme_names_every_module() {
    let readme = read("bench/README.md");
    let named = backticked(&readme);
    let src = root().join("bench/src");
    let mut all = BTreeSet::new();
    let mut missing = Vec::new();
    for top in declared(&src.join("main.rs")) {
        let dir = src.join(&top);
        let subs = if dir.is_dir() {
            declared(&dir.join("mod.rs"))
        } else {
            Vec::new()
        };
        for m in std::iter::once(top.clone()).chain(subs) {
            if !named.contains(&m) {
                missing.push(m.clone());
            }
            all.insert(m);
        }
    }
    assert!(missing.is_empty(), "bench/README.md does not name {missing:?}");
    let gone: Vec<&String> = named.iter().filter(|w| !all.contains(*w)).collect();
    assert!(
        gone.is_empty(),
        "bench/README.md names modules that do not exist: {gone:?}"
    );
}

/// Map names as the docs write them: `DP_…_V1`, `LB4_…_V1`, `CT6_V1`, ….
fn map_names(text: &str) -> BTreeSet<String> {
    text.split(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
        .filter(|w| {
            [
                "DP_", "LB_", "LB4_", "LB6_", "CT4", "CT6", "SOCK4_", "SOCK6_", "SNAT4_", "SNAT6_",
            ]
            .iter()
            .any(|p| w.starts_with(p))
                && w.rsplit_once("_V")
                    .is_some_and(|(_, v)| !v.is_empty() && v.chars().all(|c| c.is_ascii_digit()))
        })
        .map(str::to_owned)
        .collect()
}

/// Every file under `dir` whose name ends in `ext`.
fn files(dir: &Path, ext: &str, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, ext, out);
        } else if path.to_string_lossy().ends_with(ext) {
            out.push(path);
        }
    }
}

#[test]
fn every_map_the_docs_name_is_in_the_object() {
    let file = object::File::parse(EBPF_OBJECT).expect("parse the eBPF object");
    let maps_section = file
        .section_by_name("maps")
        .expect("a maps section (legacy map definitions)")
        .index();
    let in_object: BTreeSet<String> = file
        .symbols()
        .filter(|s| s.section_index() == Some(maps_section))
        .filter_map(|s| s.name().ok().map(str::to_owned))
        .collect();
    // The agent pins every map of the object but per-CPU scratch space
    // (meaningless across runs) and the benchmark's.
    let pinned: BTreeSet<String> = names::ALL_MAPS.iter().map(|s| s.to_string()).collect();
    let unpinned: Vec<&String> = in_object.difference(&pinned).collect();
    assert!(
        unpinned
            .iter()
            .all(|m| m.contains("SCRATCH") || m.starts_with("DP_CT_PEEK") || *m == names::BENCH),
        "maps of the object the agent does not pin: {unpinned:?}"
    );
    let absent: Vec<&String> = pinned.difference(&in_object).collect();
    assert!(
        absent.is_empty(),
        "names::ALL_MAPS lists maps the object lacks: {absent:?}"
    );

    // Former names, kept in the docs of the upgrades that replace them.
    const FORMER: &[&str] = &["DP_CONFIG_V3"];
    let mut texts = Vec::new();
    files(&root().join("docs"), ".md", &mut texts);
    for dir in [
        "dataplane-agent/src",
        "dataplane-ebpf/src",
        "dataplane-common/src",
    ] {
        files(&root().join(dir), ".rs", &mut texts);
    }
    texts.extend(
        [
            "README.md",
            "dataplane-agent/README.md",
            "dataplane-ebpf/README.md",
        ]
        .map(|f| root().join(f)),
    );
    let mut wrong = Vec::new();
    for path in texts {
        let text = std::fs::read_to_string(&path).unwrap();
        for name in map_names(&text) {
            if !in_object.contains(&name) && !FORMER.contains(&name.as_str()) {
                wrong.push(format!(
                    "{}: {name}",
                    path.strip_prefix(root()).unwrap().display()
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "map names that are no map of the object: {wrong:?}"
    );
    // And every pinned map is described in docs/datapath.md.
    let datapath = map_names(&read("docs/datapath.md"));
    let undocumented: Vec<&String> = pinned.difference(&datapath).collect();
    assert!(
        undocumented.is_empty(),
        "maps docs/datapath.md does not describe: {undocumented:?}"
    );
}
