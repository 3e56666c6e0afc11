//! Builds the CPU reference of the fingerprint (csrc/fingerprint_cpu.c) with `cc`.
//! The CUDA kernels are compiled at run time by NVRTC from the same header.
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
}
