//! `cargo xtask demo`: builds the sandbox binaries (the demo and the agent
//! CLI it runs on each node) and runs the demo.
use std::process::Command;

use crate::cmd;

pub fn run(args: &[String]) -> anyhow::Result<()> {
    cmd::run(cmd::cargo().args(["build", "--quiet", "--package", "dataplane-tests", "--bins"]))?;
    let bin = cmd::workspace_root().join("target/debug/demo");
    cmd::run(Command::new(bin).args(args))
}
