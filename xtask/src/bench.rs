//! `cargo xtask bench`: runs the benchmark binary (tests/src/bin/bench.rs) in
//! release mode; it writes docs/benchmarks.md and docs/bench-results.json.
use crate::cmd;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    cmd::run(
        cmd::cargo()
            .args([
                "run",
                "--release",
                "--package",
                "dataplane-tests",
                "--bin",
                "bench",
                "--",
            ])
            .args(args),
    )
}
