//! Rebuild the kernel object when bpf-linker changes (it is the linker, which
//! cargo does not track on its own).
fn main() {
    match which::which("bpf-linker") {
        Ok(path) => println!("cargo:rerun-if-changed={}", path.display()),
        Err(e) => println!("cargo:warning=bpf-linker not found ({e}); run `cargo xtask setup`"),
    }
}
