//! The set-up scripts' dependency detection (scripts/deps.sh through `install-deps.sh --check`)
//! run against machine states made up in a temporary directory (KVPROBE_DEPS_ROOT): each
//! dependency must be found exactly where its consumer finds it, and only there. A fresh
//! Debian 12 image with libclang-cpp14 but no libclang once passed the old check.

use crate::common::tmpdir;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A 64-bit (or 32-bit) ELF header followed by padding: enough for the class check bindgen's
/// loader (clang-sys) makes before it accepts a library.
fn elf(path: &Path, class64: bool) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut b = vec![0x7f, b'E', b'L', b'F', if class64 { 2 } else { 1 }, 1, 1, 0];
    b.resize(64, 0);
    std::fs::write(path, b).unwrap();
}

/// `scripts/install-deps.sh --check` (with `--check` of install-mooncake.sh) against `root`:
/// (exit code, the missing items). The environment that steers clang-sys's search is
/// cleared (LIBCLANG_PATH, LD_LIBRARY_PATH, LIBRARY_PATH) and llvm-config is `llvm_config`.
fn check(root: &Path, llvm_config: &Path, env: &[(&str, &str)]) -> (i32, Vec<String>) {
    check_with(root, llvm_config, &[], env)
}

/// As `check`, with `args` (`--build`, `--runtime`) after `--check`.
fn check_with(root: &Path, llvm_config: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, Vec<String>) {
    let home = root.join("kvprobe-home");
    let mut c = Command::new("bash");
    c.arg(repo().join("scripts/install-deps.sh"))
        .arg("--check")
        .args(args)
        .env("KVPROBE_DEPS_ROOT", root)
        .env("KVPROBE_HOME", &home)
        .env("LLVM_CONFIG_PATH", llvm_config)
        .env_remove("KVPROBE_NIXL_DIR")
        .env_remove("KVPROBE_MOONCAKE_VENV")
        .env_remove("LIBCLANG_PATH")
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("LIBRARY_PATH");
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().expect("run install-deps.sh --check");
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.stderr.is_empty(), "{}", String::from_utf8_lossy(&o.stderr));
    let missing = out.lines().filter_map(|l| l.strip_prefix("missing: ")).map(|s| s.to_string()).collect();
    (o.status.code().unwrap(), missing)
}

fn missing(root: &Path, env: &[(&str, &str)]) -> Vec<String> {
    check(root, Path::new("/nonexistent/llvm-config"), env).1
}

#[test]
fn libclang_is_found_where_bindgen_loads_it_and_libclang_cpp_is_not_libclang() {
    let root = tmpdir("deps-libclang");
    // The fresh Debian 12 image: llvm-14-dev pulled in libclang-cpp14 only.
    elf(&root.join("usr/lib/llvm-14/lib/libclang-cpp.so.14"), true);
    elf(&root.join("usr/lib/x86_64-linux-gnu/libclang-cpp.so.14"), true);
    assert!(missing(&root, &[]).contains(&"libclang-dev".to_string()), "libclang-cpp taken for libclang");

    // A 32-bit libclang is no use to a 64-bit build script.
    elf(&root.join("usr/lib/i386-linux-gnu/libclang-14.so.1"), false);
    assert!(missing(&root, &[]).contains(&"libclang-dev".to_string()), "a 32-bit libclang accepted");

    // Debian's libclang1-14 puts libclang-14.so.1 in the multiarch directory: found.
    elf(&root.join("usr/lib/x86_64-linux-gnu/libclang-14.so.1"), true);
    assert!(!missing(&root, &[]).contains(&"libclang-dev".to_string()));

    // LIBCLANG_PATH, when set, is the only place clang-sys looks.
    let empty = root.join("empty-dir");
    std::fs::create_dir_all(&empty).unwrap();
    let m = missing(&root, &[("LIBCLANG_PATH", "/empty-dir")]);
    assert!(m.contains(&"libclang-dev".to_string()), "LIBCLANG_PATH ignored: {m:?}");
}

