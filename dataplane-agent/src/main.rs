//! `dataplane-agent`: see `dataplane_agent::cli`.
fn main() -> anyhow::Result<()> {
    dataplane_agent::cli::main()
}
