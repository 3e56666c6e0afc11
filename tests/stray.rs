//! Stray writes in pipelined sweeps (issue 13 item 5): a write into a decode slot outside its
//! own transfer — into a stage re-poisoned while later stages are in flight, or into a stage
//! already verified — is reported as class `stray`. DRAM with the real NIXL library.
//!
//! The expectations are computed here from the docs' definitions (docs/guide.md, docs/fingerprint.md) (the stage split, the
//! pool's slice count), not with the code's own functions.

use crate::common::{assert_found_exactly, run_with_report};
use serde_json::Value;

/// The geometry of a report's `config.geometry`: (layers, slices per layer).
fn layers_and_slices_per_layer(r: &Value) -> (u64, u64) {
    let g = &r["config"]["geometry"];
    let parts = if g["mla"].as_bool().unwrap() { 1 } else { 2 };
    (g["num_layers"].as_u64().unwrap(), parts * g["num_blocks"].as_u64().unwrap())
}

/// docs/guide.md "--pipeline-stages": stage i of S over L layers is layers [floor(i·L/S), floor((i+1)·L/S)).
fn stage_ranges(layers: u64, stages: u64) -> Vec<std::ops::Range<u64>> {
    (0..stages).map(|i| i * layers / stages..(i + 1) * layers / stages).collect()
}

/// docs/fingerprint.md's poison of (slot, iteration): little-endian u32 elements, `slot` at even
/// indices and 0x5A000000 | iteration at odd ones.
fn readme_poison(len: usize, slot: u32, iteration: u32) -> Vec<u8> {
    (0..len / 4).flat_map(|e| if e % 2 == 0 { slot } else { 0x5A00_0000 | iteration }.to_le_bytes()).collect()
}

