//! `--dump DIR` (run and ab), `--bundle`/`kvprobe bundle` and `kvprobe report check`
//! (issue 14 items 1–3), on DRAM.

use crate::common::{kvprobe, read_report, tmpdir};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

pub fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// Checks a dump directory against the report section that wrote it: every slice file's
/// SHA-256 is its `actual_digest` (index and, when listed, report), every listed report
/// failure is dumped (the cap was not reached), and the per-class counts are complete.
pub fn assert_dump_matches(dir: &Path, r: &Value, ctx: &str) -> usize {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).expect("index.json")).unwrap();
    assert_eq!(index["schema"], "kvprobe.dump/1", "{ctx}");
    assert_eq!(index["seed"], r["config"]["seed"], "{ctx}");
    let slices = index["slices"].as_array().unwrap();
    let failures = r["failures"].as_array().unwrap();
    for s in slices {
        let bytes = std::fs::read(dir.join(s["file"].as_str().unwrap())).unwrap();
        assert_eq!(bytes.len() as u64, r["config"]["geometry"]["slice_bytes"].as_u64().unwrap(), "{ctx}");
        assert_eq!(sha256_hex(&bytes), s["actual_digest"].as_str().unwrap(), "{ctx}: {}", s["file"]);
        // Not listed: beyond --max-failures (the dump's cap is not reached in these runs).
        let Some(i) = s["report_index"].as_u64() else { continue };
        let f = &failures[i as usize];
        for k in ["iteration", "layer", "kv", "block", "class", "actual_digest", "expected_digest", "bad_bytes"] {
            assert_eq!(s[k], f[k], "{ctx}: {k} of {}", s["file"]);
        }
    }
    let listed = slices.iter().filter(|s| s["report_index"].is_u64()).count();
    assert_eq!(listed, failures.len(), "{ctx}: every listed failure dumped");
    for (class, n) in r["summary"]["by_class"].as_object().unwrap() {
        let c = &index["by_class"][class];
        assert_eq!(c["written"].as_u64().unwrap() + c["omitted"].as_u64().unwrap(), n.as_u64().unwrap(), "{ctx}: {class}");
    }
    assert_eq!(r["dump"]["slices_written"].as_u64().unwrap() as usize, slices.len(), "{ctx}");
    slices.len()
}

/// The issue's run command with `--dump`: (dir, exit code, report, stdout + stderr).
pub fn run_dump(name: &str, extra: &[&str]) -> (PathBuf, i32, Value, String) {
    let d = tmpdir(name);
    let (dump, r, j) = (d.join("D"), d.join("r.json"), d.join("j.xml"));
    let mut a = vec![
        "run",
        "--memory",
        "dram",
        "--inject",
        "torn:2",
        "--inject",
        "bitflip:2",
        "--inject",
        "misroute:1",
        "--dump",
        dump.to_str().unwrap(),
        "--junit",
        j.to_str().unwrap(),
        "--report",
        r.to_str().unwrap(),
    ];
    a.extend_from_slice(extra);
    let (code, out, err) = kvprobe(&a);
    assert!(!err.contains("panicked"), "{err}");
    (d, code, read_report(&r), format!("{out}{err}"))
}

#[test]
fn run_dump_holds_every_failing_slice_as_it_arrived() {
    let (d, code, r, log) = run_dump("dump-run", &[]);
    assert_eq!(code, 1, "{log}");
    assert!(d.join("j.xml").exists());
    let n = assert_dump_matches(&d.join("D"), &r, "run");
    // 5 iterations × (torn 2 + bitflip 2 + misroute: misplaced 1 + unwritten 1).
    assert_eq!(n, 30, "{log}");
    // The regenerate command writes the expected bytes (its digest is expected_digest).
    let index: Value = serde_json::from_str(&std::fs::read_to_string(d.join("D/index.json")).unwrap()).unwrap();
    let s = &index["slices"][0];
    let o = std::process::Command::new("sh")
        .arg("-c")
        .arg(s["regenerate"].as_str().unwrap())
        .current_dir(d.join("D"))
        .output()
        .expect("sh");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), s["expected_digest"].as_str().unwrap());
    let file = Path::new(s["file"].as_str().unwrap()).file_name().unwrap().to_owned();
    let exp = std::fs::read(d.join("D/expected").join(file)).unwrap();
    assert_eq!(sha256_hex(&exp), s["expected_digest"].as_str().unwrap());
}

#[test]
fn ab_dump_has_a_directory_per_row() {
    let d = tmpdir("dump-ab");
    let (dump, r, j, b) = (d.join("D"), d.join("ab.json"), d.join("j.xml"), d.join("ab.tar.gz"));
    let (code, out, err) = kvprobe(&[
        "ab",
        "--bundle",
        b.to_str().unwrap(),
        "--memory",
        "dram",
        "--requests",
        "200",
        "--lockstep",
        "--dump",
        dump.to_str().unwrap(),
        "--junit",
        j.to_str().unwrap(),
        "--report",
        r.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let ab = read_report(&r);
    let mut dumped = 0;
    for (row, sec) in ab["rows"].as_array().unwrap().iter().zip(ab["sections"].as_array().unwrap()) {
        let name = row["name"].as_str().unwrap();
        dumped += assert_dump_matches(&dump.join(name), sec, name);
        // The cap holds for the matrix: an equal share per row.
        assert_eq!(sec["dump"]["max_bytes"].as_u64(), Some((256 << 20) / kvprobe::ab::cases().len() as u64), "{name}");
    }
    assert!(dumped > 0, "the unfenced rows corrupt slices: {out}");
    // The bundle passes check; one byte of a row's slice changed fails it, naming the row and
    // the slice.
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "{out}{err}");
    let row = ab["rows"].as_array().unwrap().iter().find(|r| r["corrupt"].as_u64() > Some(0)).unwrap();
    let name = row["name"].as_str().unwrap();
    let t = d.join("tampered.tar.gz");
    let slice = flip_one_byte(&b, &t, &format!("dump/{name}/"), true);
    let (code, out, err) = check(&t);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains(&format!("row {name}: {slice}: actual_digest: ")), "{out}");
    // Each row is re-derived from its section; rows and dump folders pair by name.
    let files = untar(&b);
    let (first, second) =
        (ab["rows"][0]["name"].as_str().unwrap().to_string(), ab["rows"][1]["name"].as_str().unwrap().to_string());
    let n = name.to_string();
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit, String)> = vec![
        (
            "swap",
            Box::new(|v| v["rows"].as_array_mut().unwrap().swap(0, 1)),
            format!("row {second}: name: row {second}, section {first}"),
        ),
        (
            "corrupt",
            Box::new(move |v| {
                let r = v["rows"].as_array_mut().unwrap().iter_mut().find(|r| r["name"] == n.as_str()).unwrap();
                r["corrupt"] = 999.into();
            }),
            format!("row {name}: corrupt: row 999"),
        ),
        ("classes", Box::new(|v| v["rows"][0]["classes"]["torn"] = 5.into()), format!("row {first}: classes: row")),
        ("verdict", Box::new(|v| v["rows"][0]["verdict"] = "detected".into()), format!("row {first}: verdict: row \"detected\"")),
        ("pass", Box::new(|v| v["rows"][0]["pass"] = false.into()), format!("row {first}: pass: row false")),
    ];
    for (what, f, line) in cases {
        let t = d.join(format!("{what}.tar.gz"));
        retar(&t, &edit_json(&files, "ab.json", &*f));
        let (code, out, err) = check(&t);
        assert_eq!(code, 1, "{what}: {out}{err}");
        assert!(out.contains(&line), "{what}: {line:?} in {out}");
    }
    // A dump folder no row is named.
    let mut fs = files.clone();
    let index = fs.iter().find(|f| f.0 == format!("kvprobe-bundle/dump/{first}/index.json")).unwrap().1.clone();
    fs.push(("kvprobe-bundle/dump/ghost/index.json".into(), index.clone()));
    let mut mv: Value = serde_json::from_slice(&fs[0].1).unwrap();
    mv["files"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"path": "dump/ghost/index.json", "bytes": index.len(), "sha256": sha256_hex(&index)}));
    fs[0].1 = serde_json::to_vec(&mv).unwrap();
    let t = d.join("ghost.tar.gz");
    retar(&t, &fs);
    let (code, out, err) = check(&t);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("dump/ghost/index.json: a dump folder no row is named (ghost)"), "{out}");
}

#[test]
fn the_cap_keeps_every_class_and_the_counts_stay_complete() {
    // 4 KiB slices; room for 10 of the 200 failures (100 bitflip, 100 torn per iteration × 2).
    let (d, code, r, log) = run_dump(
        "dump-cap",
        &["--inject", "bitflip:50", "--inject", "torn:50", "--iterations", "2", "--dump-max-bytes", "40KiB"],
    );
    assert_eq!(code, 1, "{log}");
    let index: Value = serde_json::from_str(&std::fs::read_to_string(d.join("D/index.json")).unwrap()).unwrap();
    let slices = index["slices"].as_array().unwrap();
    assert!(index["bytes_written"].as_u64().unwrap() <= 40 * 1024);
    assert_eq!(slices.len() as u64 * 4096, index["bytes_written"].as_u64().unwrap());
    let files = std::fs::read_dir(d.join("D/slices")).unwrap().count();
    assert_eq!(files, slices.len());
    for class in ["bitflip", "torn", "misplaced", "unwritten"] {
        assert!(slices.iter().any(|s| s["class"] == class), "{class} dumped: {index}");
        let c = &index["by_class"][class];
        assert_eq!(
            c["written"].as_u64().unwrap() + c["omitted"].as_u64().unwrap(),
            r["summary"]["by_class"][class].as_u64().unwrap(),
            "{class}"
        );
    }
    assert!(r["dump"]["slices_omitted"].as_u64().unwrap() > 0);
    // A failure beyond the cap is still in the report, not dumped.
    for s in slices {
        let f = &r["failures"][s["report_index"].as_u64().unwrap() as usize];
        assert_eq!(f["actual_digest"], s["actual_digest"]);
    }
}

#[test]
fn a_non_empty_dump_directory_is_refused_before_the_run() {
    let d = tmpdir("dump-nonempty");
    std::fs::create_dir_all(d.join("D")).unwrap();
    std::fs::write(d.join("D/keep.txt"), "mine").unwrap();
    let r = d.join("r.json");
    let (code, out, err) =
        kvprobe(&["run", "--memory", "dram", "--dump", d.join("D").to_str().unwrap(), "--report", r.to_str().unwrap()]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains("is not empty"), "{err}");
    assert!(!err.contains("setup:") && !out.contains("iteration"), "refused before the run: {out}{err}");
    assert_eq!(std::fs::read_dir(d.join("D")).unwrap().count(), 1);
    assert_eq!(std::fs::read_to_string(d.join("D/keep.txt")).unwrap(), "mine");
}

