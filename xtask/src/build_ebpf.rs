//! `cargo xtask build-ebpf`: the kernel object is built by the agent's
//! build.rs (aya-build); this runs that very recipe and reports the object.
use std::{
    io::BufRead as _,
    path::PathBuf,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::cmd::{self, workspace_root};

/// Name of the object the agent embeds (the ebpf crate's bin target).
const OBJECT_NAME: &str = "dataplane";

pub fn build() -> anyhow::Result<PathBuf> {
    let mut command = cmd::cargo();
    command
        .args([
            "check",
            "--package",
            "dataplane-agent",
            "--message-format=json-render-diagnostics",
        ])
        .current_dir(workspace_root())
        .stdout(Stdio::piped());
    eprintln!("+ {}", cmd::describe(&command));
    let mut child = command.spawn().context("cannot start cargo")?;
    let mut out_dir = None;
    for line in std::io::BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(&line) else {
            continue;
        };
        if msg["reason"] == "build-script-executed"
            && msg["package_id"]
                .as_str()
                .is_some_and(|id| id.contains("dataplane-agent"))
        {
            out_dir = msg["out_dir"].as_str().map(PathBuf::from);
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("building the eBPF object failed (see the errors above)");
    }
    let object = out_dir
        .context("cargo did not report the agent's build script output directory")?
        .join(OBJECT_NAME);
    let bytes = std::fs::read(&object).with_context(|| format!("read {}", object.display()))?;
    if !bytes.windows(5).any(|w| w == b".BTF\0") {
        bail!(
            "{} has no .BTF section: was it linked with --btf?",
            object.display()
        );
    }
    eprintln!("build-ebpf: {} bytes, ELF with BTF", bytes.len());
    Ok(object)
}

/// `rustup run nightly cargo ...` for the eBPF crate.
pub fn nightly_cargo() -> Command {
    let mut c = Command::new("rustup");
    c.args(["run", "nightly", "cargo"]);
    c
}
