//! `cargo xtask bench`: runs the benchmark binary (the `dataplane-bench`
//! crate, bench/) in release mode; it writes docs/benchmarks.md and
//! docs/bench-results.json. The agent binary (the test crate's) is built
//! beside it: the control-plane section runs agents.
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
                "dataplane-bench",
                "--bin",
                "bench",
                "--",
            ])
            .args(args),
    )
}