/// [`assert_dump_matches`] for a dump that reached its cap: every file is its
/// `actual_digest` and matches its listed record; counts complete.
pub fn assert_dump_matches_capped(dir: &Path, r: &Value, ctx: &str) -> usize {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).expect("index.json")).unwrap();
    let slices = index["slices"].as_array().unwrap();
    for s in slices {
        let bytes = std::fs::read(dir.join(s["file"].as_str().unwrap())).unwrap();
        assert_eq!(sha256_hex(&bytes), s["actual_digest"].as_str().unwrap(), "{ctx}: {}", s["file"]);
        if let Some(i) = s["report_index"].as_u64() {
            assert_eq!(r["failures"][i as usize]["actual_digest"], s["actual_digest"], "{ctx}");
        }
    }
    for (class, n) in r["summary"]["by_class"].as_object().unwrap() {
        let c = &index["by_class"][class];
        assert_eq!(c["written"].as_u64().unwrap() + c["omitted"].as_u64().unwrap(), n.as_u64().unwrap(), "{ctx}: {class}");
    }
    slices.len()
}

/// The files of a bundle, in order, as (path, bytes).
pub fn untar(p: &Path) -> Vec<(String, Vec<u8>)> {
    use std::io::Read;
    let mut a = tar::Archive::new(flate2::read::GzDecoder::new(std::fs::File::open(p).unwrap()));
    a.entries()
        .unwrap()
        .map(|e| {
            let mut e = e.unwrap();
            let name = e.path().unwrap().to_string_lossy().into_owned();
            let mut b = Vec::new();
            e.read_to_end(&mut b).unwrap();
            (name, b)
        })
        .collect()
}

/// Writes `files` as a .tar.gz at `p`.
pub fn retar(p: &Path, files: &[(String, Vec<u8>)]) {
    let gz = flate2::write::GzEncoder::new(std::fs::File::create(p).unwrap(), flate2::Compression::fast());
    let mut t = tar::Builder::new(gz);
    for (name, body) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        t.append_data(&mut h, name, body.as_slice()).unwrap();
    }
    t.into_inner().unwrap().finish().unwrap();
}

/// `kvprobe report check FILE`: (exit code, stdout, stderr).
pub fn check(p: &Path) -> (i32, String, String) {
    let (code, out, err) = kvprobe(&["report", "check", p.to_str().unwrap()]);
    assert!(!err.contains("panicked"), "{err}");
    (code, out, err)
}

/// The bundle `b` with one byte of its first dumped slice (under `dump_prefix`) flipped,
/// written to `out`; with `fix_manifest` the manifest is updated to the new bytes (so only
/// the re-derivation from the bytes can see it). Returns the slice's name in check's words.
pub fn flip_one_byte(b: &Path, out: &Path, dump_prefix: &str, fix_manifest: bool) -> String {
    let mut files = untar(b);
    let index_name = format!("kvprobe-bundle/{dump_prefix}index.json");
    let index: Value = serde_json::from_slice(&files.iter().find(|f| f.0 == index_name).expect("index in bundle").1).unwrap();
    let s = &index["slices"][0];
    let target = format!("kvprobe-bundle/{dump_prefix}{}", s["file"].as_str().unwrap());
    let f = files.iter_mut().find(|f| f.0 == target).expect("slice in bundle");
    f.1[100] ^= 0x40;
    let (sha, len) = (sha256_hex(&f.1), f.1.len());
    if fix_manifest {
        let m = files.iter_mut().find(|f| f.0 == "kvprobe-bundle/manifest.json").unwrap();
        let mut mv: Value = serde_json::from_slice(&m.1).unwrap();
        let rel = target.strip_prefix("kvprobe-bundle/").unwrap();
        for e in mv["files"].as_array_mut().unwrap() {
            if e["path"] == rel {
                e["sha256"] = sha.clone().into();
                e["bytes"] = len.into();
            }
        }
        m.1 = serde_json::to_vec(&mv).unwrap();
    }
    retar(out, &files);
    format!("iteration {} layer {} {} block {}", s["iteration"], s["layer"], s["kv"].as_str().unwrap(), s["block"])
}

#[test]
fn a_run_bundle_passes_check_and_one_changed_byte_fails_it() {
    let d = tmpdir("bundle-run");
    let b = d.join("b.tar.gz");
    let (code, out, err) = kvprobe(&[
        "run",
        "--memory",
        "dram",
        "--inject",
        "torn:2",
        "--inject",
        "bitflip:2",
        "--inject",
        "misroute:1",
        "--dump",
        d.join("D").to_str().unwrap(),
        "--junit",
        d.join("j.xml").to_str().unwrap(),
        "--report",
        d.join("r.json").to_str().unwrap(),
        "--bundle",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains(&format!("bundle:            {}", b.display())), "{out}");
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "{out}{err}");
    // The bundle holds the report exactly as written, the dump, the manifest and env/.
    let files = untar(&b);
    assert_eq!(files[0].0, "kvprobe-bundle/manifest.json");
    let report = &files.iter().find(|f| f.0 == "kvprobe-bundle/report.json").unwrap().1;
    assert_eq!(report, &std::fs::read(d.join("r.json")).unwrap());
    assert!(files.iter().any(|f| f.0.starts_with("kvprobe-bundle/env/")));
    let m: Value = serde_json::from_slice(&files[0].1).unwrap();
    assert_eq!(m["schema"], "kvprobe.manifest/1");
    assert_eq!(m["capture_made"], "run");
    assert_eq!(m["files"].as_array().unwrap().len(), files.len() - 1);
    // `report show` reads the bundle's report.
    let (c1, shown, _) = kvprobe(&["report", "show", b.to_str().unwrap()]);
    let (c2, direct, _) = kvprobe(&["report", "show", d.join("r.json").to_str().unwrap()]);
    assert_eq!((c1, c2), (0, 0));
    // The same summary; the pointer to the full list of failures names where each was read.
    let r = d.join("r.json");
    assert!(direct.contains(&format!("the JSON report ({}) lists 30", r.display())), "{direct}");
    assert_eq!(shown, direct.replace(&r.display().to_string(), &format!("report.json in {}", b.display())));
    // One byte changed: the manifest sees it, and so does the re-derivation from the bytes
    // when the manifest is made to agree.
    for fix in [false, true] {
        let t = d.join(format!("tampered-{fix}.tar.gz"));
        let name = flip_one_byte(&b, &t, "dump/", fix);
        let (code, out, err) = check(&t);
        assert_eq!(code, 1, "{out}{err}");
        assert!(out.contains(&format!("{name}: actual_digest: ")), "{name} named: {out}");
        assert!(out.contains(&format!("{name}: bad_bytes: ")), "{out}");
        assert_eq!(out.contains("sha256: manifest"), !fix, "{out}");
    }
}

/// `kvprobe run --memory dram --iterations 2 --inject torn:1 --report DIR/r.json --bundle
/// DIR/b.tar.gz` (with `dump`: also `--dump DIR/D`), in a fresh directory `name`; asserts
/// exit 1 (the torn slices). Returns (the directory, the bundle).
fn torn_bundle(name: &str, dump: bool) -> (std::path::PathBuf, std::path::PathBuf) {
    let d = tmpdir(name);
    let (b, r, dd) = (d.join("b.tar.gz"), d.join("r.json"), d.join("D"));
    let mut a = vec!["run", "--memory", "dram", "--iterations", "2", "--inject", "torn:1"];
    if dump {
        a.extend(["--dump", dd.to_str().unwrap()]);
    }
    a.extend(["--report", r.to_str().unwrap(), "--bundle", b.to_str().unwrap()]);
    let (code, out, err) = kvprobe(&a);
    assert_eq!(code, 1, "{out}{err}");
    (d, b)
}

