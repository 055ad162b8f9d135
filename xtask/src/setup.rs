//! Prerequisites: each one is checked, and installed when missing (as root).
//! Idempotent: a second run only checks.
use std::process::Command;

use anyhow::{Context as _, bail};

use crate::cmd::{self, output};

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Check,
    Install,
}

/// Debian packages: LLVM 22 for bpf-linker; iproute2 and ethtool for the
/// network-namespace sandbox; iptables and nftables for the benchmarks
/// against kube-proxy's rule sets (and the preflight's tests); wrk and
/// nginx-light, the benchmarks' load generator and server (run only inside
/// the sandbox's namespaces: the install starts no service, see
/// `debian_packages`); podman and runc build and run the agent's image
/// (runc: crun refuses hybrid cgroup hosts), musl-tools compiles the C
/// parts of the static agent; bird2 is the BGP speaker the agent drives and
/// the router of the BGP tests (the install starts no daemon either).
const DEBIAN_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "zlib1g-dev",
    "libzstd-dev",
    "iproute2",
    "ethtool",
    "iptables",
    "nftables",
    "wrk",
    "nginx-light",
    "podman",
    "runc",
    "musl-tools",
    "bird2",
];
const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const NIGHTLY: &str = "nightly";
const BPF_LINKER_VERSION: &str = "0.13.0";

pub fn run(mode: Mode) -> anyhow::Result<()> {
    check_kernel()?;
    debian_packages(mode)?;
    rust_components(mode)?;
    bpf_linker(mode)?;
    python_tools(mode)?;
    eprintln!("setup: all prerequisites present");
    Ok(())
}

fn is_root() -> bool {
    output(Command::new("id").arg("-u")).is_some_and(|s| s.trim() == "0")
}

fn check_kernel() -> anyhow::Result<()> {
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        bail!(
            "this kernel has no BTF (/sys/kernel/btf/vmlinux is missing): the datapath needs a kernel \
             built with CONFIG_DEBUG_INFO_BTF=y (Linux 5.10 or newer; 6.x recommended)"
        );
    }
    Ok(())
}

fn debian_packages(mode: Mode) -> anyhow::Result<()> {
    let missing: Vec<&str> = DEBIAN_PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            !output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .is_some_and(|s| s.contains("install ok installed"))
        })
        .collect();
    if missing.is_empty() {
        eprintln!("setup: Debian packages present ({})", DEBIAN_PACKAGES.join(", "));
        return Ok(());
    }
    let install = format!("apt-get install -y --no-install-recommends {}", missing.join(" "));
    if mode == Mode::Check || !is_root() {
        bail!(
            "missing Debian packages: {}; install them with `{install}` (as root)",
            missing.join(", ")
        );
    }
    eprintln!("setup: installing Debian packages: {}", missing.join(", "));
    cmd::run(Command::new("apt-get").arg("update").arg("-q"))?;
    cmd::run(
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            // Packaged services (nginx) must not start in the machine's own
            // network namespace: invoke-rc.d starts nothing in runlevel 1.
            .env("RUNLEVEL", "1"),
    )
    .with_context(|| format!("`{install}` failed; is the Debian archive reachable?"))
}

fn installed_components(toolchain: &str) -> Option<String> {
    output(Command::new("rustup").args(["component", "list", "--installed", "--toolchain", toolchain]))
}

fn rust_components(mode: Mode) -> anyhow::Result<()> {
    if output(Command::new("rustup").arg("--version")).is_none() {
        bail!("rustup not found: the eBPF build needs rustup with a nightly toolchain (https://rustup.rs)");
    }
    // Host crates: rustfmt and clippy of the default toolchain; eBPF crate:
    // rust-src (for -Z build-std=core) and clippy of the nightly toolchain.
    let wanted: [(&str, &str); 4] = [
        ("stable", "rustfmt"),
        ("stable", "clippy"),
        (NIGHTLY, "rust-src"),
        (NIGHTLY, "clippy"),
    ];
    let active = output(Command::new("rustup").args(["show", "active-toolchain"]))
        .and_then(|s| s.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "stable".to_owned());
    for (toolchain, component) in wanted {
        let toolchain = if toolchain == "stable" {
            active.as_str()
        } else {
            toolchain
        };
        let Some(installed) = installed_components(toolchain) else {
            bail!(
                "rust toolchain `{toolchain}` is not installed; install it with \
                 `rustup toolchain install {toolchain} --profile minimal`"
            );
        };
        if installed.lines().any(|l| l.starts_with(component)) {
            continue;
        }
        let add = format!("rustup component add {component} --toolchain {toolchain}");
        if mode == Mode::Check {
            bail!("missing `{component}` for the {toolchain} toolchain; install it with `{add}`");
        }
        eprintln!("setup: installing {component} for the {toolchain} toolchain");
        cmd::run(Command::new("rustup").args(["component", "add", component, "--toolchain", toolchain]))
            .with_context(|| format!("`{add}` failed"))?;
    }
    // The static agent of the image.
    let target = crate::image::MUSL_TARGET;
    let targets =
        output(Command::new("rustup").args(["target", "list", "--installed", "--toolchain", &active]))
            .unwrap_or_default();
    if !targets.lines().any(|l| l.trim() == target) {
        let add = format!("rustup target add {target} --toolchain {active}");
        if mode == Mode::Check {
            bail!("missing the {target} target; install it with `{add}`");
        }
        eprintln!("setup: installing the {target} target for {active}");
        cmd::run(Command::new("rustup").args(["target", "add", target, "--toolchain", &active]))
            .with_context(|| format!("`{add}` failed"))?;
    }
    eprintln!("setup: rust components present (rustfmt, clippy, {target}; nightly rust-src, clippy)");
    Ok(())
}

