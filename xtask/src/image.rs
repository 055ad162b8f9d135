//! `cargo xtask image`: the agent's container image from deploy/Containerfile
//! with podman, from a static (musl) build of the agent made here
//! (`AGENT=prebuilt`: no registry is needed, the base is `scratch`), and the
//! BGP sidecar's image (deploy/Containerfile.bird): Debian's BIRD 2 with the
//! shared libraries it links, on `scratch` too.
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

/// The sidecar's tag beside the agent's: `REPO-bird:VERSION`.
pub fn bird_tag(tag: &str) -> String {
    match tag.rsplit_once(':') {
        Some((repo, version)) if !version.contains('/') => format!("{repo}-bird:{version}"),
        _ => format!("{tag}-bird"),
    }
}

/// Where the BIRD image's files are gathered (kept in the build context by
/// .containerignore).
const BIRD_ROOT: &str = "target/bird-image";
const BIRD_BINARIES: [&str; 2] = ["/usr/sbin/bird", "/usr/sbin/birdc"];

/// Copies BIRD's binaries and every shared library `ldd` names into
/// [`BIRD_ROOT`], at their paths.
fn stage_bird() -> anyhow::Result<()> {
    let root = std::path::Path::new(BIRD_ROOT);
    let _ = std::fs::remove_dir_all(root);
    let mut files: Vec<String> = BIRD_BINARIES.map(String::from).to_vec();
    for bin in BIRD_BINARIES {
        let ldd = output(Command::new("ldd").arg(bin))
            .with_context(|| format!("ldd {bin} (is bird2 installed? `cargo xtask setup`)"))?;
        for line in ldd.lines() {
            // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)`, or the
            // loader's `/lib64/ld-linux-x86-64.so.2 (0x...)`.
            let path = line
                .split("=>")
                .last()
                .unwrap_or("")
                .split_whitespace()
                .next()
                .unwrap_or("");
            if path.starts_with('/') && !files.iter().any(|f| f == path) {
                files.push(path.to_owned());
            }
        }
    }
    for f in &files {
        let dest = root.join(f.trim_start_matches('/'));
        std::fs::create_dir_all(dest.parent().expect("a file's directory"))?;
        // The file itself, not a symbolic link to it.
        std::fs::copy(f, &dest).with_context(|| format!("copying {f}"))?;
    }
    // BIRD's working directory for its socket and configuration (a volume
    // in the DaemonSet).
    std::fs::create_dir_all(root.join("run/dataplane/bird"))?;
    Ok(())
}

/// Builds the BGP sidecar's image.
pub fn build_bird(tag: &str) -> anyhow::Result<()> {
    stage_bird()?;
    cmd::run(Command::new("podman").args(["build", "--layers=false"]).args([
        "--file",
        "deploy/Containerfile.bird",
        "--tag",
        tag,
        ".",
    ]))
    .context("podman build of the BIRD image")?;
    eprintln!("image {tag}: BIRD 2 from Debian's bird2, FROM scratch");
    Ok(())
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
    let bird = bird_tag(tag);
    build_bird(&bird)?;
    println!("{tag}");
    println!("{bird}");
    Ok(())
}
