//! The agent's own command line, built into this package so that tests get
//! it through `CARGO_BIN_EXE_agent`, always current.
fn main() -> anyhow::Result<()> {
    dataplane_agent::cli::main()
}
