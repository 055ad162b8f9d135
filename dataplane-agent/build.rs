//! Builds the kernel object (`dataplane-ebpf`) with aya-build and leaves it in
//! OUT_DIR, where `dataplane::EBPF_OBJECT` embeds it. `cargo xtask build-ebpf`
//! goes through this same recipe.
use std::path::PathBuf;

use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let root_dir = manifest_dir
        .parent()
        .context("the agent crate must live inside the workspace")?
        .join("dataplane-ebpf");
    // aya-build watches the kernel crate; the ABI crate it compiles in is
    // ours to watch.
    let common = manifest_dir
        .parent()
        .context("the agent crate must live inside the workspace")?
        .join("dataplane-common");
    println!("cargo:rerun-if-changed={}", common.display());
    let root_dir = root_dir
        .to_str()
        .context("workspace path is not UTF-8")?
        .to_owned();
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "dataplane-ebpf",
            root_dir: &root_dir,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
