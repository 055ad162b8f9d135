//! `cargo xtask bench`: runs the benchmark binary (tests/src/bin/bench.rs) in
//! release mode; it writes docs/benchmarks.md and docs/bench-results.json.
//! The agent binary is built beside it: the control-plane section runs agents.
use crate::cmd;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    cmd::run(cmd::cargo().args([
        "build",
        "--release",
        "--package",
        "dataplane-tests",
        "--bin",
        "agent",
    ]))?;
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
