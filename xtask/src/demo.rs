//! `cargo xtask demo`: builds and runs the sandbox demo (tests/src/bin/demo.rs).
use crate::cmd;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    cmd::run(
        cmd::cargo()
            .args([
                "run",
                "--quiet",
                "--release",
                "--package",
                "dataplane-tests",
                "--bin",
                "demo",
                "--",
            ])
            .args(args),
    )
}
