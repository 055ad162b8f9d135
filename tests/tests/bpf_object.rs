//! The eBPF object as built: what its code calls. This toolchain lowers the
//! zeroing or copying of an aggregate to a call of `memset` / `memmove`,
//! linked in as a BPF subprogram, and on CPUs whose kernel returns through
//! a thunk (AMD's SRSO "safe RET", retbleed) every subprogram return is a
//! mispredicted branch: such a call in the lookup path cost a passed packet
//! a third of its time (docs/datapath.md, "BPF limits met"). Only the ICMP
//! reject builders, which run once per refused connection, and the
//! forwarding benchmark's frame generator (never attached; it writes a
//! whole frame template each run) may call one.

use std::collections::BTreeSet;

use dataplane_agent::dataplane::EBPF_OBJECT;
use object::{Object, ObjectSection, ObjectSymbol, RelocationTarget, SectionKind, SymbolKind};

/// Functions allowed to call a memory builtin.
const ALLOWED: &[&str] = &["build_reject4", "build_reject6", "xdp_bench_gen"];
/// What LLVM may lower zeroing, copies and compares to (`bcmp`: a
/// `memcmp` whose result is only compared with zero).
const BUILTINS: &[&str] = &["memset", "memmove", "memcpy", "memcmp", "bcmp"];

fn object() -> object::File<'static> {
    object::File::parse(EBPF_OBJECT).expect("parse the eBPF object")
}

/// (function, symbol) for every relocation in the object's code that names
/// a symbol: calls of global functions, references to maps.
fn references() -> BTreeSet<(String, String)> {
    let file = object();
    let mut refs = BTreeSet::new();
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
            let caller = functions
                .iter()
                .find(|(start, size, _)| (*start..start + size).contains(&offset))
                .map(|(_, _, f)| f.clone())
                .unwrap_or_else(|| format!("{}+{offset:#x}", section.name().unwrap_or("?")));
            refs.insert((caller, target.name().unwrap_or("").to_owned()));
        }
    }
    refs
}

#[test]
fn packet_paths_call_no_memory_builtin() {
    let offending: Vec<_> = references()
        .into_iter()
        .filter(|(caller, target)| {
            BUILTINS.contains(&target.as_str()) && !ALLOWED.iter().any(|a| caller.contains(a))
        })
        .collect();
    assert!(
        offending.is_empty(),
        "functions that call a memory builtin (a subprogram each call; see this file's header): {offending:#?}"
    );
}

/// Calls of a local function carry no named relocation: were a builtin
/// linked in as a local symbol, the check above would see none of its calls.
#[test]
fn memory_builtins_are_global_symbols() {
    let local: Vec<_> = object()
        .symbols()
        .filter(|s| {
            s.kind() == SymbolKind::Text && BUILTINS.contains(&s.name().unwrap_or("")) && s.is_local()
        })
        .map(|s| s.name().unwrap_or("").to_owned())
        .collect();
    assert!(
        local.is_empty(),
        "memory builtins linked as local symbols, their calls unseen: {local:?}"
    );
}

/// The scan attributes relocations to the functions they are in (it would
/// pass vacuously otherwise): the lookup paths' references to the conntrack
/// maps are found under their names.
#[test]
fn references_are_attributed_to_their_functions() {
    let refs = references();
    for map in ["CT4_V2", "CT6_V1"] {
        assert!(
            refs.iter()
                .any(|(caller, target)| caller.contains("ingress_family") && target == map),
            "no reference from ingress_family to {map} found among {} references",
            refs.len()
        );
    }
}

/// The pre-filter runs inline in the entry points: a packet that is not
/// ours calls no subprogram. Not a function of its own, nor a closure
/// (LLVM once outlined one in the TC programs).
#[test]
fn the_prefilter_is_inline() {
    let outlined: Vec<_> = object()
        .symbols()
        .filter(|s| s.kind() == SymbolKind::Text)
        .filter_map(|s| s.name().ok())
        .filter(|n| n.contains("prefilter") || n.contains("fixed_addrs") || n.starts_with("_RNC"))
        .map(str::to_owned)
        .collect();
    assert!(
        outlined.is_empty(),
        "pre-filter code outlined into subprograms: {outlined:?}"
    );
}

/// The verifier walks every path of a program up to a million instructions
/// and then refuses it: each packet program stays well inside that budget
/// (a path blowup, such as a branch whose states cannot be pruned, shows
/// here before it fails a load on a kernel that counts a little more).
#[test]
fn packet_programs_verify_within_the_budget() {
    use dataplane_common::names;
    const BUDGET: u32 = 900_000;
    let dp = dataplane_tests::testrun::fixture_datapath(std::net::Ipv4Addr::new(198, 18, 0, 11), &[]);
    let mut over = Vec::new();
    for name in [
        names::XDP_INGRESS,
        names::TC_INGRESS,
        names::TC_POD_INGRESS,
        names::TC_EGRESS,
    ] {
        let info = if name == names::XDP_INGRESS {
            dp.xdp_program(name).unwrap().info()
        } else {
            dp.tc(name).unwrap().info()
        }
        .unwrap();
        let n = info.verified_instruction_count().expect("the kernel reports it");
        eprintln!("{name}: {n} instructions verified");
        if n > BUDGET {
            over.push((name, n));
        }
    }
    assert!(over.is_empty(), "over {BUDGET} verified instructions: {over:?}");
}
