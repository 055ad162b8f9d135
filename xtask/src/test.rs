//! `cargo xtask test`: the whole suite, in the order a failure is cheapest.
use std::{
    io::BufRead as _,
    process::{Command, Stdio},
};

use anyhow::{Context as _, bail};

use crate::{build_ebpf::nightly_cargo, cmd, leftovers::Snapshot};

#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
}

pub fn run(cargo_test_args: &[String]) -> anyhow::Result<()> {
    let mut tally = Tally::default();
    step("rustfmt", || {
        cmd::run(cmd::cargo().args(["fmt", "--all", "--", "--check"]))
    })?;
    step("clippy (host crates)", || {
        cmd::run(cmd::cargo().args(["clippy", "--all-targets", "--", "-D", "warnings"]))
    })?;
    step("clippy (eBPF crate, bpfel-unknown-none)", || {
        cmd::run(
            nightly_cargo()
                .args(["clippy", "--package", "dataplane-ebpf", "--release"])
                .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"])
                .args(["--target-dir", "target/ebpf-clippy", "--", "-D", "warnings"]),
        )
    })?;
    step("unit tests", || {
        cargo_test(
            cmd::cargo()
                .args([
                    "test",
                    "--workspace",
                    "--exclude",
                    "dataplane-tests",
                    "--exclude",
                    "dataplane-ebpf",
                ])
                .args(["--lib", "--bins", "--tests"])
                .args(cargo_test_args),
            &mut tally,
        )
    })?;
    // The privileged tests must leave the machine as they found it.
    let before = Snapshot::take();
    let tests = step("BPF packet tests and end-to-end tests (privileged)", || {
        cargo_test(
            cmd::cargo()
                // Every test binary runs even when one fails: one run
                // reports every failure.
                .args([
                    "test",
                    "--no-fail-fast",
                    "--package",
                    "dataplane-tests",
                    "--tests",
                ])
                .args(cargo_test_args),
            &mut tally,
        )
    });
    let clean = step(
        "nothing left behind (mounts, network namespaces, pins, cgroups)",
        || {
            let left = before.leftovers(&Snapshot::take());
            if left.is_empty() {
                return Ok(());
            }
            for item in &left {
                eprintln!("left behind: {item}");
            }
            bail!(
                "the privileged tests left {} thing(s) on this machine (listed above): the harness must remove \
             everything it creates, also after a panic",
                left.len()
            )
        },
    );
    // Leftovers are listed either way; a test failure is the first error.
    tests?;
    clean?;
    eprintln!("xtask test: all steps passed");
    // The one closing line that sums every cargo test run above.
    println!("{} passed, {} failed", tally.passed, tally.failed);
    Ok(())
}

/// Runs `cargo test`, echoing its output and adding its results to `tally`.
fn cargo_test(command: &mut Command, tally: &mut Tally) -> anyhow::Result<()> {
    let what = cmd::describe(command);
    eprintln!("+ {what}");
    let mut child = command
        .current_dir(cmd::workspace_root())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("cannot start `{what}`"))?;
    for line in std::io::BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        println!("{line}");
        // "test result: ok. 4 passed; 0 failed; 0 ignored; ..."
        if let Some(rest) = line.strip_prefix("test result: ") {
            for part in rest.split(';') {
                let mut words = part.split_whitespace().rev();
                let (Some(kind), Some(n)) = (words.next(), words.next()) else {
                    continue;
                };
                let Ok(n) = n.parse::<u64>() else { continue };
                match kind {
                    "passed" => tally.passed += n,
                    "failed" => tally.failed += n,
                    _ => {}
                }
            }
        }
    }
    let status = child.wait()?;
    if !status.success() {
        bail!("`{what}` failed ({status})");
    }
    Ok(())
}

fn step(name: &str, f: impl FnOnce() -> anyhow::Result<()>) -> anyhow::Result<()> {
    eprintln!("\n==> {name}");
    let started = std::time::Instant::now();
    f()?;
    eprintln!("==> {name}: ok ({:.1} s)", started.elapsed().as_secs_f64());
    Ok(())
}
