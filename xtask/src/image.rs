//! `cargo xtask image`: the agent's container image from deploy/Containerfile
//! with podman, from a static (musl) build of the agent made here
//! (`AGENT=prebuilt`: no registry is needed, the base is `scratch`).
use std::process::Command;

use anyhow::Context as _;

use crate::cmd::{self, output};

pub const MUSL_TARGET: &str = "x86_64-unknown-linux-musl";

/// Builds the static agent; its path relative to the workspace root.
pub fn build_static_agent() -> anyhow::Result<String> {
    cmd::run(
        cmd::cargo()
            .args(["build", "--release", "--locked", "--package", "dataplane-agent"])
            .args(["--target", MUSL_TARGET])
            // ring's C parts, for musl.
            .env("CC_x86_64_unknown_linux_musl", "musl-gcc"),
    )?;
    Ok(format!("target/{MUSL_TARGET}/release/dataplane-agent"))
}

pub fn run(tag: &str) -> anyhow::Result<()> {
    let binary = build_static_agent()?;
    cmd::run(
        Command::new("podman")
            .args(["build", "--layers=false", "--build-arg", "AGENT=prebuilt"])
            .args(["--file", "deploy/Containerfile", "--tag", tag, "."]),
    )
    .context("podman build (podman comes from `cargo xtask setup`)")?;
    let size = output(Command::new("podman").args(["image", "inspect", "--format", "{{.Size}}", tag]))
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(0);
    eprintln!(
        "image {tag}: {:.1} MB ({binary}, FROM scratch)",
        size as f64 / 1e6
    );
    println!("{tag}");
    Ok(())
}
