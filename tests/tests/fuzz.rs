//! A short run of the packet fuzzer (`cargo xtask fuzz` runs long ones):
//! mutated frames of both families through every packet program (Maglev,
//! DSR's encapsulated packets among them), 0 mistranslations, no missed
//! translation and every translated frame's checksums exactly as valid as
//! its input's.

#[test]
fn fuzzed_frames_are_never_mistranslated() {
    // A fixed seed (reproducible failures) and one from the clock (new
    // frames every run); both printed on failure.
    let clock = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(7, |d| d.as_nanos() as u64);
    for seed in [1, clock] {
        let r = dataplane_tests::fuzz::run(50_000, seed);
        assert!(
            r.violations.is_empty(),
            "seed {seed}: {} violations (rerun: cargo xtask fuzz --packets 50000 --seed {seed}), the first ones:\n{}",
            r.violation_count,
            r.violations
                .iter()
                .map(|(p, why, f)| format!("{p}: {why}\n  frame {f}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        // The run exercised every outcome, or it proves little; IPv6 too,
        // so that its part cannot silently stop working.
        assert!(
            r.translated > 1_000 && r.untouched > 1_000 && r.dropped > 0 && r.rejected > 0,
            "seed {seed}: {r:?}"
        );
        // Clash drops (a client port reused through another frontend of a
        // live flow's backend) are let through the model: they must stay
        // the exception among frames that must translate.
        assert!(r.clashes * 10 < r.must_translate, "seed {seed}: {r:?}");
        assert!(
            r.translated6 > 500 && r.untouched6 > 500 && r.dropped6 > 0 && r.rejected6 > 0,
            "seed {seed}: IPv6: {r:?}"
        );
        assert!(
            r.must_translate > 1_000 && r.must_translate6 > 500,
            "seed {seed}: too few frames the model requires translated: {r:?}"
        );
        assert!(
            r.icmp_translated6 > 100 && r.icmp_translated - r.icmp_translated6 > 100,
            "seed {seed}: too few ICMP errors translated: {r:?}"
        );
        // DSR's backend-node half ran on mutated encapsulated packets.
        assert!(
            r.decapsulated > 100,
            "seed {seed}: too few packets taken apart: {r:?}"
        );
    }
}
