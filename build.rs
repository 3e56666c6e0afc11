//! Builds the CPU reference of the fingerprint (csrc/fingerprint_cpu.c) with `cc`.
//! The CUDA kernels are compiled at run time by NVRTC from the same header. Also builds the
//! Mooncake worker's bind() shim (csrc/bind_host.c) as a shared object.
fn main() {
    println!("cargo:rerun-if-changed=csrc/fingerprint.h");
    println!("cargo:rerun-if-changed=csrc/fingerprint_cpu.c");
    cc::Build::new()
        .file("csrc/fingerprint_cpu.c")
        .include("csrc")
        .opt_level(3)
        .flag_if_supported("-std=c11")
        .warnings(true)
        .compile("kvprobe_fingerprint");
    // The bind() shim the Mooncake worker is started with (src/mem/mooncake.rs): a shared
    // object the binary carries and writes to its private directory.
    println!("cargo:rerun-if-changed=csrc/bind_host.c");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("libkvprobe_bind_host.so");
    // A build script runs before the crate exists: kvprobe's spawner (src/sys/child.rs) is not
    // there to use.
    #[allow(clippy::disallowed_methods)]
    let status = cc::Build::new()
        .get_compiler()
        .to_command()
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-o"])
        .arg(&out)
        .arg("csrc/bind_host.c")
        .arg("-ldl")
        .status()
        .expect("run the C compiler for csrc/bind_host.c");
    assert!(status.success(), "csrc/bind_host.c did not compile");
}
