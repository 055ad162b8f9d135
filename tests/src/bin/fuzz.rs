//! `cargo xtask fuzz --packets N [--seed S]`: random and mutated frames
//! through every packet program, checked against the model in
//! `dataplane_tests::fuzz`. Exits non-zero on any violation.

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .map(|v| v.parse::<u64>().unwrap_or_else(|e| panic!("{flag} {v}: {e}")))
    };
    let packets = value("--packets").unwrap_or(1_000_000);
    let seed = value("--seed").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
    });
    dataplane_tests::require_privileges();
    let started = std::time::Instant::now();
    let r = dataplane_tests::fuzz::run(packets, seed);
    println!(
        "fuzz: seed {seed}: {} frames, {} program runs in {:.1} s: {} untouched, {} translated, {} dropped, {} rejected, {} refused by the kernel; {} violations",
        r.packets,
        r.runs,
        started.elapsed().as_secs_f64(),
        r.untouched,
        r.translated,
        r.dropped,
        r.rejected,
        r.refused,
        r.violation_count
    );
    println!(
        "fuzz: IPv6: {} frames: {} untouched, {} translated, {} dropped, {} rejected; ICMP errors translated: {} ({} ICMPv6); ingress runs required to translate: {} ({} IPv6), of which dropped as tuple clashes: {}",
        r.packets6,
        r.untouched6,
        r.translated6,
        r.dropped6,
        r.rejected6,
        r.icmp_translated,
        r.icmp_translated6,
        r.must_translate,
        r.must_translate6,
        r.clashes
    );
    for (program, why, frame) in &r.violations {
        println!("  {program}: {why}\n    frame {frame}");
    }
    if !r.violations.is_empty() {
        std::process::exit(1);
    }
}