fn sha256_hex(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// Geometries × stage counts: NHD, HND, MLA, other block sizes and layer counts, seeds, READ
/// and WRITE, merged descriptors; 3 stages, 4, and one per layer (the most).
const CASES: [&[&str]; 6] = [
    &["--pipeline-stages", "3", "--seed", "3"],
    &["--pipeline-stages", "4", "--layout", "hnd", "--block-size", "8", "--seed", "0x77"],
    &["--layers", "7", "--pipeline-stages", "7", "--op", "write", "--seed", "12345"],
    &["--mla", "--head-size", "576", "--block-size", "4", "--layers", "5", "--blocks", "9", "--pipeline-stages", "5"],
    &[
        "--layers",
        "6",
        "--kv-heads",
        "5",
        "--head-size",
        "72",
        "--block-size",
        "3",
        "--blocks",
        "7",
        "--dtype",
        "fp16",
        "--pipeline-stages",
        "3",
    ],
    &["--layers", "8", "--pipeline-stages", "4", "--descriptor-blocks", "16", "--seed", "9"],
];

#[test]
fn injected_stray_writes_are_found_as_stray_in_every_geometry_and_stage_count() {
    const ITERATIONS: u64 = 3;
    for extra in CASES {
        let mut args = vec!["--iterations", "3", "--inject", "stray:2"];
        args.extend_from_slice(extra);
        let (code, r, log) = run_with_report("stray", "dram", &args);
        let ctx = format!("{extra:?}: {log}");
        assert_eq!(code, 1, "{ctx}");
        assert_eq!(r["outcome"]["status"], "corrupt", "{ctx}");
        let s = &r["summary"];
        // Two per iteration, each found where and as predicted, by the tests' own table.
        assert_eq!(s["injections_planted"], 2 * ITERATIONS, "{ctx}");
        assert_found_exactly(&r, 2 * ITERATIONS, &ctx);
        assert_eq!(s["by_class"]["stray"], 2 * ITERATIONS, "{ctx}");
        // Item 4's invariant holds: fingerprint comparisons are every slice once per iteration.
        let (layers, per_layer) = layers_and_slices_per_layer(&r);
        assert_eq!(s["slices_compared"], layers * per_layer * ITERATIONS, "{ctx}");
        assert_eq!(s["blocks_checked"], layers * per_layer * ITERATIONS, "{ctx}");
        let n = s["pipeline_stages"].as_u64().unwrap();
        let st = stage_ranges(layers, n);
        let stage_of = |layer: u64| st.iter().position(|r| r.contains(&layer)).unwrap();
        for f in r["failures"].as_array().unwrap() {
            let it = f["iteration"].as_u64().unwrap();
            let (layer, observed) = (f["layer"].as_u64().unwrap(), &f["observed"]);
            assert_eq!(f["class"], "stray", "{f}");
            assert!(f["bad_bytes"].as_u64().unwrap() > 0, "{f}");
            // The record names the block that landed there: a fingerprint of this iteration
            // from another stage's layer.
            assert_eq!(observed["generation"], it, "{f}");
            let from = observed["layer"].as_u64().unwrap();
            if it == ITERATIONS && n >= 4 {
                // The last iteration's stray lands in stage 0 after it verified (the last
                // stage's request carries it): found by the re-verify, against the fingerprint.
                assert_eq!(f["stray_check"], "reverify", "{f}");
                assert_eq!((stage_of(layer), stage_of(from)), (0, n as usize - 1), "{f}");
            } else {
                // Before its stage was posted: the slot no longer held its poison.
                assert_eq!(f["stray_check"], "poison", "{f}");
                assert!(stage_of(layer) >= 2 && stage_of(from) == 0, "{f}");
                assert_eq!(f["poison_iteration"], it, "{f}");
                let sb = r["config"]["geometry"]["slice_bytes"].as_u64().unwrap() as usize;
                let poison = readme_poison(sb, f["slot"].as_u64().unwrap() as u32, it as u32);
                assert_eq!(f["expected_digest"], sha256_hex(&poison), "what the slot should have held: {f}");
            }
        }
    }
}

#[test]
fn clean_pipelined_sweeps_report_no_stray_and_count_their_checks() {
    for (extra, iterations) in [
        (&["--pipeline-stages", "2"][..], 3u64),
        (&["--pipeline-stages", "3", "--layers", "7"][..], 2),
        (&["--pipeline-stages", "4", "--mla"][..], 3),
        (&["--pipeline-stages", "5", "--layers", "5", "--layout", "hnd", "--op", "write"][..], 1),
        (&["--pipeline-stages", "1"][..], 3),
    ] {
        let its = iterations.to_string();
        let mut args = vec!["--iterations", its.as_str()];
        args.extend_from_slice(extra);
        let (code, r, log) = run_with_report("stray-clean", "dram", &args);
        let ctx = format!("{extra:?}: {log}");
        assert_eq!(code, 0, "{ctx}");
        let s = &r["summary"];
        assert_eq!(s["by_class"]["stray"], 0, "{ctx}");
        assert_eq!(s["blocks_corrupt"], 0, "{ctx}");
        let (layers, per_layer) = layers_and_slices_per_layer(&r);
        let n = s["pipeline_stages"].as_u64().unwrap();
        assert_eq!(s["slices_compared"], layers * per_layer * iterations, "{ctx}");
        // Whatever the stage count (one stage too: a transport's completion may lie): every
        // slice is poison-checked before every post, and verified again before every
        // re-poison and after the last iteration — once per iteration each.
        assert!(n >= 1, "{ctx}");
        assert_eq!(s["stray_poison_checked_slices"], layers * per_layer * iterations, "{ctx}");
        assert_eq!(s["stray_reverified_slices"], layers * per_layer * iterations, "{ctx}");
    }
}

#[test]
fn inject_stray_needs_three_pipeline_stages() {
    for extra in [&[][..], &["--pipeline-stages", "2"][..], &["--layers", "2", "--pipeline-stages", "2"][..]] {
        let mut args = vec!["--iterations", "1", "--inject", "stray"];
        args.extend_from_slice(extra);
        let (code, r, log) = run_with_report("stray-refused", "dram", &args);
        assert_eq!(code, 2, "{extra:?}: {log}");
        assert!(log.contains("--inject stray needs at least 3 pipeline stages"), "{extra:?}: {log}");
        assert_eq!(r["outcome"]["exit_code"], 2, "{extra:?}");
    }
    // More strays than the slices of stages 2 and later (3 layers, 3 stages: one layer of
    // 2 × 2 slices) is refused too.
    let (code, _, log) = run_with_report(
        "stray-room",
        "dram",
        &["--layers", "3", "--blocks", "2", "--pipeline-stages", "3", "--inject", "stray:5", "--iterations", "1"],
    );
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("--inject stray needs 5 distinct block slices"), "{log}");
}

