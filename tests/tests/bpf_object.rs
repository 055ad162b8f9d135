//! The eBPF object as built: what its code calls. This toolchain lowers the
//! zeroing or copying of an aggregate to a call of `memset` / `memmove`,
//! linked in as a BPF subprogram, and on CPUs whose kernel returns through
//! a thunk (AMD's SRSO "safe RET", retbleed) every subprogram return is a
//! mispredicted branch: such a call in the lookup path cost a passed packet
//! a third of its time (docs/datapath.md, "BPF limits met"). Only the ICMP
//! reject builders, which run once per refused connection, may call one.

use std::collections::BTreeSet;

use dataplane_agent::dataplane::EBPF_OBJECT;
use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionKind, SymbolKind};

/// Functions allowed to call a memory builtin.
const ALLOWED: &[&str] = &["build_reject4", "build_reject6"];
const BUILTINS: &[&str] = &["memset", "memmove", "memcpy", "memcmp"];

/// (caller, builtin) for every call of a memory builtin in the object.
fn builtin_calls() -> BTreeSet<(String, String)> {
    let file = object::File::parse(EBPF_OBJECT).expect("parse the eBPF object");
    let mut calls = BTreeSet::new();
    for section in file.sections().filter(|s| s.kind() == SectionKind::Text) {
        // The functions of this section, by start address.
        let mut functions: Vec<(u64, u64, String)> = file
            .symbols()
            .filter(|s| s.section_index() == Some(section.index()) && s.kind() == SymbolKind::Text)
            .map(|s| (s.address(), s.size(), s.name().unwrap_or("?").to_owned()))
            .collect();
        functions.sort();
        for (offset, reloc) in section.relocations() {
            let RelocationTarget::Symbol(index) = reloc.target() else {
                continue;
            };
            let target = file.symbol_by_index(index).expect("relocation symbol");
            let name = target.name().unwrap_or("");
            if !BUILTINS.contains(&name) {
                continue;
            }
            let caller = functions
                .iter()
                .find(|(start, size, _)| (*start..start + size).contains(&offset))
                .map(|(_, _, f)| f.clone())
                .unwrap_or_else(|| format!("{}+{offset:#x}", section.name().unwrap_or("?")));
            calls.insert((caller, name.to_owned()));
        }
    }
    calls
}

#[test]
fn packet_paths_call_no_memory_builtin() {
    let calls = builtin_calls();
    let offending: Vec<_> = calls
        .iter()
        .filter(|(caller, _)| !ALLOWED.iter().any(|a| caller.contains(a)))
        .collect();
    assert!(
        offending.is_empty(),
        "functions that call a memory builtin (a subprogram each call; see this file's header): {offending:#?}"
    );
}

/// The check above sees calls at all: the reject builders do copy their
/// frame with one (it would pass vacuously if relocations were not read).
#[test]
fn the_reject_builders_call_one() {
    let calls = builtin_calls();
    assert!(
        calls.iter().any(|(caller, _)| caller.contains("build_reject")),
        "no builtin call found at all: {calls:?}"
    );
}