#[test]
fn libclang_under_llvm_config_prefix_and_ld_library_path_is_found() {
    let root = tmpdir("deps-llvm-config");
    elf(&root.join("usr/lib/llvm-17/lib/libclang-cpp.so.17"), true);
    let fake = root.join("llvm-config");
    std::fs::write(&fake, "#!/bin/sh\necho /opt/llvm-17\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let (_, m) = check(&root, &fake, &[]);
    assert!(m.contains(&"libclang-dev".to_string()), "{m:?}");
    elf(&root.join("opt/llvm-17/lib/libclang.so.17"), true);
    let (_, m) = check(&root, &fake, &[]);
    assert!(!m.contains(&"libclang-dev".to_string()), "llvm-config --prefix not searched: {m:?}");

    let root2 = tmpdir("deps-ld-library-path");
    elf(&root2.join("custom/lib/libclang.so"), true);
    assert!(missing(&root2, &[]).contains(&"libclang-dev".to_string()));
    assert!(!missing(&root2, &[("LD_LIBRARY_PATH", "/custom/lib")]).contains(&"libclang-dev".to_string()));
}

#[test]
fn shared_libraries_are_found_where_the_loader_finds_them() {
    let root = tmpdir("deps-shlibs");
    let m = missing(&root, &[]);
    for p in ["libnuma1", "libibverbs1", "ibverbs-providers", "libcurl4"] {
        assert!(m.contains(&p.to_string()), "{p} not reported missing on an empty machine: {m:?}");
    }
    // A look-alike name is not the library: libcurl-gnutls.so.4 is not libcurl.so.4.
    elf(&root.join("usr/lib/libcurl-gnutls.so.4"), true);
    elf(&root.join("usr/lib/libnuma.so.1.0.0"), true);
    let m = missing(&root, &[]);
    assert!(m.contains(&"libcurl4".to_string()) && m.contains(&"libnuma1".to_string()), "{m:?}");

    // The trusted directories, and a directory named in /etc/ld.so.conf.d.
    elf(&root.join("usr/lib/libnuma.so.1"), true);
    elf(&root.join("opt/ofed/lib/libibverbs.so.1"), true);
    elf(&root.join("lib64/libcurl.so.4"), true);
    std::fs::create_dir_all(root.join("etc/ld.so.conf.d")).unwrap();
    std::fs::write(root.join("etc/ld.so.conf.d/ofed.conf"), "# OFED\n/opt/ofed/lib\n").unwrap();
    // A removed (not purged) ibverbs-providers leaves its /etc/libibverbs.d/*.driver
    // conffiles: no provider library, so still missing.
    std::fs::create_dir_all(root.join("etc/libibverbs.d")).unwrap();
    std::fs::write(root.join("etc/libibverbs.d/mlx5.driver"), "driver mlx5\n").unwrap();
    assert!(missing(&root, &[]).contains(&"ibverbs-providers".to_string()), "conffiles taken for providers");
    elf(&root.join("opt/ofed/lib/libibverbs/libmlx5-rdmav34.so"), true);
    let m = missing(&root, &[]);
    for p in ["libnuma1", "libibverbs1", "ibverbs-providers", "libcurl4"] {
        assert!(!m.contains(&p.to_string()), "{p} reported missing although present: {m:?}");
    }
}

#[test]
fn the_check_installs_nothing_and_names_the_missing_installs() {
    let root = tmpdir("deps-installs");
    let (code, m) = missing_with_code(&root);
    assert_eq!(code, 1);
    assert!(m.iter().any(|s| s.starts_with("NIXL 1.5.1 in ")), "{m:?}");
    assert!(m.iter().any(|s| s.starts_with("mooncake-transfer-engine-")), "{m:?}");
    assert!(!root.join("kvprobe-home").exists(), "--check created the install directory");
    for bad in [&["--bogus"][..], &["--check", "extra"], &["--check", "--check"]] {
        let o = Command::new("bash").arg(repo().join("scripts/install-deps.sh")).args(bad).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{bad:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("usage"), "{bad:?}");
    }
    // kvprobe loads NIXL from KVPROBE_NIXL_DIR alone when it is set, and uses the venv
    // KVPROBE_MOONCAKE_VENV names: the check looks there.
    let (_, m) = check(
        &root,
        Path::new("/nonexistent/llvm-config"),
        &[("KVPROBE_NIXL_DIR", "/nonexistent/nixl"), ("KVPROBE_MOONCAKE_VENV", "/nonexistent/venv")],
    );
    assert!(m.contains(&"NIXL in KVPROBE_NIXL_DIR=/nonexistent/nixl".to_string()), "{m:?}");
    assert!(m.contains(&"Mooncake venv KVPROBE_MOONCAKE_VENV=/nonexistent/venv".to_string()), "{m:?}");
    // Neither KVPROBE_HOME, XDG_DATA_HOME nor HOME: nowhere to look, said, exit 2.
    let o = Command::new("bash")
        .arg(repo().join("scripts/install-deps.sh"))
        .arg("--check")
        .env_remove("HOME")
        .env_remove("KVPROBE_HOME")
        .env_remove("XDG_DATA_HOME")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("set KVPROBE_HOME"), "{}", String::from_utf8_lossy(&o.stderr));
}