#[test]
fn strays_combine_with_every_other_injection_and_two_processes() {
    // Every other kind in the same iterations (their slices distinct from the strays'), READ
    // and WRITE, prefill's agent and pool in a second process (--decode-process): each fault
    // comes back where and as the tests' own table predicts, nothing else.
    for extra in [
        &["--pipeline-stages", "4", "--seed", "21"][..],
        &["--pipeline-stages", "3", "--layers", "6", "--op", "write", "--descriptor-blocks", "4"][..],
        &["--pipeline-stages", "4", "--decode-process"][..],
    ] {
        let mut args = vec!["--iterations", "3", "--inject", "stray:2"];
        args.extend(crate::common::EVERY_INJECTION);
        args.extend_from_slice(extra);
        let (code, r, log) = run_with_report("stray-combined", "dram", &args);
        let ctx = format!("{extra:?}: {log}");
        assert_eq!(code, 1, "{ctx}");
        assert_found_exactly(&r, 3 * 7, &ctx);
        assert_eq!(r["summary"]["by_class"]["stray"], 6, "{ctx}");
        let (layers, per_layer) = layers_and_slices_per_layer(&r);
        assert_eq!(r["summary"]["slices_compared"], 3 * layers * per_layer, "{ctx}");
    }
}

/// Issue 33 item 5 (audit M2): with one pipeline stage (the default on DRAM) a write into a
/// slice after its verify judged it clean — the test hook writes another slot's fingerprint
/// into layer 0 K slot 0 between the verify and the re-poison of iteration N, or after the
/// last iteration's verify — is found (class `stray`, check `reverify`, exit 1), not
/// overwritten unseen by the next re-poison. Three stages too.
#[test]
fn a_write_after_the_verdict_is_found_with_one_stage_before_the_repoison_and_after_the_last_iteration() {
    a_write_after_the_verdict_is_found("dram");
}

/// [`a_write_after_the_verdict_is_found_with_one_stage_before_the_repoison_and_after_the_last_iteration`]
/// on `memory` (also run on VRAM by tests/gpu.rs).
pub fn a_write_after_the_verdict_is_found(memory: &str) {
    for (extra, n) in [(&[][..], 1u64), (&["--pipeline-stages", "3"][..], 3), (&[][..], 3), (&["--op", "write"][..], 2)] {
        let d = crate::common::tmpdir("late-repoison");
        let p = d.join("report.json");
        let at = format!("repoison:{n}");
        let mut a = vec!["run", "--memory", memory, "--iterations", "3", "--report", p.to_str().unwrap()];
        a.extend(extra);
        let (code, out, err) = crate::common::kvprobe_env(&a, &[("KVPROBE_TEST_LATE_WRITE", at.as_str())]);
        let ctx = format!("{extra:?} {at}: {out}{err}");
        assert_eq!(code, 1, "{ctx}");
        let r = crate::common::read_report(&p);
        let f = r["failures"].as_array().unwrap();
        assert_eq!(f.len(), 1, "{ctx}");
        let x = &f[0];
        assert_eq!((x["class"].as_str(), x["stray_check"].as_str()), (Some("stray"), Some("reverify")), "{x}");
        assert_eq!(
            (x["iteration"].as_u64(), x["layer"].as_u64(), x["kv"].as_str(), x["block"].as_u64()),
            (Some(n), Some(0), Some("K"), Some(0))
        );
        // What landed: a fingerprint of this iteration's plan for the same layer and K/V, of
        // another block (slot 1's).
        let o = &x["observed"];
        assert_eq!((o["layer"].as_u64(), o["kv"].as_str(), o["generation"].as_u64()), (Some(0), Some("K"), Some(n)), "{x}");
        assert_ne!(o["block"], x["expected"]["block"], "{x}");
        assert_eq!(r["summary"]["by_class"]["stray"], 1, "{ctx}");
        assert_eq!(r["summary"]["blocks_corrupt"], 1, "{ctx}");
    }
}