/// bpf-linker 0.13, dynamically linked against Debian's LLVM 22.
fn bpf_linker(mode: Mode) -> anyhow::Result<()> {
    let version = output(Command::new("bpf-linker").arg("--version"));
    let path = output(Command::new("sh").args(["-c", "command -v bpf-linker"]));
    let llvm_22 = path
        .as_deref()
        .and_then(|p| output(Command::new("ldd").arg(p.trim())))
        .is_some_and(|ldd| ldd.contains("libLLVM.so.22"));
    let right_version = version
        .as_deref()
        .is_some_and(|v| v.trim() == format!("bpf-linker {BPF_LINKER_VERSION}"));
    if right_version && llvm_22 {
        eprintln!("setup: bpf-linker {BPF_LINKER_VERSION} (LLVM 22) present");
        return Ok(());
    }
    let why = match (version, llvm_22) {
        (None, _) => "not found on PATH".to_owned(),
        (Some(v), true) => format!("found {}, want {BPF_LINKER_VERSION}", v.trim()),
        (Some(v), false) => format!("found {} not linked against LLVM 22", v.trim()),
    };
    let install = format!(
        "LLVM_SYS_221_PREFIX={LLVM_PREFIX} LLVM_PREFIX={LLVM_PREFIX} cargo install bpf-linker \
         --version {BPF_LINKER_VERSION} --locked --no-default-features --features llvm-22 --force"
    );
    if mode == Mode::Check {
        bail!("bpf-linker: {why}; install it with `{install}`");
    }
    eprintln!("setup: bpf-linker {why}; building it against LLVM 22 (about a minute on 2 cores)");
    // Both variables are needed: llvm-sys finds llvm-config through the
    // first, bpf-linker's build script links -lLLVM through the second.
    cmd::run(
        cmd::cargo()
            .args([
                "install",
                "bpf-linker",
                "--version",
                BPF_LINKER_VERSION,
                "--locked",
                "--force",
            ])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("LLVM_SYS_221_PREFIX", LLVM_PREFIX)
            .env("LLVM_PREFIX", LLVM_PREFIX),
    )
    .with_context(|| format!("building bpf-linker failed; the command was `{install}`"))?;
    if output(Command::new("bpf-linker").arg("--version")).is_none() {
        bail!("bpf-linker was installed but is not on PATH: add ~/.cargo/bin to PATH");
    }
    Ok(())
}

/// Python packages from PyPI (pinned), with the command that proves each is
/// usable: kubernetes-validate (the deployment tests validate deploy/
/// against the Kubernetes schemas with it) and prometheus-client (its
/// exposition parser, Prometheus' own Python client, checks the agent's
/// /metrics in the end-to-end tests).
const PYTHON_PACKAGES: &[(&str, &[&str])] = &[
    (
        "kubernetes-validate==1.37.0",
        &["-m", "kubernetes_validate", "--version"],
    ),
    (
        "prometheus-client==0.26.0",
        &["-c", "import prometheus_client.parser"],
    ),
];

fn python_tools(mode: Mode) -> anyhow::Result<()> {
    for (package, probe) in PYTHON_PACKAGES {
        python_package(mode, package, probe)?;
    }
    Ok(())
}

fn python_package(mode: Mode, package: &str, probe: &[&str]) -> anyhow::Result<()> {
    let present = || output(Command::new("python3").args(probe)).is_some();
    if present() {
        eprintln!("setup: {package} present");
        return Ok(());
    }
    let install = format!("python3 -m pip install {package}");
    if mode == Mode::Check {
        bail!("{package} is missing; install it with `{install}`");
    }
    eprintln!("setup: installing {package} from PyPI");
    let plain = cmd::run(Command::new("python3").args(["-m", "pip", "install", "--quiet", package]));
    if plain.is_err() {
        // Debian's system Python refuses pip installs without this flag.
        cmd::run(Command::new("python3").args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--break-system-packages",
            package,
        ]))
        .with_context(|| format!("`{install}` failed; is PyPI reachable?"))?;
    }
    if !present() {
        bail!("{package} installed but `python3 {}` fails", probe.join(" "));
    }
    Ok(())
}
