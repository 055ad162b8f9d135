use crate::dataplane::Datapath;
use anyhow::Context as _;
use dataplane_common::names;

pub fn run() -> anyhow::Result<()> {
    let datapath = Datapath::load().context("the datapath cannot be loaded on this machine")?;
    println!("ok: eBPF object loaded and verified");
    let programs = [
        names::XDP_INGRESS,
        names::TC_EGRESS,
        names::TC_POD_INGRESS,
        names::XDP_FLOOR,
    ];
    println!("  programs: {}", programs.join(", "));
    println!(
        "  counters: {} events per program (all zero: nothing attached)",
        datapath.maps().counters()?.len()
    );
    Ok(())
}