#[test]
fn manifest_tampering_fails_check_naming_the_file() {
    let (d, b) = torn_bundle("bundle-manifest", false);
    assert_eq!(check(&b).0, 0);
    let files = untar(&b);
    let m: Value = serde_json::from_slice(&files[0].1).unwrap();
    let victim = m["files"][1]["path"].as_str().unwrap().to_string();
    let with_manifest = |f: &dyn Fn(&mut Value)| {
        let mut mv = m.clone();
        f(&mut mv);
        let mut fs = files.clone();
        fs[0].1 = serde_json::to_vec(&mv).unwrap();
        fs
    };
    type Case = (&'static str, Vec<(String, Vec<u8>)>, String);
    let cases: Vec<Case> = vec![
        ("size", with_manifest(&|mv| mv["files"][1]["bytes"] = 1.into()), format!("{victim}: bytes: manifest 1")),
        ("sha", with_manifest(&|mv| mv["files"][1]["sha256"] = "00".into()), format!("{victim}: sha256: manifest 00")),
        (
            "extra",
            {
                let mut fs = files.clone();
                fs.push(("kvprobe-bundle/env/extra.txt".into(), b"x".to_vec()));
                fs
            },
            "env/extra.txt: in the bundle but not in the manifest".into(),
        ),
        (
            "missing",
            files.iter().filter(|f| f.0 != format!("kvprobe-bundle/{victim}")).cloned().collect(),
            format!("{victim}: in the manifest but not in the bundle"),
        ),
    ];
    for (what, fs, line) in cases {
        let t = d.join(format!("{what}.tar.gz"));
        retar(&t, &fs);
        let (code, out, err) = check(&t);
        assert_eq!(code, 1, "{what}: {out}{err}");
        assert!(out.contains(&line), "{what}: {line:?} in {out}");
    }
}

#[test]
fn a_malformed_bundle_is_exit_2() {
    let d = tmpdir("bundle-malformed");
    let text = d.join("text.tar.gz");
    std::fs::write(&text, "not a bundle").unwrap();
    let gz_not_tar = d.join("gz.tar.gz");
    {
        use std::io::Write;
        let mut g = flate2::write::GzEncoder::new(std::fs::File::create(&gz_not_tar).unwrap(), flate2::Compression::fast());
        g.write_all(&[7u8; 3000]).unwrap();
        g.finish().unwrap();
    }
    let no_manifest = d.join("nomanifest.tar.gz");
    retar(&no_manifest, &[("kvprobe-bundle/report.json".into(), b"{}".to_vec())]);
    let bad_json = d.join("badjson.tar.gz");
    retar(&bad_json, &[("kvprobe-bundle/manifest.json".into(), b"{ not json".to_vec())]);
    let outside = d.join("outside.tar.gz");
    retar(&outside, &[("elsewhere/manifest.json".into(), b"{}".to_vec())]);
    let truncated = d.join("truncated.tar.gz");
    std::fs::write(&truncated, &std::fs::read(&no_manifest).unwrap()[..20]).unwrap();
    for p in [&text, &gz_not_tar, &no_manifest, &bad_json, &outside, &truncated, &d.join("absent.tar.gz")] {
        let (code, out, err) = check(p);
        assert_eq!(code, 2, "{}: {out}{err}", p.display());
        assert!(err.contains("kvprobe: "), "{err}");
    }
}

#[test]
fn kvprobe_bundle_packs_an_existing_report_and_dump_redacted() {
    let (d, code, _, log) = run_dump("bundle-cmd", &["--iterations", "2"]);
    assert_eq!(code, 1, "{log}");
    let b = d.join("b.tgz");
    let (code, out, err) = kvprobe(&[
        "bundle",
        "--report",
        d.join("r.json").to_str().unwrap(),
        "--dump",
        d.join("D").to_str().unwrap(),
        "--redact",
        "-o",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "{out}{err}");
    let files = untar(&b);
    let m: Value = serde_json::from_slice(&files[0].1).unwrap();
    assert_eq!((m["capture_made"].as_str(), m["redacted"].as_bool()), (Some("bundle"), Some(true)));
    let report = String::from_utf8(files.iter().find(|f| f.0 == "kvprobe-bundle/report.json").unwrap().1.clone()).unwrap();
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    let r: Value = serde_json::from_str(&report).expect("still JSON");
    assert_ne!(r["environment"]["hostname"].as_str().unwrap(), host);
    assert!(r["environment"]["hostname"].as_str().unwrap().starts_with("host-"));
    // `report diff` of the redacted bundle against its own report: what redaction hid (the
    // host name) is not a difference; the host name is listed among the fields that agree.
    let (code, out, err) = kvprobe(&["report", "diff", d.join("r.json").to_str().unwrap(), b.to_str().unwrap()]);
    assert!(code == 0 || code == 1, "{out}{err}");
    let differences = out.split("\nsame (").next().unwrap();
    assert!(!differences.contains("hostname"), "the redacted host name listed as a difference:\n{out}");
    let host_row = out.lines().find(|l| l.contains("hostname")).unwrap_or_else(|| panic!("{out}"));
    assert!(host_row.contains(&host) && host_row.contains("(redacted: host-"), "{host_row}");
    // Without --dump: the directory the report names.
    let b2 = d.join("b2.tgz");
    let (code, out, err) = kvprobe(&["bundle", "--report", d.join("r.json").to_str().unwrap(), "-o", b2.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(untar(&b2).iter().any(|f| f.0 == "kvprobe-bundle/dump/index.json"));
    assert_eq!(check(&b2).0, 0);
    // Not a run or ab report, a missing dump directory: exit 2.
    let (code, _, err) = kvprobe(&["bundle", "--report", d.join("j.xml").to_str().unwrap(), "-o", b.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    let (code, _, err) = kvprobe(&[
        "bundle",
        "--report",
        d.join("r.json").to_str().unwrap(),
        "--dump",
        d.join("nope").to_str().unwrap(),
        "-o",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
}

#[test]
fn a_full_disk_stops_the_dump_and_never_the_run() {
    // KVPROBE_TEST_DUMP_FULL_AFTER: slice writes after the first 3 fail with ENOSPC.
    let d = tmpdir("dump-full");
    let (dump, r, b) = (d.join("D"), d.join("r.json"), d.join("b.tgz"));
    let (code, out, err) = crate::common::kvprobe_env(
        &[
            "run",
            "--memory",
            "dram",
            "--iterations",
            "2",
            "--inject",
            "torn:2",
            "--inject",
            "bitflip:2",
            "--dump",
            dump.to_str().unwrap(),
            "--report",
            r.to_str().unwrap(),
            "--bundle",
            b.to_str().unwrap(),
        ],
        &[("KVPROBE_TEST_DUMP_FULL_AFTER", "3")],
    );
    assert_eq!(code, 1, "the run's own outcome: {out}{err}");
    let rep = read_report(&r);
    assert_eq!(rep["summary"]["blocks_corrupt"], 8, "{out}");
    assert_eq!(rep["failures"].as_array().unwrap().len(), 8, "every failure still listed");
    let why = rep["dump"]["dump_truncated"].as_str().expect("dump_truncated");
    assert!(why.contains("No space left on device"), "{why}");
    assert_eq!(rep["dump"]["slices_written"], 3);
    assert_eq!(rep["dump"]["slices_omitted"], 5);
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dump.join("index.json")).unwrap()).unwrap();
    assert_eq!(index["slices"].as_array().unwrap().len(), 3);
    assert!(index["dump_truncated"].as_str().unwrap().contains("No space left on device"));
    assert_eq!(std::fs::read_dir(dump.join("slices")).unwrap().count(), 3, "no partial file left");
    // What was dumped still checks out.
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn a_run_the_watchdog_ends_still_leaves_a_dump_that_agrees_with_its_report() {
    // Four pipeline stages: stage 0 is verified (its torn slices dumped) while later stages
    // are in flight; then, armed from iteration 1 stage 1, the post of stage 3 never returns:
    // the watchdog writes the report last published (set-up's, before the slices found in
    // stage 0 were counted) and exits 4; the dump drops what that report does not list.
    let d = tmpdir("dump-watchdog");
    let (dump, r) = (d.join("D"), d.join("r.json"));
    let (code, out, err) = crate::common::kvprobe_env(
        &[
            "run",
            "--memory",
            "dram",
            "--pipeline-stages",
            "4",
            // 64 torn slices over 4 layers: stage 0 (layer 0) holds some (none: odds (3/4)^64).
            "--inject",
            "torn:64",
            "--iterations",
            "3",
            "--timeout",
            "1",
            "--dump",
            dump.to_str().unwrap(),
            "--report",
            r.to_str().unwrap(),
        ],
        &[("KVPROBE_TEST_STALL_POST", "3600"), ("KVPROBE_TEST_STALL_FROM_ITERATION", "1:1")],
    );
    assert_eq!(code, 4, "{out}{err}");
    assert!(err.contains("did not return"), "the watchdog ended it: {err}");
    let rep = read_report(&r);
    assert_eq!(rep["outcome"]["exit_code"], 4, "{}", rep["outcome"]);
    let why = rep["dump"]["dump_truncated"].as_str().expect("the dump is recorded");
    assert!(why.contains("ended by the watchdog"), "{why}");
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dump.join("index.json")).expect("index.json")).unwrap();
    assert_eq!(index["dump_truncated"].as_str(), Some(why));
    let n = assert_dump_matches_capped(&dump, &rep, "watchdog");
    assert_eq!(n, rep["failures"].as_array().unwrap().len());
    assert_eq!(std::fs::read_dir(dump.join("slices")).unwrap().count(), n, "no file the index does not list");
}

#[test]
fn kvprobe_bundle_finds_a_relative_dump_beside_its_report_or_says_it_is_gone() {
    // The run is started in its own folder with a relative --dump, then bundled from another
    // directory: the dump is found beside the report; once it is gone, exit 2 naming it.
    let d = crate::common::tmpdir("bundle-rel");
    let run = std::process::Command::new(crate::common::bin())
        .current_dir(&d)
        .args(["run", "--memory", "dram", "--iterations", "1", "--inject", "torn:2", "--dump", "D", "--report", "r.json"])
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(1), "{}", String::from_utf8_lossy(&run.stderr));
    let (r, b) = (d.join("r.json"), d.join("b.tar.gz"));
    let bundle = |cwd: &str| {
        std::process::Command::new(crate::common::bin())
            .current_dir(cwd)
            .args(["bundle", "--report", r.to_str().unwrap(), "-o", b.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let o = bundle("/");
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    let (code, out, err) = crate::common::kvprobe(&["report", "check", b.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("2 dumped slices re-derived"), "{out}");
    std::fs::remove_dir_all(d.join("D")).unwrap();
    let o = bundle("/");
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("2 slices were dumped into D") && err.contains("give --dump DIR"), "{err}");
}

/// `kvprobe bundle ARGS`: (exit code, stdout + stderr), never a panic.
fn bundle_cmd(args: &[&str]) -> (i32, String) {
    let mut a = vec!["bundle"];
    a.extend_from_slice(args);
    let (code, out, err) = kvprobe(&a);
    assert!(!err.contains("panicked"), "{err}");
    (code, format!("{out}{err}"))
}

/// The paths below `kvprobe-bundle/dump/` in the bundle `b`, sorted.
fn dump_paths(b: &Path) -> Vec<String> {
    let mut v: Vec<String> =
        untar(b).into_iter().filter_map(|(n, _)| n.strip_prefix("kvprobe-bundle/dump/").map(str::to_string)).collect();
    v.sort();
    v
}

#[test]
fn kvprobe_bundle_takes_only_a_kvprobe_dump_and_only_its_own_files() {
    // D3: a directory that is not a dump is refused (exit 2, nothing written); a real dump
    // with other files in it (a note naming the host, the report itself, an unlisted file in
    // slices/) gives only index.json, the listed slices and the script.
    let (d, code, r, log) = run_dump("bundle-only-dump", &["--iterations", "1"]);
    assert_eq!(code, 1, "{log}");
    let dump = d.join("D");
    let b = d.join("b.tgz");
    for not_a_dump in [Path::new("/etc"), &d.join("D/scripts")] {
        let (code, log) = bundle_cmd(&[
            "--report",
            d.join("r.json").to_str().unwrap(),
            "--dump",
            not_a_dump.to_str().unwrap(),
            "-o",
            b.to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "{}: {log}", not_a_dump.display());
        assert!(log.contains("not a kvprobe dump"), "{log}");
        assert!(!b.exists(), "nothing written");
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    std::fs::write(dump.join("notes.txt"), format!("pair on {host}\n")).unwrap();
    std::fs::write(dump.join("slices/extra.bin"), b"not listed").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", dump.join("passwd")).unwrap();
    // D2: the report copied into the dump and bundled from there, redacted.
    std::fs::copy(d.join("r.json"), dump.join("r.json")).unwrap();
    let (code, log) = bundle_cmd(&[
        "--report",
        dump.join("r.json").to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
        "--redact",
        "-o",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{log}");
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dump.join("index.json")).unwrap()).unwrap();
    let mut want: Vec<String> =
        index["slices"].as_array().unwrap().iter().map(|s| s["file"].as_str().unwrap().to_string()).collect();
    want.push("index.json".into());
    want.push("scripts/fingerprint_ref.py".into());
    want.sort();
    assert_eq!(want.len(), r["dump"]["slices_written"].as_u64().unwrap() as usize + 2);
    assert_eq!(dump_paths(&b), want, "only the dump's own files");
    for (name, body) in untar(&b) {
        if !name.ends_with(".bin") {
            assert!(!names(&String::from_utf8_lossy(&body), &host), "{name} names the host");
        }
    }
    assert_eq!(check(&b).0, 0);
    // A listed slice that leaves the dump: `..`, an absolute path, a symbolic link out.
    let first = index["slices"][0]["file"].as_str().unwrap().to_string();
    let bad_index = |file: &str| {
        let mut ix = index.clone();
        ix["slices"][0]["file"] = file.into();
        std::fs::write(dump.join("index.json"), serde_json::to_vec_pretty(&ix).unwrap()).unwrap();
    };
    for file in ["../r.json", "/etc/passwd", "passwd"] {
        bad_index(file);
        let (code, log) = bundle_cmd(&[
            "--report",
            d.join("r.json").to_str().unwrap(),
            "--dump",
            dump.to_str().unwrap(),
            "-o",
            d.join("x.tgz").to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "{file}: {log}");
        assert!(log.contains(file), "{log}");
        assert!(!d.join("x.tgz").exists());
    }
    bad_index(&first);
    let slice = dump.join(&first);
    std::fs::remove_file(&slice).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", &slice).unwrap();
    let (code, log) = bundle_cmd(&[
        "--report",
        d.join("r.json").to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
        "-o",
        d.join("x.tgz").to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("leads outside the dump"), "{log}");
}

#[test]
fn kvprobe_bundle_refuses_another_runs_dump() {
    // D4: a dump of another seed, geometry or failures, or of the other kind (ab for run and
    // the reverse), is refused naming what differs; an unrelated `D` found from the report's
    // relative dump.dir too.
    let (a, code, _, log) = run_dump("bundle-other-a", &["--iterations", "1"]);
    assert_eq!(code, 1, "{log}");
    let (seed, code, _, log) = run_dump("bundle-other-seed", &["--iterations", "1", "--seed", "7"]);
    assert_eq!(code, 1, "{log}");
    let (geo, code, _, log) = run_dump("bundle-other-geo", &["--iterations", "1", "--blocks", "32"]);
    assert_eq!(code, 1, "{log}");
    let (fail, code, _, log) = run_dump("bundle-other-fail", &["--iterations", "2"]);
    assert_eq!(code, 1, "{log}");
    let report = a.join("r.json");
    let b = a.join("b.tgz");
    for (dir, says) in [(&seed, "seed: report 1, dump 7"), (&geo, "geometry: report"), (&fail, "")] {
        let (code, log) = bundle_cmd(&[
            "--report",
            report.to_str().unwrap(),
            "--dump",
            dir.join("D").to_str().unwrap(),
            "-o",
            b.to_str().unwrap(),
        ]);
        assert_eq!(code, 2, "{}: {log}", dir.display());
        assert!(log.contains("another run's dump") && log.contains(says), "{log}");
        assert!(!b.exists());
    }
    // Same seed and geometry, more iterations: the dump's slices are not a's failures.
    let (code, log) = bundle_cmd(&[
        "--report",
        fail.join("r.json").to_str().unwrap(),
        "--dump",
        a.join("D").to_str().unwrap(),
        "-o",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("another run's dump") && log.contains("slices: the report says"), "{log}");
    // Same seed, geometry and count, but a slice's record is not the report's failure.
    let ix_path = a.join("D/index.json");
    let mut ix: Value = serde_json::from_str(&std::fs::read_to_string(&ix_path).unwrap()).unwrap();
    let i = ix["slices"][0]["report_index"].as_u64().unwrap();
    let block = ix["slices"][0]["block"].as_u64().unwrap();
    ix["slices"][0]["block"] = (block + 1).into();
    std::fs::write(&ix_path, serde_json::to_vec_pretty(&ix).unwrap()).unwrap();
    let (code, log) =
        bundle_cmd(&["--report", report.to_str().unwrap(), "--dump", a.join("D").to_str().unwrap(), "-o", b.to_str().unwrap()]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains(&format!("block: report failures[{i}] {block}, dump {}", block + 1)), "{log}");
    ix["slices"][0]["block"] = block.into();
    std::fs::write(&ix_path, serde_json::to_vec_pretty(&ix).unwrap()).unwrap();
    // An ab dump and report.
    let ab = tmpdir("bundle-other-ab");
    let (code, out, err) = kvprobe(&[
        "ab",
        "--memory",
        "dram",
        "--requests",
        "200",
        "--lockstep",
        "--dump",
        ab.join("D").to_str().unwrap(),
        "--report",
        ab.join("ab.json").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, log) =
        bundle_cmd(&["--report", report.to_str().unwrap(), "--dump", ab.join("D").to_str().unwrap(), "-o", b.to_str().unwrap()]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("an ab dump"), "{log}");
    let (code, log) = bundle_cmd(&[
        "--report",
        ab.join("ab.json").to_str().unwrap(),
        "--dump",
        a.join("D").to_str().unwrap(),
        "-o",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("a run's dump"), "{log}");
    // ab rows matched by name: a corrupt row's folder swapped with a clean row's is refused.
    let abr = read_report(&ab.join("ab.json"));
    let rows = abr["rows"].as_array().unwrap();
    let bad = rows.iter().find(|r| r["corrupt"].as_u64() > Some(0)).unwrap()["name"].as_str().unwrap();
    let good = rows.iter().find(|r| r["corrupt"].as_u64() == Some(0)).unwrap()["name"].as_str().unwrap();
    let (code, log) = bundle_cmd(&[
        "--report",
        ab.join("ab.json").to_str().unwrap(),
        "--dump",
        ab.join("D").to_str().unwrap(),
        "-o",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "the ab dump as written: {log}");
    std::fs::remove_file(&b).unwrap();
    let dd = ab.join("D");
    std::fs::rename(dd.join(bad), dd.join("tmp")).unwrap();
    std::fs::rename(dd.join(good), dd.join(bad)).unwrap();
    std::fs::rename(dd.join("tmp"), dd.join(good)).unwrap();
    let (code, log) = bundle_cmd(&[
        "--report",
        ab.join("ab.json").to_str().unwrap(),
        "--dump",
        dd.to_str().unwrap(),
        "-o",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("another run's dump"), "{log}");
    // The implicit fallback: a relative dump.dir `D`, gone beside the report, and an unrelated
    // `D` in the current directory.
    let rel = tmpdir("bundle-other-rel");
    let o = std::process::Command::new(crate::common::bin())
        .current_dir(&rel)
        .args(["run", "--memory", "dram", "--iterations", "1", "--inject", "torn:2", "--dump", "D", "--report", "r.json"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_dir_all(rel.join("D")).unwrap();
    let o = std::process::Command::new(crate::common::bin())
        .current_dir(&seed)
        .args(["bundle", "--report", rel.join("r.json").to_str().unwrap(), "-o", b.to_str().unwrap()])
        .output()
        .unwrap();
    let log = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{log}");
    assert!(log.contains("another run's dump") && log.contains("give --dump DIR"), "{log}");
    assert!(!b.exists());
}

#[test]
fn a_redacted_bundle_passes_check_and_show_when_the_user_is_named_like_a_report_word() {
    // D6: USER equal to a class (`torn`) or a report key (`expected`) renames neither.
    let data = std::env::var("KVPROBE_HOME").unwrap_or_else(|_| {
        std::env::var("XDG_DATA_HOME")
            .map(|x| format!("{x}/kvprobe"))
            .unwrap_or_else(|_| format!("{}/.local/share/kvprobe", std::env::var("HOME").unwrap()))
    });
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap().trim().to_string();
    for user in ["torn", "expected"] {
        let d = tmpdir(&format!("bundle-user-{user}"));
        let (r, b) = (d.join("r.json"), d.join("b.tgz"));
        let home = format!("/home/{user}");
        let (code, out, err) = crate::common::kvprobe_env(
            &[
                "run",
                "--memory",
                "dram",
                "--iterations",
                "1",
                "--inject",
                "torn",
                "--inject",
                "bitflip",
                "--report",
                r.to_str().unwrap(),
                "--bundle",
                b.to_str().unwrap(),
                "--redact",
            ],
            &[("USER", user), ("LOGNAME", user), ("HOME", &home), ("KVPROBE_HOME", &data)],
        );
        assert_eq!(code, 1, "{user}: {out}{err}");
        let (code, out, err) = check(&b);
        assert_eq!(code, 0, "{user}: {out}{err}");
        let (code, out, err) = kvprobe(&["report", "show", b.to_str().unwrap()]);
        assert_eq!(code, 0, "{user}: {out}{err}");
        let files = untar(&b);
        let rep: Value = serde_json::from_slice(&files.iter().find(|f| f.0 == "kvprobe-bundle/report.json").unwrap().1).unwrap();
        let classes: Vec<&str> = rep["failures"].as_array().unwrap().iter().map(|f| f["class"].as_str().unwrap()).collect();
        assert!(classes.contains(&"torn") && classes.contains(&"bitflip"), "{user}: {classes:?}");
        assert!(rep["failures"][0]["expected"].is_object(), "{user}: the key `expected` kept");
        assert!(rep["environment"]["hostname"].as_str().unwrap().starts_with("host-"), "{user}: still redacted");
        let cap: Value =
            serde_json::from_slice(&files.iter().find(|f| f.0 == "kvprobe-bundle/env/capture.json").unwrap().1).unwrap();
        assert!(cap["sources"].is_array(), "{user}: capture.json keeps its keys");
        assert!(!names(&String::from_utf8_lossy(&files.iter().find(|f| f.0 == "kvprobe-bundle/report.json").unwrap().1), &host));
    }
}

#[test]
fn kvprobe_bundle_refuses_to_write_over_its_report_or_into_its_dump() {
    // D5: -o is the report (by another spelling, or a hard link to it) or inside the dump.
    let (d, code, _, log) = run_dump("bundle-self", &["--iterations", "1"]);
    assert_eq!(code, 1, "{log}");
    let report = d.join("r.json");
    let before = std::fs::read(&report).unwrap();
    std::fs::hard_link(&report, d.join("link.json")).unwrap();
    let dump = d.join("D");
    let spelled = format!("{}/D/../r.json", d.display());
    let link = d.join("link.json");
    let inside = dump.join("b.tgz");
    let deeper = format!("{}/./D/slices/b.tgz", d.display());
    for o in [report.to_str().unwrap(), spelled.as_str(), link.to_str().unwrap(), inside.to_str().unwrap(), deeper.as_str()] {
        let (code, log) = bundle_cmd(&["--report", report.to_str().unwrap(), "--dump", dump.to_str().unwrap(), "-o", o]);
        assert_eq!(code, 2, "{o}: {log}");
        assert!(log.contains("-o "), "{log}");
    }
    assert_eq!(std::fs::read(&report).unwrap(), before, "the report is untouched");
    assert!(!inside.exists() && !dump.join("slices/b.tgz").exists());
    // Without --dump, the dump the report names counts as well.
    let (code, log) = bundle_cmd(&["--report", report.to_str().unwrap(), "-o", inside.to_str().unwrap()]);
    assert_eq!(code, 2, "{log}");
    assert!(!inside.exists());
}

/// `files` with the JSON entry `name` (under `kvprobe-bundle/`) changed by `f` and the
/// manifest updated to its new size and SHA-256 (so only the consistency checks can see it).
pub fn edit_json(files: &[(String, Vec<u8>)], name: &str, f: &dyn Fn(&mut Value)) -> Vec<(String, Vec<u8>)> {
    let mut fs = files.to_vec();
    let full = format!("kvprobe-bundle/{name}");
    let e = fs.iter_mut().find(|x| x.0 == full).unwrap_or_else(|| panic!("{name} in bundle"));
    let mut v: Value = serde_json::from_slice(&e.1).unwrap();
    f(&mut v);
    e.1 = serde_json::to_vec_pretty(&v).unwrap();
    let (sha, len) = (sha256_hex(&e.1), e.1.len());
    let m = fs.iter_mut().find(|x| x.0 == "kvprobe-bundle/manifest.json").unwrap();
    let mut mv: Value = serde_json::from_slice(&m.1).unwrap();
    for x in mv["files"].as_array_mut().unwrap() {
        if x["path"] == name {
            x["sha256"] = sha.clone().into();
            x["bytes"] = len.into();
        }
    }
    m.1 = serde_json::to_vec(&mv).unwrap();
    fs
}

#[test]
fn check_finds_report_and_index_that_disagree_on_seed_geometry_dump_and_outcome() {
    let (d, b) = torn_bundle("bundle-consistency", true);
    assert_eq!(check(&b).0, 0);
    let files = untar(&b);
    type Edit = Box<dyn Fn(&mut Value)>;
    // (case, file edited, edit, exit code, line expected)
    let cases: Vec<(&str, &str, Edit, i32, &str)> = vec![
        ("index-schema", "dump/index.json", Box::new(|v| v["schema"] = "kvprobe.dump/9".into()), 2, "is not kvprobe.dump/1"),
        // A dump of the byte-offset fingerprint (kvprobes before version 2) is refused, not
        // misread: its own scripts/fingerprint_ref.py regenerates it.
        (
            "index-fingerprint-1",
            "dump/index.json",
            Box::new(|v| v["fingerprint"] = "kvprobe.fingerprint/1".into()),
            2,
            "index.json: fingerprint \"kvprobe.fingerprint/1\": this kvprobe checks kvprobe.fingerprint/2",
        ),
        // The report and its dump agree on the fingerprint (a report of an older kvprobe has none).
        (
            "report-fingerprint",
            "report.json",
            Box::new(|v| v["config"]["fingerprint"] = "kvprobe.fingerprint/1".into()),
            1,
            "report: config.fingerprint: report kvprobe.fingerprint/1, dump/index.json kvprobe.fingerprint/2",
        ),
        (
            "report-poison-iteration",
            "report.json",
            Box::new(|v| v["failures"][0]["poison_iteration"] = (1u64 << 24).into()),
            1,
            "poison_iteration: 16777216, a sweep's is its iteration",
        ),
        // A token_base the fingerprint cannot name is a disagreement, never a panic.
        (
            "index-token-base",
            "dump/index.json",
            Box::new(|v| v["slices"][0]["expected"]["token_base"] = 65521.into()),
            1,
            "expected.token_base 65521: invalid geometry: tokens 65521..",
        ),
        (
            "report-seed-hex",
            "report.json",
            Box::new(|v| v["config"]["seed_hex"] = "0x1".into()),
            1,
            "config.seed_hex: report 0x1",
        ),
        ("index-seed-hex", "dump/index.json", Box::new(|v| v["seed_hex"] = "0x2".into()), 1, "seed_hex: index 0x2"),
        (
            "index-geometry",
            "dump/index.json",
            Box::new(|v| v["geometry"]["num_blocks"] = 7.into()),
            1,
            "dump/index.json: geometry: report",
        ),
        (
            "geometry-slice-bytes",
            "report.json",
            Box::new(|v| {
                let n = v["config"]["geometry"]["head_size"].as_u64().unwrap();
                v["config"]["geometry"]["head_size"] = (n * 2).into();
            }),
            1,
            "dump/index.json: slice_bytes: index",
        ),
        ("geometry-invalid", "report.json", Box::new(|v| v["config"]["geometry"]["num_blocks"] = 0.into()), 2, "config.geometry"),
        // 2^31 blocks: more slices than the 32-bit slot holds (a reviewer saw the slot wrap).
        (
            "geometry-2^31-blocks",
            "report.json",
            Box::new(|v| v["config"]["geometry"]["num_blocks"] = (1u64 << 31).into()),
            2,
            "report: config.geometry: ",
        ),
        (
            "dump-block-missing",
            "report.json",
            Box::new(|v| v.as_object_mut().unwrap().remove("dump").map(|_| ()).unwrap()),
            1,
            "report: dump: none",
        ),
        (
            "dump-slices",
            "report.json",
            Box::new(|v| v["dump"]["slices_written"] = 99.into()),
            1,
            "report: dump.slices_written: report 99",
        ),
        (
            "dump-bytes",
            "report.json",
            Box::new(|v| v["dump"]["bytes_written"] = 5.into()),
            1,
            "report: dump.bytes_written: report 5",
        ),
        ("dump-cap", "report.json", Box::new(|v| v["dump"]["max_bytes"] = 5.into()), 1, "report: dump.max_bytes: report 5"),
        (
            "dump-truncated",
            "report.json",
            Box::new(|v| v["dump"]["dump_truncated"] = "disk full".into()),
            1,
            "report: dump.dump_truncated",
        ),
        (
            "outcome-clean",
            "report.json",
            Box::new(|v| {
                v["outcome"]["status"] = "clean".into();
                v["outcome"]["exit_code"] = 0.into();
            }),
            1,
            "report: outcome: status \"clean\"",
        ),
        (
            "corrupt-count",
            "report.json",
            Box::new(|v| v["summary"]["blocks_corrupt"] = 0.into()),
            1,
            "report: summary.blocks_corrupt: 0",
        ),
        (
            "iteration-0",
            "report.json",
            Box::new(|v| v["failures"][0]["iteration"] = 0.into()),
            1,
            "report: failures[0].iteration: 0",
        ),
    ];
    for (what, file, f, want, line) in cases {
        let t = d.join(format!("{what}.tar.gz"));
        retar(&t, &edit_json(&files, file, &*f));
        let (code, out, err) = check(&t);
        assert_eq!(code, want, "{what}: {out}{err}");
        assert!(out.contains(line) || err.contains(line), "{what}: {line:?} in {out}{err}");
    }
}

/// Writes at `p` a bundle of `files` (the first entries, as `retar` would) followed by the
/// entry `big` of `size` zero bytes, without holding them: the zeros are 1 MiB gzip members
/// repeated (a gzip stream may have several). `size` is a multiple of 1 MiB.
pub fn retar_with_zeros(p: &Path, files: &[(String, Vec<u8>)], big: &str, size: u64) {
    use std::io::Write;
    let mut t = tar::Builder::new(Vec::new());
    for (name, body) in files {
        let mut h = tar::Header::new_gnu();
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        t.append_data(&mut h, name, body.as_slice()).unwrap();
    }
    let mut head = t.into_inner().unwrap();
    head.truncate(head.len() - 1024); // the end-of-archive blocks come after the zeros
    let mut h = tar::Header::new_gnu();
    h.set_path(big).unwrap();
    h.set_size(size);
    h.set_mode(0o644);
    h.set_entry_type(tar::EntryType::Regular);
    h.set_cksum();
    head.extend_from_slice(h.as_bytes());
    let gz = |b: &[u8]| {
        let mut g = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        g.write_all(b).unwrap();
        g.finish().unwrap()
    };
    let mut out = std::fs::File::create(p).unwrap();
    out.write_all(&gz(&head)).unwrap();
    let mib = gz(&vec![0u8; 1 << 20]);
    // The body, then the end-of-archive blocks (zeros too).
    for _ in 0..size / (1 << 20) + 1 {
        out.write_all(&mib).unwrap();
    }
}

/// `kvprobe ARGS` with its address space limited to `mib` MiB: (exit code, stdout, stderr).
pub fn kvprobe_limited(mib: u64, args: &[&str]) -> (i32, String, String) {
    let o = std::process::Command::new("prlimit")
        .arg(format!("--as={}", mib << 20))
        .arg(crate::common::bin())
        .args(args)
        .output()
        .expect("prlimit");
    (o.status.code().unwrap_or(-1), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
}

#[test]
fn check_and_show_read_a_bundle_boundedly() {
    let (d, b) = torn_bundle("bundle-bounds", false);
    let files = untar(&b);
    let limit = 512; // MiB of address space; the 1 GiB entries below cannot be held
    const GIB: u64 = 1 << 30;
    // An unlisted 1 GiB entry (a gzip bomb of ~1 MB): named, never read.
    let bomb = d.join("bomb.tar.gz");
    retar_with_zeros(&bomb, &files, "kvprobe-bundle/env/huge.bin", GIB);
    let (code, out, err) = kvprobe_limited(limit, &["report", "check", bomb.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("env/huge.bin: in the bundle but not in the manifest"), "{out}");
    // `report show` reads the manifest and the report only.
    let (code, out, err) = kvprobe_limited(limit, &["report", "show", bomb.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    // A listed entry longer than listed: a size disagreement, read only to its size + 1.
    let mut fs = files.clone();
    let mut mv: Value = serde_json::from_slice(&fs[0].1).unwrap();
    mv["files"].as_array_mut().unwrap().push(serde_json::json!({"path": "env/huge.bin", "bytes": 10, "sha256": "00"}));
    fs[0].1 = serde_json::to_vec(&mv).unwrap();
    let long = d.join("long.tar.gz");
    retar_with_zeros(&long, &fs, "kvprobe-bundle/env/huge.bin", GIB);
    let (code, out, err) = kvprobe_limited(limit, &["report", "check", long.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(out.contains("env/huge.bin: bytes: manifest 10, file more than 10"), "{out}");
    // Listed at its true 1 GiB under a 512 MiB limit: hashed as it streams past, never held
    // (a 2 MB bundle listing a 2 GiB entry once grew to 2.1 GB), so its digest is compared.
    mv["files"].as_array_mut().unwrap().last_mut().unwrap()["bytes"] = GIB.into();
    fs[0].1 = serde_json::to_vec(&mv).unwrap();
    let listed = d.join("listed.tar.gz");
    retar_with_zeros(&listed, &fs, "kvprobe-bundle/env/huge.bin", GIB);
    let (code, out, err) = kvprobe_limited(limit, &["report", "check", listed.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}{err}");
    // SHA-256 of 1 GiB of zeros.
    let zeros = "49bc20df15e412a64472421e13fe86ff1c5165e18b2afccf160d4dc19fe68a14";
    assert!(out.contains(&format!("env/huge.bin: sha256: manifest 00, file {zeros}")), "{out}");
    assert!(!out.contains("env/huge.bin: bytes"), "{out}");
    // Listed sizes over the 16 GiB cap: too large, before any body is read.
    mv["files"].as_array_mut().unwrap().last_mut().unwrap()["bytes"] = (17 * GIB).into();
    fs[0].1 = serde_json::to_vec(&mv).unwrap();
    let big = d.join("big.tar.gz");
    retar(&big, &fs);
    let (code, out, err) = check(&big);
    assert_eq!(code, 2, "{out}{err}");
    assert!(err.contains(&format!("{}: too large", big.display())), "{err}");
}

#[test]
fn a_bundle_with_no_manifest_a_foreign_directory_or_too_many_entries_is_malformed_naming_it() {
    let d = tmpdir("bundle-shape");
    let files = [
        ("kvprobe-bundle/manifest.json".to_string(), b"{}".to_vec()),
        ("kvprobe-bundle/report.json".to_string(), b"{}".to_vec()),
    ];
    // Directory entries (as `tar czf` writes them) are skipped inside kvprobe-bundle/; one
    // outside it is not a bundle's.
    let with_dirs = |p: &Path, dirs: &[&str]| {
        let gz = flate2::write::GzEncoder::new(std::fs::File::create(p).unwrap(), flate2::Compression::fast());
        let mut t = tar::Builder::new(gz);
        for dir in dirs {
            let mut h = tar::Header::new_gnu();
            h.set_size(0);
            h.set_mode(0o755);
            h.set_entry_type(tar::EntryType::Directory);
            t.append_data(&mut h, dir, std::io::empty()).unwrap();
        }
        t.into_inner().unwrap().finish().unwrap();
    };
    let dir = d.join("dir.tar.gz");
    with_dirs(&dir, &["./", "kvprobe-bundle/"]);
    let outside = d.join("outside.tar.gz");
    with_dirs(&outside, &["kvprobe-bundle/", "etc/"]);
    // A late manifest is read (a second pass), and judged as any manifest.
    let late = d.join("late.tar.gz");
    retar(&late, &[files[1].clone(), files[0].clone()]);
    let empty = d.join("empty.tar.gz");
    retar(&empty, &[]);
    // A valid manifest followed by more unlisted entries than are named one by one.
    let many = d.join("many.tar.gz");
    let manifest = br#"{"schema":"kvprobe.manifest/1","kvprobe_version":"0","created_unix":0,"redacted":false,"capture_made":"run","report":"report.json","files":[]}"#;
    let mut fs = vec![("kvprobe-bundle/manifest.json".to_string(), manifest.to_vec())];
    fs.extend((0..1001).map(|i| (format!("kvprobe-bundle/env/x{i}"), Vec::new())));
    retar(&many, &fs);
    for (p, line) in [
        (&many, "more than 1000 entries the manifest does not list".to_string()),
        (&dir, format!("{}: no kvprobe-bundle/manifest.json", dir.display())),
        (&outside, "etc/ is a directory outside kvprobe-bundle/".to_string()),
        (&late, "kvprobe-bundle/manifest.json is not a manifest".into()),
        (&empty, format!("{}: no kvprobe-bundle/manifest.json", empty.display())),
    ] {
        for cmd in ["check", "show"] {
            let (code, out, err) = kvprobe(&["report", cmd, p.to_str().unwrap()]);
            assert_eq!(code, 2, "{cmd} {}: {out}{err}", p.display());
            assert!(err.contains(&line) && err.contains(&p.display().to_string()), "{cmd}: {line:?} in {err}");
        }
    }
}

/// True when `text` holds `host` as a whole name: not inside a longer word (a two-letter host
/// name such as `vm` is inside many words of a kernel module's parameter list).
fn names(text: &str, host: &str) -> bool {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    text.match_indices(host).any(|(i, _)| {
        let before = text[..i].chars().next_back();
        let after = text[i + host.len()..].chars().next();
        !before.is_some_and(word) && !after.is_some_and(word)
    })
}

/// The base bundle of the 2026-12 audit (M3): `run --memory dram --iterations 1 --inject
/// torn:2 --inject bitflip --inject misroute --dump D --bundle B`, in a fresh directory
/// `name`; asserts exit 1 and that `report check` passes it. Returns (the directory, the bundle).
fn injected_bundle(name: &str) -> (PathBuf, PathBuf) {
    let d = tmpdir(name);
    let (b, dd) = (d.join("b.tar.gz"), d.join("D"));
    let (code, out, err) = kvprobe(&[
        "run",
        "--memory",
        "dram",
        "--iterations",
        "1",
        "--inject",
        "torn:2",
        "--inject",
        "bitflip",
        "--inject",
        "misroute",
        "--dump",
        dd.to_str().unwrap(),
        "--bundle",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "{out}{err}");
    (d, b)
}

/// A JSON entry of `files` (path below `kvprobe-bundle/`).
fn json_of(files: &[(String, Vec<u8>)], name: &str) -> Value {
    serde_json::from_slice(&files.iter().find(|f| f.0 == format!("kvprobe-bundle/{name}")).unwrap().1).unwrap()
}

/// `files` with every field `report check` derives from the slice bytes set to what it
/// derives (as the audit's `tools/fixup.py` did): check's `NAME: FIELD: index|report A, bytes
/// B` lines are applied to the index entry or report failure of that slice, until none is
/// left, so a forged bundle disagrees only where the bytes cannot tell.
fn fixup(dir: &Path, files: &[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)> {
    let re = regex::Regex::new(r"^(iteration \d+ layer \d+ \w+ block \d+): (\w+): (index|report) .*, (?:bytes|expected) (.*)$")
        .unwrap();
    let name = |v: &Value| {
        format!("iteration {} layer {} {} block {}", v["iteration"], v["layer"], v["kv"].as_str().unwrap_or("?"), v["block"])
    };
    let mut fs = files.to_vec();
    for _ in 0..3 {
        let t = dir.join("fixup.tar.gz");
        retar(&t, &fs);
        let (_, out, _) = check(&t);
        let fixes: Vec<(String, String, String, Value)> = out
            .lines()
            .filter_map(|l| re.captures(l))
            .map(|c| {
                let (field, raw) = (c[2].to_string(), c[4].to_string());
                let v = match (field.as_str(), raw.as_str()) {
                    (_, "none") => Value::Null,
                    ("class" | "expected_digest" | "actual_digest" | "displacement", _) => raw.clone().into(),
                    // Written as Rust's Debug of a string: JSON for these ASCII commands.
                    ("regenerate", _) => serde_json::from_str(&raw).unwrap(),
                    _ => serde_json::from_str(&raw).unwrap_or(raw.into()),
                };
                (c[1].to_string(), field, c[3].to_string(), v)
            })
            .collect();
        if fixes.is_empty() {
            return fs;
        }
        fs = edit_json(&fs, "dump/index.json", &|x| {
            for e in x["slices"].as_array_mut().unwrap() {
                for (n, k, _, v) in fixes.iter().filter(|f| f.2 == "index") {
                    if *n == name(e) {
                        e[k] = v.clone();
                    }
                }
            }
        });
        fs = edit_json(&fs, "report.json", &|x| {
            for e in x["failures"].as_array_mut().unwrap() {
                for (n, k, _, v) in fixes.iter().filter(|f| f.2 == "report") {
                    if *n == name(e) {
                        e[k] = v.clone();
                    }
                }
            }
        });
    }
    fs
}

/// Expects the slice record `e` to hold what it observed, of generation 2.
fn relabel(e: &mut Value) {
    let mut x = e["observed"].clone();
    x["generation"] = 2.into();
    e["expected"] = x;
}

#[test]
fn check_rederives_links_counts_identities_and_the_clean_outcome() {
    let (d, b) = injected_bundle("bundle-m3");
    let files = untar(&b);
    let index = json_of(&files, "dump/index.json");
    let slices = index["slices"].as_array().unwrap();
    let of = |class: &str| slices.iter().position(|e| e["class"] == class).unwrap_or_else(|| panic!("a {class} slice"));
    let (torn, misplaced) = (of("torn"), of("misplaced"));
    type Edit = Box<dyn Fn(&[(String, Vec<u8>)]) -> Vec<(String, Vec<u8>)>>;
    let cases: Vec<(&str, Edit, Vec<String>)> = vec![
        // (a) No entry tied to the report, and the report's torn failure now says bitflip.
        (
            "report-index-null",
            Box::new(move |f| {
                let f = edit_json(f, "dump/index.json", &|v| {
                    v["slices"].as_array_mut().unwrap().iter_mut().for_each(|e| e["report_index"] = Value::Null)
                });
                edit_json(&f, "report.json", &|v| {
                    v["failures"][torn]["class"] = "bitflip".into();
                    v["failures"][torn]["bad_bytes"] = 1.into();
                })
            }),
            vec![
                format!("report_index: none, but the report's failures[{torn}] is this slice"),
                "class: report bitflip, index torn".into(),
                "bad_bytes: report 1, index".into(),
            ],
        ),
        // (a) One report_index given to two entries; one file named by two entries; a file
        // outside slices/.
        (
            "report-index-twice",
            Box::new(move |f| edit_json(f, "dump/index.json", &|v| v["slices"][1]["report_index"] = 0.into())),
            vec!["report_index 0: also given to".into()],
        ),
        (
            "file-twice",
            Box::new(move |f| {
                edit_json(f, "dump/index.json", &|v| {
                    let first = v["slices"][0]["file"].clone();
                    v["slices"][1]["file"] = first;
                })
            }),
            vec![format!("file {}: also named by", slices[0]["file"].as_str().unwrap())],
        ),
        (
            "file-outside-slices",
            Box::new(move |f| edit_json(f, "dump/index.json", &|v| v["slices"][0]["file"] = "scripts/fingerprint_ref.py".into())),
            vec!["file \"scripts/fingerprint_ref.py\": not a file in dump/slices/".into()],
        ),
        // (b) The report counts 0 torn and 2 garbage; the index names neither class.
        (
            "by-class-union",
            Box::new(move |f| {
                let f = edit_json(f, "report.json", &|v| {
                    v["summary"]["by_class"]["torn"] = 0.into();
                    v["summary"]["by_class"]["garbage"] = 2.into();
                });
                edit_json(&f, "dump/index.json", &|v| {
                    let m = v["by_class"].as_object_mut().unwrap();
                    m.remove("torn");
                    m.remove("garbage");
                })
            }),
            vec![
                "dump/index.json: by_class.torn.written: index absent, slices listed 2".into(),
                "dump/index.json: by_class.garbage: report 2, index written absent + omitted absent".into(),
            ],
        ),
        // (c) The misplaced slice relabelled as stale: expected = what it holds, of a
        // generation the 1-iteration run never had; every derived field made to agree.
        (
            "misplaced-as-stale",
            Box::new({
                let d = d.clone();
                move |f| {
                    let f = edit_json(f, "dump/index.json", &|v| relabel(&mut v["slices"][misplaced]));
                    let f = edit_json(&f, "report.json", &|v| relabel(&mut v["failures"][misplaced]));
                    let f = fixup(&d, &f);
                    // The counts follow the new class.
                    let f = edit_json(&f, "report.json", &|v| {
                        v["summary"]["by_class"]["misplaced"] = 0.into();
                        v["summary"]["by_class"]["stale"] = 1.into();
                    });
                    edit_json(&f, "dump/index.json", &|v| {
                        v["by_class"]["misplaced"]["written"] = 0.into();
                        v["by_class"]["stale"]["written"] = 1.into();
                    })
                }
            }),
            vec![
                "but the sweep plan of iteration 1 (seed, config) puts".into(),
                "detected, but the failure at iteration 1 layer".into(),
            ],
        ),
    ];
    for (what, edit, lines) in cases {
        let t = d.join(format!("{what}.tar.gz"));
        let edited = edit(&files);
        retar(&t, &edited);
        let (code, out, err) = check(&t);
        assert_eq!(code, 1, "{what}: {out}{err}");
        for l in &lines {
            assert!(out.contains(l.as_str()), "{what}: {l:?} in {out}{err}");
        }
        if what == "misplaced-as-stale" {
            // Only what the plan and the injections re-derive can see it.
            let idx = json_of(&edited, "dump/index.json");
            assert_eq!(idx["slices"][misplaced]["class"], "stale", "{out}");
            assert!(
                out.lines().all(|l| l.contains("sweep plan") || l.contains("injections[") || l.contains("disagreement")),
                "{out}"
            );
        }
    }
}

#[test]
fn check_finds_a_clean_outcome_with_corrupt_or_uncompared_slices() {
    let d = tmpdir("bundle-clean-lie");
    let b = d.join("b.tar.gz");
    let (code, out, err) = kvprobe(&["run", "--memory", "dram", "--iterations", "1", "--bundle", b.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(check(&b).0, 0);
    let files = untar(&b);
    let t = d.join("lie.tar.gz");
    retar(
        &t,
        &edit_json(&files, "report.json", &|v| {
            v["summary"]["blocks_corrupt"] = 7.into();
            v["summary"]["by_class"]["garbage"] = 7.into();
            v["summary"]["slices_compared"] = 0.into();
            v["summary"]["bytes_compared"] = 0.into();
        }),
    );
    let (code, out, err) = check(&t);
    assert_eq!(code, 1, "{out}{err}");
    for l in [
        "report: outcome: status \"clean\" exit 0, but summary.blocks_corrupt is 7",
        "report: outcome: status \"clean\" exit 0, but summary.by_class.garbage is 7",
        "report: outcome: status \"clean\" exit 0, but summary.slices_compared is 0 of",
    ] {
        assert!(out.contains(l), "{l:?} in {out}");
    }
    // Fewer compared than checked, nothing else changed.
    retar(&t, &edit_json(&files, "report.json", &|v| v["summary"]["slices_compared"] = 511.into()));
    let (code, out, _) = check(&t);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("summary.slices_compared is 511 of 512 slices checked"), "{out}");
}

#[test]
fn check_reads_a_bundle_repacked_with_tar_and_an_unpacked_one() {
    let (d, b) = injected_bundle("bundle-repack");
    let x = d.join("x");
    std::fs::create_dir_all(&x).unwrap();
    let tar = |args: &[&str], at: &Path| {
        let s = std::process::Command::new("tar").args(args).current_dir(at).status().unwrap();
        assert!(s.success(), "tar {args:?}");
    };
    tar(&["xzf", b.to_str().unwrap()], &x);
    // Directory entries, a late manifest, and `./` prefixes: still a bundle.
    for (name, what) in [("top.tar.gz", "kvprobe-bundle"), ("dot.tar.gz", ".")] {
        let p = d.join(name);
        tar(&["czf", p.to_str().unwrap(), what], &x);
        let (code, out, err) = check(&p);
        assert_eq!(code, 0, "{name}: {out}{err}");
        assert!(out.contains("5 dumped slices re-derived"), "{name}: {out}");
    }
    // The unpacked folder, given as its parent or as kvprobe-bundle/ itself.
    for p in [x.clone(), x.join("kvprobe-bundle")] {
        let (code, out, err) = check(&p);
        assert_eq!(code, 0, "{}: {out}{err}", p.display());
        assert!(out.contains("5 dumped slices re-derived"), "{out}");
    }
    // The folder is checked, not only read: one changed byte of a slice is seen.
    let slices = x.join("kvprobe-bundle/dump/slices");
    let first = std::fs::read_dir(&slices).unwrap().next().unwrap().unwrap().path();
    let mut body = std::fs::read(&first).unwrap();
    body[100] ^= 0x40;
    std::fs::write(&first, body).unwrap();
    let (code, out, _) = check(&x);
    assert_eq!(code, 1, "{out}");
    let rel = first.strip_prefix(x.join("kvprobe-bundle")).unwrap().to_str().unwrap().to_string();
    assert!(out.contains(&format!("{rel}: sha256: manifest")), "{out}");
}

/// Issue 33 item 9: a run whose decode converts on receive (prefill NHD, decode HND with
/// `--permute-local-kv`) dumps the bytes NIXL delivered beside the converted ones
/// (`received_file`): each received file holds the converted slice's rows at their NHD places
/// (the test's own placement), a stale slice's received bytes are the NHD fingerprint of the
/// identity it holds (docs/fingerprint.md's spec, re-implemented in tests/fingerprint.rs), and the
/// bundle lists and hashes both files and passes `report check`.
#[test]
fn a_converting_run_dumps_the_received_bytes_beside_the_converted_ones() {
    let d = tmpdir("dump-received");
    let (dump, b, r) = (d.join("D"), d.join("b.tar.gz"), d.join("r.json"));
    let (code, out, err) = kvprobe(&[
        "run",
        "--memory",
        "dram",
        "--kv-heads",
        "3",
        "--decode-layout",
        "hnd",
        "--permute-local-kv",
        "--iterations",
        "2",
        "--inject",
        "stale",
        "--inject",
        "bitflip",
        "--inject",
        "torn",
        "--dump",
        dump.to_str().unwrap(),
        "--bundle",
        b.to_str().unwrap(),
        "--report",
        r.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    let report = read_report(&r);
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dump.join("index.json")).unwrap()).unwrap();
    let g = &report["config"]["geometry"];
    let (heads, bs) = (g["num_kv_heads"].as_u64().unwrap() as usize, g["block_size"].as_u64().unwrap() as usize);
    let rb = g["head_size"].as_u64().unwrap() as usize * 2; // bf16
    let seed = report["config"]["seed"].as_u64().unwrap();
    let slices = index["slices"].as_array().unwrap();
    let classes: std::collections::BTreeSet<&str> = slices.iter().map(|s| s["class"].as_str().unwrap()).collect();
    assert_eq!(classes, ["bitflip", "stale", "torn"].into(), "{index}");
    let mut files = 0;
    for s in slices {
        let converted = std::fs::read(dump.join(s["file"].as_str().unwrap())).unwrap();
        let name = s["received_file"].as_str().unwrap_or_else(|| panic!("no received_file: {s}"));
        assert_eq!(name, s["file"].as_str().unwrap().replace(".bin", ".received.bin"));
        let received = std::fs::read(dump.join(name)).unwrap();
        assert_eq!(received.len(), converted.len());
        // Decode's HND row (h, t) is the received NHD row (t, h).
        for t in 0..bs {
            for h in 0..heads {
                let (n, x) = ((t * heads + h) * rb, (h * bs + t) * rb);
                assert_eq!(received[n..n + rb], converted[x..x + rb], "{name}: token {t} head {h}");
            }
        }
        if s["class"] == "stale" {
            let o = &s["observed"];
            let kv = crate::fingerprint::spec::kv_code(o["kv"].as_str().unwrap());
            let (layer, block, generation) = (
                o["layer"].as_u64().unwrap() as u32,
                o["block"].as_u64().unwrap() as u32,
                o["generation"].as_u64().unwrap() as u32,
            );
            let nhd = crate::fingerprint::spec::rows(
                seed,
                layer,
                kv,
                block,
                generation,
                "nhd",
                bs as u32,
                heads as u32,
                rb as u32,
                0,
                0,
            );
            assert_eq!(received, nhd, "{name}: the stale generation as prefill's NHD rows");
        }
        files += 2;
    }
    let index_bytes: u64 = slices.iter().map(|s| s["bytes"].as_u64().unwrap() * 2).sum();
    assert_eq!(index["bytes_written"].as_u64(), Some(index_bytes), "both files count");
    assert_eq!(report["dump"]["bytes_written"], index["bytes_written"]);
    let packed = untar(&b);
    let dumped = packed.iter().filter(|(n, _)| n.starts_with("kvprobe-bundle/dump/slices/")).count();
    assert_eq!(dumped, files, "both files of each slice are in the bundle");
    let manifest: Value =
        serde_json::from_slice(&packed.iter().find(|(n, _)| n == "kvprobe-bundle/manifest.json").unwrap().1).unwrap();
    for (n, body) in packed.iter().filter(|(n, _)| n.ends_with(".received.bin")) {
        let rel = n.strip_prefix("kvprobe-bundle/").unwrap();
        let e = manifest["files"].as_array().unwrap().iter().find(|e| e["path"] == rel).unwrap_or_else(|| panic!("{rel}"));
        assert_eq!(e["sha256"].as_str(), Some(sha256_hex(body).as_str()), "{rel}");
    }
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "{out}{err}");
    // A received file that is not the one packed fails the manifest.
    let mut bad = packed.clone();
    let f = bad.iter_mut().find(|(n, _)| n.ends_with(".received.bin")).unwrap();
    f.1[0] ^= 1;
    let tampered = d.join("t.tar.gz");
    retar(&tampered, &bad);
    let (code, out, err) = check(&tampered);
    assert_ne!(code, 0, "{out}{err}");
    assert!(out.contains(".received.bin"), "{out}{err}");
}

#[test]
fn check_rederives_a_scenario_failures_identity_from_its_seeded_load() {
    // Issue 33 item 6 for scenarios: a real scenario bundle with failures agrees; a failure
    // whose expected block is no logical block of its request (or whose request the run never
    // admitted, or whose expected layer is not its own) is a disagreement naming it.
    let d = tmpdir("bundle-scenario-identity");
    let (r, b) = (d.join("r.json"), d.join("b.tar.gz"));
    let args = ["run", "--memory", "dram", "--scenario", "nixl-only", "--requests", "40", "--seed", "0x2a"];
    let mut a = args.to_vec();
    a.extend_from_slice(&["--report", r.to_str().unwrap(), "--bundle", b.to_str().unwrap()]);
    let (code, out, err) = crate::common::kvprobe_env(&a, &[("KVPROBE_TEST_FAULT", "bitflip:2")]);
    assert_eq!(code, 1, "{out}{err}");
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "a real scenario bundle with failures agrees: {out}{err}");
    let files = untar(&b);
    let rep = json_of(&files, "report.json");
    let f = rep["failures"].as_array().unwrap();
    assert_eq!(f.len(), 2, "{rep}");
    // The forged block is the expected one with its low bit flipped: a 32-bit chain hash, so
    // the chance that it is another of the request's (at most 8) blocks is 8 in 2^32.
    let block = f[0]["expected"]["block"].as_u64().unwrap();
    let admitted = rep["scenario"]["requests_admitted"].as_u64().unwrap();
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "block",
            Box::new(move |v: &mut Value| v["failures"][0]["expected"]["block"] = (block ^ 1).into()),
            "of the seeded load (seed, config.scenario.workload) has logical blocks",
        ),
        ("request", Box::new(move |v: &mut Value| v["failures"][0]["request"] = (admitted + 3).into()), ""),
        (
            "layer",
            Box::new(|v: &mut Value| v["failures"][0]["expected"]["layer"] = 1.into()),
            "a slice holds its own layer and K/V",
        ),
        (
            "seed",
            Box::new(|v: &mut Value| v["config"]["seed"] = 43.into()),
            "of the seeded load (seed, config.scenario.workload) has logical blocks",
        ),
        // A generation the run never computed: 40 requests of at most 64 blocks each (the
        // load's max_blocks bound) compute at most 2560 blocks, numbered from 1.
        (
            "generation",
            Box::new(|v: &mut Value| v["failures"][0]["expected"]["generation"] = 1_000_000.into()),
            "generation 1000000 was never computed in this run",
        ),
    ];
    for (what, edit, line) in cases {
        let t = d.join(format!("{what}.tar.gz"));
        retar(&t, &edit_json(&files, "report.json", &|v| edit(v)));
        let (code, out, err) = check(&t);
        assert_eq!(code, 1, "{what}: {out}{err}");
        let want = if what == "request" { format!("request {}: the run admitted {admitted}", admitted + 3) } else { line.into() };
        assert!(out.contains(want.as_str()), "{what}: {want:?} in {out}{err}");
    }
}

/// A self-test's bundle (status `self-test-passed`, exit 0, corrupt slices all planted) passes
/// `report check`; a report that claims the pass while a listed failure was not planted, or
/// an injection was missed, or the run was no self-test, does not.
#[test]
fn a_self_test_bundle_passes_check_only_when_every_failure_was_planted() {
    let d = tmpdir("bundle-selftest");
    let b = d.join("b.tar.gz");
    let (code, out, err) = kvprobe(&[
        "run",
        "--memory",
        "dram",
        "--iterations",
        "2",
        "--inject",
        "torn",
        "--inject",
        "misroute",
        "--self-test",
        "--bundle",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "{out}{err}");
    let files = untar(&b);
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(&str, Edit, &str)> = vec![
        (
            "not-planted",
            Box::new(|v| v["failures"][1].as_object_mut().unwrap().remove("injected").map(|_| ()).unwrap()),
            "but failures[1] is not a planted fault found as predicted (injected)",
        ),
        ("missed", Box::new(|v| v["injections"][0]["detected"] = false.into()), "but injections[0] was not detected"),
        ("unexpected", Box::new(|v| v["summary"]["unexpected_failures"] = 1.into()), "but summary.unexpected_failures is 1"),
        (
            "no-self-test",
            Box::new(|v| v["config"].as_object_mut().unwrap().remove("self_test").map(|_| ()).unwrap()),
            "but config.self_test is not true",
        ),
    ];
    for (name, edit, want) in cases {
        let p = d.join(format!("{name}.tar.gz"));
        retar(&p, &edit_json(&files, "report.json", &*edit));
        let (code, out, err) = check(&p);
        assert_eq!(code, 1, "{name}: {out}{err}");
        assert!(out.contains(want), "{name}: {want} in {out}");
    }
}

/// Runs every dumped slice's `observed_regenerate` of the dump at `dir` (issue 35 item 11):
/// a `misplaced`, `stale` or `unwritten` slice has one, and what it writes to
/// `observed/<file name>` is the dumped file byte for byte, its SHA-256 (computed here)
/// `actual_digest`, which the command also prints; a `bitflip` or `torn` slice has none.
/// Returns how many slices of each class were seen.
fn assert_observed_regenerate_reproduces(dir: &Path, ctx: &str) -> std::collections::BTreeMap<String, usize> {
    let index: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("index.json")).unwrap()).unwrap();
    let mut seen = std::collections::BTreeMap::new();
    for s in index["slices"].as_array().unwrap() {
        let class = s["class"].as_str().unwrap();
        *seen.entry(class.to_string()).or_insert(0) += 1;
        let file = s["file"].as_str().unwrap();
        let cmd = &s["observed_regenerate"];
        match class {
            "misplaced" | "stale" | "unwritten" => {
                let cmd = cmd.as_str().unwrap_or_else(|| panic!("{ctx}: {file} ({class}): no observed_regenerate: {s}"));
                let o = std::process::Command::new("sh").arg("-c").arg(cmd).current_dir(dir).output().expect("sh");
                assert!(o.status.success(), "{ctx}: {cmd}: {}", String::from_utf8_lossy(&o.stderr));
                let dumped = std::fs::read(dir.join(file)).unwrap();
                let name = Path::new(file).file_name().unwrap();
                let wrote = std::fs::read(dir.join("observed").join(name)).unwrap_or_else(|e| panic!("{ctx}: {cmd}: {e}"));
                let actual = s["actual_digest"].as_str().unwrap();
                assert_eq!(sha256_hex(&wrote), actual, "{ctx}: {file} ({class}): {cmd}");
                assert!(wrote == dumped, "{ctx}: {file} ({class}): {cmd} wrote other bytes than the dump holds");
                assert_eq!(String::from_utf8_lossy(&o.stdout).trim(), actual, "{ctx}: {cmd} prints the digest");
                // The poison for an unwritten slice, a fingerprint otherwise.
                assert_eq!(cmd.contains("fingerprint_ref.py poison "), class == "unwritten", "{ctx}: {cmd}");
            }
            "bitflip" | "torn" => assert!(cmd.is_null(), "{ctx}: {file} ({class}): no command reproduces it: {cmd}"),
            _ => {}
        }
    }
    seen
}

#[test]
fn observed_regenerate_writes_exactly_the_stale_misplaced_and_unwritten_bytes() {
    let faults = ["--inject", "stale", "--inject", "drop", "--inject", "misroute", "--inject", "bitflip", "--iterations", "2"];
    // (case, flags): one rank; TP ranks (each rank's rows start at its first head); a run
    // whose decode converts on receive (the command rebuilds `file`, the converted bytes).
    let tp = ["--layout", "hnd", "--kv-heads", "4", "--prefill-tp", "2", "--decode-tp", "4"];
    let converting = ["--kv-heads", "3", "--decode-layout", "hnd", "--permute-local-kv"];
    let cases: [(&str, &[&str]); 3] = [("one-rank", &[]), ("tp", &tp), ("converting", &converting)];
    for (what, flags) in cases {
        let d = tmpdir(&format!("dump-observed-regenerate-{what}"));
        let (dump, r) = (d.join("D"), d.join("r.json"));
        let mut a = vec!["run", "--memory", "dram", "--dump", dump.to_str().unwrap(), "--report", r.to_str().unwrap()];
        a.extend_from_slice(&faults);
        a.extend_from_slice(flags);
        if what == "one-rank" {
            a.extend_from_slice(&["--inject", "torn"]);
        }
        let (code, out, err) = kvprobe(&a);
        assert_eq!(code, 1, "{what}: {out}{err}");
        let seen = assert_observed_regenerate_reproduces(&dump, what);
        for class in ["misplaced", "stale", "unwritten", "bitflip"] {
            assert!(seen.get(class) > Some(&0), "{what}: a {class} slice dumped: {seen:?}");
        }
        if what == "one-rank" {
            assert!(seen.get("torn") > Some(&0), "{what}: {seen:?}");
        }
        if what == "converting" {
            let index: Value = serde_json::from_str(&std::fs::read_to_string(dump.join("index.json")).unwrap()).unwrap();
            assert!(index["slices"].as_array().unwrap().iter().all(|s| s["received_file"].is_string()), "{what}: {index}");
        }
    }
}

#[test]
fn check_finds_an_observed_regenerate_that_does_not_rebuild_the_dumped_bytes() {
    let d = tmpdir("bundle-observed-regenerate");
    let (b, dd) = (d.join("b.tar.gz"), d.join("D"));
    let (code, out, err) = kvprobe(&[
        "run",
        "--memory",
        "dram",
        "--iterations",
        "1",
        "--inject",
        "stale",
        "--inject",
        "drop",
        "--inject",
        "bitflip",
        "--dump",
        dd.to_str().unwrap(),
        "--bundle",
        b.to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{out}{err}");
    let (code, out, err) = check(&b);
    assert_eq!(code, 0, "{out}{err}");
    let files = untar(&b);
    let index = json_of(&files, "dump/index.json");
    let slices = index["slices"].as_array().unwrap();
    let at = |class: &str| slices.iter().position(|s| s["class"] == class).unwrap_or_else(|| panic!("a {class} slice: {index}"));
    let (stale, unwritten, bitflip) = (at("stale"), at("unwritten"), at("bitflip"));
    let name = |i: usize| {
        let s = &slices[i];
        format!("iteration {} layer {} {} block {}", s["iteration"], s["layer"], s["kv"].as_str().unwrap(), s["block"])
    };
    // The command with its word `w` (0-based, split at spaces) replaced by `f` of it.
    let reword = |i: usize, w: usize, f: fn(u64) -> u64| {
        let cmd = slices[i]["observed_regenerate"].as_str().unwrap().to_string();
        let mut words: Vec<String> = cmd.split(' ').map(str::to_string).collect();
        words[w] = f(words[w].parse().unwrap()).to_string();
        words.join(" ")
    };
    // `mkdir -p observed && python3 scripts/fingerprint_ref.py SEED LAYER KV BLOCK GENERATION …`
    // and `… fingerprint_ref.py poison SLOT ITERATION SLICE_BYTES OUT`.
    let (gen_word, iter_word) = (10, 8);
    let other_generation = reword(stale, gen_word, |g| g + 1);
    let other_iteration = reword(unwritten, iter_word, |i| i + 1);
    let on_bitflip = slices[bitflip]["regenerate"].as_str().unwrap().replace("expected", "observed");
    let bitflip_line = format!("{}: observed_regenerate: index {on_bitflip:?}, expected none", name(bitflip));
    type Edit = Box<dyn Fn(&mut Value)>;
    // (case, edit of index.json, exit code, line expected or "")
    let cases: Vec<(&str, Edit, i32, String)> = vec![
        (
            "other-generation",
            Box::new(move |v| v["slices"][stale]["observed_regenerate"] = other_generation.clone().into()),
            1,
            format!("{}: observed_regenerate: index ", name(stale)),
        ),
        (
            "other-poison-iteration",
            Box::new(move |v| v["slices"][unwritten]["observed_regenerate"] = other_iteration.clone().into()),
            1,
            format!("{}: observed_regenerate: index ", name(unwritten)),
        ),
        // Bytes no single command reproduces: the field must be absent.
        (
            "given-for-a-bitflip",
            Box::new(move |v| v["slices"][bitflip]["observed_regenerate"] = on_bitflip.clone().into()),
            1,
            bitflip_line,
        ),
        // Left out of one slice of a dump that writes it: a disagreement.
        (
            "dropped-from-one",
            Box::new(move |v| {
                v["slices"][stale].as_object_mut().unwrap().remove("observed_regenerate").unwrap();
            }),
            1,
            format!("{}: observed_regenerate: index none, expected ", name(stale)),
        ),
        // A dump of a kvprobe before the field has it nowhere: still consistent.
        (
            "old-dump",
            Box::new(|v| {
                for s in v["slices"].as_array_mut().unwrap() {
                    s.as_object_mut().unwrap().remove("observed_regenerate");
                }
            }),
            0,
            String::new(),
        ),
    ];
    for (what, edit, want, line) in cases {
        let t = d.join(format!("{what}.tar.gz"));
        retar(&t, &edit_json(&files, "dump/index.json", &*edit));
        let (code, out, err) = check(&t);
        assert_eq!(code, want, "{what}: {out}{err}");
        assert!(out.contains(&line), "{what}: {line:?} in {out}{err}");
    }
}
