//! `cargo xtask`: the project's own automation. Every command first checks the
//! toolchain (and installs what is missing), so a fresh machine needs nothing
//! done by hand.
mod bench;
mod build_ebpf;
mod cmd;
mod demo;
mod image;
mod leftovers;
mod setup;
mod test;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Build, test and demo the dataplane")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Check every prerequisite and install what is missing (idempotent).
    ///
    /// Debian packages (LLVM 22 dev libraries, iproute2, ...), rust-src for the
    /// nightly toolchain, bpf-linker 0.13 built against LLVM 22.
    Setup {
        /// Only check; fail instead of installing.
        #[arg(long)]
        check: bool,
    },
    /// Build the kernel object (release, with BTF) and print where it is.
    BuildEbpf,
    /// Run everything CI runs: rustfmt, clippy (host and eBPF), unit tests,
    /// BPF_PROG_TEST_RUN packet tests and end-to-end tests (needs root).
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(last = true)]
        cargo_test_args: Vec<String>,
    },
    /// Measure the datapath (ns/packet through BPF_PROG_TEST_RUN at 1 to 100k
    /// services, against a floor program in the same run); writes
    /// docs/benchmarks.md and docs/bench-results.json (needs root).
    Bench {
        /// Extra arguments for the benchmark binary (`--quick`: 1 and 1k only).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Fuzz every packet program (BPF_PROG_TEST_RUN) with random and mutated
    /// frames checked against a model: no mistranslation, checksums exactly
    /// as valid as the input's (needs root). `cargo xtask test` runs a short
    /// version.
    Fuzz {
        /// Frames to generate (each runs through every packet program).
        #[arg(long, default_value_t = 1_000_000)]
        packets: u64,
        /// Seed (default: from the clock; printed either way).
        #[arg(long)]
        seed: Option<u64>,
    },
    /// Build the agent's container image (deploy/Containerfile, FROM scratch)
    /// with podman from a static musl build of the agent, and the BGP
    /// sidecar's (deploy/Containerfile.bird, `REPO-bird:VERSION`); prints
    /// both tags.
    Image {
        #[arg(long, default_value = concat!("localhost/kube-dataplane:", env!("CARGO_PKG_VERSION")))]
        tag: String,
    },
    /// Build a sandbox cluster in network namespaces and show the dataplane at
    /// work (needs root).
    Demo {
        /// Extra arguments for the demo binary (see `cargo xtask demo -- --help`).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Setup { check } => setup::run(if check {
            setup::Mode::Check
        } else {
            setup::Mode::Install
        }),
        Command::BuildEbpf => {
            setup::run(setup::Mode::Install)?;
            let object = build_ebpf::build()?;
            println!("{}", object.display());
            Ok(())
        }
        Command::Test { cargo_test_args } => {
            setup::run(setup::Mode::Install)?;
            test::run(&cargo_test_args)
        }
        Command::Bench { args } => {
            setup::run(setup::Mode::Install)?;
            bench::run(&args)
        }
        Command::Fuzz { packets, seed } => {
            setup::run(setup::Mode::Install)?;
            let mut args = vec!["--packets".to_owned(), packets.to_string()];
            if let Some(seed) = seed {
                args.extend(["--seed".to_owned(), seed.to_string()]);
            }
            cmd::run(
                cmd::cargo()
                    .args([
                        "run",
                        "--release",
                        "--package",
                        "dataplane-tests",
                        "--bin",
                        "fuzz",
                        "--",
                    ])
                    .args(&args),
            )
        }
        Command::Image { tag } => {
            setup::run(setup::Mode::Install)?;
            image::run(&tag)
        }
        Command::Demo { args } => {
            setup::run(setup::Mode::Install)?;
            demo::run(&args)
        }
    }
}
