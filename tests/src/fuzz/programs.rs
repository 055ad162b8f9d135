//! The packet programs the fuzzer runs every frame through, which side of
//! the tuple each rewrites, and their verdicts.

use dataplane_agent::dataplane::Datapath;
use dataplane_common::names;

use crate::testrun;

/// Which side of the tuple a program rewrites.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Side {
    Ingress,
    Egress,
}

#[derive(Clone, Copy, Debug)]
pub(super) struct Program {
    pub(super) name: &'static str,
    pub(super) side: Side,
    pub(super) xdp: bool,
}

pub(super) const PROGRAMS: [Program; 4] = [
    Program {
        name: names::XDP_INGRESS,
        side: Side::Ingress,
        xdp: true,
    },
    Program {
        name: names::TC_INGRESS,
        side: Side::Ingress,
        xdp: false,
    },
    Program {
        name: names::TC_POD_INGRESS,
        side: Side::Ingress,
        xdp: false,
    },
    Program {
        name: names::TC_EGRESS,
        side: Side::Egress,
        xdp: false,
    },
];

pub(super) fn drop_of(p: Program) -> u32 {
    verdicts(p).1
}

/// Verdict numbers of a program type: (pass, drop, sent back).
pub(super) fn verdicts(p: Program) -> (u32, u32, u32) {
    if p.xdp { (2, 1, 3) } else { (0, 2, 7) }
}

/// (verdict, output), or the kernel's refusal to run the frame at all.
pub(super) fn run_one(dp: &Datapath, p: Program, input: &[u8]) -> Result<(u32, Vec<u8>), String> {
    let r = if p.xdp {
        testrun::try_run(dp.xdp_program(p.name).expect("program"), input, 1)
    } else {
        testrun::try_run(dp.tc(p.name).expect("program"), input, 1)
    };
    r.map(|(v, out, _)| (v, out)).map_err(|e| e.to_string())
}