fn missing_with_code(root: &Path) -> (i32, Vec<String>) {
    check(root, Path::new("/nonexistent/llvm-config"), &[])
}

/// `install-deps.sh --check PART` against `root` with `bin` first on PATH: (exit code, missing).
fn check_part(root: &Path, part: &str, bin: &Path) -> (i32, Vec<String>) {
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let args: Vec<&str> = [part].into_iter().filter(|p| !p.is_empty()).collect();
    check_with(root, Path::new("/nonexistent/llvm-config"), &args, &[("PATH", &path)])
}

#[test]
fn build_and_runtime_parts_check_only_their_own_dependencies() {
    // A machine with nothing: no libclang, no libnuma, and a python3 without pip (Debian's and
    // Ubuntu's python3 package, as in the CUDA runtime image the container builds on).
    let root = tmpdir("deps-parts");
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let real = String::from_utf8(Command::new("bash").args(["-c", "command -v python3"]).output().unwrap().stdout).unwrap();
    let fake = bin.join("python3");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\n[ \"$1 $2\" = \"-m pip\" ] && {{ echo 'No module named pip' >&2; exit 1; }}\nexec {} \"$@\"\n",
            real.trim()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();

    let (code, m) = check_part(&root, "--build", &bin);
    assert_eq!((code, m), (1, vec!["libclang-dev".to_string()]), "--build: only what cargo build needs");
    // The C++ compiler nixl-sys's build script runs (cc-rs: $CXX alone when set).
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    let nocxx = [("PATH", path.as_str()), ("CXX", "/nonexistent/g++")];
    let (_, m) = check_with(&root, Path::new("/nonexistent/llvm-config"), &["--build"], &nocxx);
    assert_eq!(m, ["libclang-dev", "g++"], "a missing C++ compiler not reported");
    let (_, m) = check_with(&root, Path::new("/nonexistent/llvm-config"), &["--runtime"], &nocxx);
    assert!(!m.contains(&"g++".to_string()), "--runtime asks for the build's compiler: {m:?}");
    let (code, m) = check_part(&root, "--runtime", &bin);
    assert_eq!(code, 1);
    assert!(!m.contains(&"libclang-dev".to_string()), "--runtime asks for the build's libclang: {m:?}");
    for p in ["libnuma1", "python3-pip"] {
        assert!(m.contains(&p.to_string()), "--runtime does not ask for {p}: {m:?}");
    }
    assert!(m.iter().any(|s| s.starts_with("NIXL 1.5.1 in ")), "{m:?}");
    assert!(m.iter().any(|s| s.starts_with("mooncake-transfer-engine-")), "{m:?}");
    // Without a part, both; with the real python3 (pip present), pip is not asked for.
    let (_, all) = check_part(&root, "", &bin);
    assert!(all.contains(&"libclang-dev".to_string()) && all.contains(&"python3-pip".to_string()), "{all:?}");
    assert!(!missing(&root, &[]).contains(&"python3-pip".to_string()), "python3-pip reported missing although pip is there");
    for bad in [&["--build", "--runtime"][..], &["--runtime", "--runtime"], &["--check", "--build", "--build"]] {
        let o = Command::new("bash").arg(repo().join("scripts/install-deps.sh")).args(bad).output().unwrap();
        assert_eq!(o.status.code(), Some(2), "{bad:?}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("usage"), "{bad:?}");
    }
}
