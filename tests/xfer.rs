//! How NIXL requests are made (`--xfer-req prepared|create`), the metadata check after
//! loading the peer's (`checkRemoteMD`), and `--backend-param`: real NIXL (UCX) on DRAM
//! pools. Needs the NIXL libraries (scripts/install-deps.sh).

use crate::common::{EVERY_INJECTION, assert_compared, assert_found_exactly, kvprobe, kvprobe_env, read_report, tmpdir};
use kvprobe::geometry::{KvPart, Layout, Preset, SliceCoord};
use kvprobe::transport::{Cuts, XferReq, indices};
use serde_json::Value;

/// `kvprobe run --memory dram --report <tmp> ARGS` with `env`: (exit code, report, stdout +
/// stderr).
fn run(name: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, Value, String) {
    let p = tmpdir(name).join("report.json");
    let mut a = vec!["run", "--memory", "dram", "--report", p.to_str().unwrap()];
    a.extend_from_slice(args);
    let (code, out, err) = kvprobe_env(&a, env);
    assert!(!err.contains("panicked"), "{err}");
    let r = if p.exists() { read_report(&p) } else { Value::Null };
    (code, r, format!("{out}{err}"))
}

/// Trace lines saying a request was built with createXferReq because a pair has no
/// prepared index.
fn fallbacks(log: &str) -> usize {
    log.lines().filter(|l| l.contains("no prepared index names it, so it is built with createXferReq")).count()
}

/// Trace lines saying a role prepared its two descriptor lists (`slices` descriptors each).
fn prepared_lines(log: &str, slices: u64) -> usize {
    log.lines().filter(|l| l.contains(&format!("prepared {slices} local and {slices} remote descriptors"))).count()
}

const TRACE: &[(&str, &str)] = &[("KVPROBE_TRACE", "1")];

#[test]
fn sweeps_and_scenarios_are_clean_with_prepared_and_created_requests() {
    // The small preset: 4 layers x K/V x 64 blocks = 512 slices per pool.
    for mode in ["prepared", "create"] {
        for extra in [
            vec!["--iterations", "3"],
            vec!["--iterations", "2", "--op", "write", "--layout", "hnd"],
            vec!["--iterations", "2", "--decode-process"],
            vec!["--scenario", "nixl-only", "--requests", "150"],
            vec!["--scenario", "stacked", "--requests", "150"],
        ] {
            let mut args = vec!["--xfer-req", mode];
            args.extend(extra.iter());
            let (code, r, log) = run("xfer-clean", &args, TRACE);
            assert_eq!(code, 0, "{mode} {extra:?}: {log}");
            assert_eq!(r["config"]["xfer_req"], mode, "{mode} {extra:?}");
            assert!(log.contains(&format!("(backend UCX, {mode} requests)\n")), "{mode} {extra:?}: {log}");
            assert_eq!(r["summary"]["blocks_corrupt"], 0, "{mode} {extra:?}");
            // What the verify passes counted: a sweep's 512 slices of 4096 bytes (16 tokens x 2
            // KV heads x 64 x bf16) an iteration; a scenario's verified requests' slices.
            let slices = match extra[..2] {
                ["--iterations", n] => 512 * n.parse::<u64>().unwrap(),
                _ => r["summary"]["blocks_checked"].as_u64().filter(|&n| n > 0).expect("a scenario verified slices"),
            };
            assert_compared(&r, slices, 4096, &format!("{mode} {extra:?}"));
            // Prepared: both roles (prefill in its own process with --decode-process)
            // prepared their lists; create: none did. Nothing fell back.
            assert_eq!(prepared_lines(&log, 512), if mode == "prepared" { 2 } else { 0 }, "{mode} {extra:?}: {log}");
            assert_eq!(fallbacks(&log), 0, "{mode} {extra:?}: {log}");
        }
    }
}

#[test]
fn every_injection_is_found_as_predicted_with_prepared_requests() {
    // Every class, stray included (it needs 3 stages or more), planted through prepared
    // requests; the torn pair's request alone falls back to createXferReq, once per
    // iteration (one torn pair per iteration, in one stage's request).
    let mut args = vec!["--xfer-req", "prepared", "--iterations", "3", "--pipeline-stages", "4", "--inject", "stray"];
    args.extend(EVERY_INJECTION);
    let (code, r, log) = run("xfer-inject", &args, TRACE);
    assert_eq!(code, 1, "{log}");
    assert_eq!(r["config"]["xfer_req"], "prepared");
    let planted = r["summary"]["injections_planted"].as_u64().unwrap();
    assert_eq!(planted, 18, "{log}");
    assert_found_exactly(&r, planted, &log);
    assert!(r["summary"]["by_class"]["torn"].as_u64().unwrap() >= 3, "{}", r["summary"]["by_class"]);
    assert!(r["summary"]["by_class"]["stray"].as_u64().unwrap() >= 3, "{}", r["summary"]["by_class"]);
    assert_eq!(prepared_lines(&log, 512), 2, "{log}");
    assert_eq!(fallbacks(&log), 3, "{log}");
    // Without a torn pair nothing falls back.
    let (code, r, log) = run("xfer-inject-notorn", &["--iterations", "2", "--inject", "bitflip", "--inject", "misroute"], TRACE);
    assert_eq!(code, 1, "{log}");
    assert_found_exactly(&r, 4, &log);
    assert_eq!(fallbacks(&log), 0, "{log}");
}

#[test]
fn merged_descriptor_runs_with_prepared_requests() {
    // Runs of 4 blocks expand to 4 consecutive indices per pair (NHD: one run per layer and
    // K/V; HND: K and V of the run together, 8 slices; MLA: one latent run).
    // NIXL (nixl-cu13 1.5.1, its debug log) merges each run's consecutive indices back into
    // one descriptor: as many descriptors as createXferReq would get (NHD: 4 layers x K/V x
    // 16 runs; HND: 4 x 16 runs of K and V; MLA: 4 x 16 runs of 256 latent slices).
    for (extra, merged) in [
        (vec![], "merged 512 indices into 128 descriptors"),
        (vec!["--layout", "hnd"], "merged 512 indices into 64 descriptors"),
        (vec!["--mla", "--kv-heads", "1"], "merged 256 indices into 64 descriptors"),
    ] {
        let mut args = vec!["--xfer-req", "prepared", "--descriptor-blocks", "4", "--iterations", "2"];
        args.extend(extra.iter());
        let (code, r, log) = run("xfer-merged", &args, &[("KVPROBE_TRACE", "1"), ("NIXL_LOG_LEVEL", "DEBUG")]);
        assert_eq!(code, 0, "{extra:?}: {log}");
        assert_eq!(log.matches(merged).count(), 2, "{extra:?}: one request per iteration: {log}");
        assert_eq!(r["config"]["descriptor_blocks"], 4);
        assert_eq!(r["summary"]["blocks_corrupt"], 0);
        assert_eq!(fallbacks(&log), 0, "{extra:?}: {log}");
        // Faults planted into merged runs are found as predicted; only torn falls back.
        let mut args = args.clone();
        args.extend(EVERY_INJECTION);
        let (code, r, log) = run("xfer-merged-inject", &args, TRACE);
        assert_eq!(code, 1, "{extra:?}: {log}");
        assert_found_exactly(&r, 10, &format!("{extra:?}: {log}"));
        assert_eq!(fallbacks(&log), 2, "{extra:?}: {log}");
    }
}

#[test]
fn a_valid_backend_param_runs_clean_and_is_recorded() {
    let (code, r, log) = run("xfer-bp", &["--iterations", "2", "--backend-param", "num_threads=2"], &[]);
    assert_eq!(code, 0, "{log}");
    assert_eq!(r["config"]["backend_params"], serde_json::json!({"num_threads": "2"}));
    assert_eq!(r["summary"]["blocks_corrupt"], 0);
    assert!(log.contains("(backend UCX, prepared requests, num_threads=2)\n"), "{log}");
    // Without the flag: the plugin's defaults, recorded as none.
    let (code, r, log) = run("xfer-bp-none", &["--iterations", "1"], &[]);
    assert_eq!(code, 0, "{log}");
    assert_eq!(r["config"]["backend_params"], serde_json::json!({}));
    // Also with --decode-process (its prefill process creates its own backend).
    let (code, r, log) = run("xfer-bp-proc", &["--iterations", "1", "--decode-process", "--backend-param", "num_workers=2"], &[]);
    assert_eq!(code, 0, "{log}");
    assert_eq!(r["config"]["backend_params"], serde_json::json!({"num_workers": "2"}));
    // ab and bench take the flag too.
    for sub in ["ab", "bench"] {
        let (code, out, _) = kvprobe(&[sub, "--help"]);
        assert_eq!(code, 0);
        assert!(out.contains("--backend-param <KEY=VALUE>"), "{sub}: {out}");
    }
}

#[test]
fn an_unknown_backend_param_exits_2_naming_it_and_the_valid_keys() {
    let (code, r, log) = run("xfer-bp-bad", &["--iterations", "1", "--backend-param", "num_thread=2"], &[]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("NIXL backend UCX has no parameter \"num_thread\""), "{log}");
    // The valid ones: the plugin's defaults and the keys its source reads beyond them.
    for k in ["num_threads", "num_workers", "ucx_devices", "ucx_error_handling_mode", "engine_config"] {
        assert!(log.contains(k), "{k}: {log}");
    }
    assert_eq!(r["outcome"]["exit_code"], 2, "{r}");
    // A value the plugin cannot parse stops the backend's start: exit 2, naming it.
    let (code, _, log) = run("xfer-bp-value", &["--iterations", "1", "--backend-param", "num_threads=many"], &[]);
    assert_eq!(code, 2, "{log}");
    assert!(log.contains("with --backend-param num_threads=many"), "{log}");
    // Not KEY=VALUE: refused by the parser.
    for bad in ["num_threads", "=2", "a b=1"] {
        let (code, _, err) = kvprobe(&["run", "--memory", "dram", "--backend-param", bad]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("--backend-param"), "{bad}: {err}");
    }
    // ab refuses it the same way.
    let (code, _, err) = kvprobe(&["ab", "--memory", "dram", "--requests", "20", "--backend-param", "bogus=1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no parameter \"bogus\""), "{err}");
}

#[test]
fn check_remote_metadata_refuses_descriptors_outside_the_peers_registered_memory() {
    // The hook makes the peer's descriptor list one region past the memory it registered,
    // as a wrong exchange of region addresses would: checkRemoteMD must refuse it before any
    // transfer, in both modes (with create nothing else would notice before the first
    // request), naming the agent that checked and the peer.
    for mode in ["prepared", "create"] {
        let (code, r, log) =
            run("xfer-md", &["--iterations", "1", "--xfer-req", mode], &[("KVPROBE_TEST_WRONG_PEER_BASES", "1")]);
        // The two agents disagree on the peer's memory: a transport error (exit 3), not an
        // environment that cannot serve the pools.
        assert_eq!(code, 3, "{mode}: {log}");
        assert!(!log.contains("cannot serve"), "{mode}: {log}");
        // Whichever agent loads the other's metadata first refuses it (in process, prefill's
        // thread loads decode's as a serve does).
        assert!(
            [("decode", "prefill"), ("prefill", "decode")].iter().any(|(a, b)| log.contains(&format!(
                "NIXL agent kvprobe-{a}: the metadata loaded from agent kvprobe-{b} does not cover its pool's 512 block slices (checkRemoteMD"
            ))),
            "{mode}: {log}"
        );
        assert_eq!(r["summary"]["bytes_transferred"], 0, "{mode}");
    }
    // The same pools and peers without the hook pass the check.
    let (code, _, log) = run("xfer-md-ok", &["--iterations", "1"], &[]);
    assert_eq!(code, 0, "{log}");
}

#[test]
fn old_reports_without_the_new_fields_still_parse() {
    let (code, r, log) = run("xfer-old", &["--iterations", "1"], &[]);
    assert_eq!(code, 0, "{log}");
    let mut cfg = r["config"].clone();
    let m = cfg.as_object_mut().unwrap();
    assert!(m.remove("xfer_req").is_some() && m.remove("backend_params").is_some(), "{cfg}");
    let back: kvprobe::sweep::RunConfig = serde_json::from_value(cfg).unwrap();
    // Reports written before the flag built every request with createXferReq.
    assert_eq!(back.xfer_req, XferReq::Create);
    assert!(back.backend_params.is_empty());
    // And `report show` reads such a report.
    let mut old = r.clone();
    let m = old["config"].as_object_mut().unwrap();
    m.remove("xfer_req");
    m.remove("backend_params");
    let p = tmpdir("xfer-old-show").join("old.json");
    std::fs::write(&p, serde_json::to_vec(&old).unwrap()).unwrap();
    let (code, out, err) = kvprobe(&["report", "show", p.to_str().unwrap()]);
    assert_eq!(code, 0, "{out}{err}");
}

#[test]
fn prepared_indices_are_global_slice_indices_and_runs_expand() {
    let g = Preset::Small.geometry(); // NHD, 4 layers, 64 blocks, 4096-byte slices
    let sb = g.slice_bytes().unwrap();
    let c = |layer, kv, block| SliceCoord { layer, kv, block };
    // One slice each: vLLM's region * num_blocks + block (regions: layer-major K, V).
    let (l, r, bytes) =
        indices((&g, &g), &Cuts::whole(), [((c(0, KvPart::K, 5), 0), (c(2, KvPart::V, 7), 0), sb)].into_iter()).unwrap();
    assert_eq!((l, r, bytes), (vec![5], vec![(2 * 2 + 1) * 64 + 7], sb));
    // A run of 4 slices: 4 consecutive indices on both sides.
    let (l, r, bytes) =
        indices((&g, &g), &Cuts::whole(), [((c(1, KvPart::K, 8), 0), (c(3, KvPart::V, 60), 0), 4 * sb)].into_iter()).unwrap();
    assert_eq!(l, vec![128 + 8, 128 + 9, 128 + 10, 128 + 11]);
    assert_eq!(r, vec![7 * 64 + 60, 7 * 64 + 61, 7 * 64 + 62, 7 * 64 + 63]);
    assert_eq!(bytes, 4 * sb);
    // A run past its layer region's end has no indices (NHD: V's last block is the region's end).
    assert!(
        indices((&g, &g), &Cuts::whole(), [((c(1, KvPart::V, 62), 0), (c(0, KvPart::K, 0), 0), 4 * sb)].into_iter()).is_err()
    );
    // A torn pair (less than a slice, or not whole slices) has none either.
    let e =
        indices((&g, &g), &Cuts::whole(), [((c(0, KvPart::K, 0), 0), (c(0, KvPart::K, 1), 0), sb / 2)].into_iter()).unwrap_err();
    assert!(e.contains("not whole descriptors of the link"), "{e}");
    assert!(
        indices((&g, &g), &Cuts::whole(), [((c(0, KvPart::K, 0), 0), (c(0, KvPart::K, 1), 0), sb + 16)].into_iter()).is_err()
    );
    assert!(indices((&g, &g), &Cuts::whole(), [((c(0, KvPart::K, 0), 0), (c(0, KvPart::K, 1), 0), 0)].into_iter()).is_err());
    // A whole slice's bytes at an offset (a chunk between unequal sides) has none.
    assert!(indices((&g, &g), &Cuts::whole(), [((c(0, KvPart::K, 0), 16), (c(0, KvPart::K, 1), 0), sb)].into_iter()).is_err());
    assert!(indices((&g, &g), &Cuts::whole(), [((c(0, KvPart::K, 0), 0), (c(0, KvPart::K, 1), 16), sb)].into_iter()).is_err());
    // HND: memory order, K and V of a block side by side; a run of 2 blocks, K and V
    // together, is 4 consecutive indices.
    let mut h = g.clone();
    h.layout = Layout::Hnd;
    let (l, _, _) =
        indices((&h, &h), &Cuts::whole(), [((c(2, KvPart::K, 10), 0), (c(0, KvPart::K, 0), 0), 4 * sb)].into_iter()).unwrap();
    assert_eq!(l, vec![256 + 20, 256 + 21, 256 + 22, 256 + 23]);
    let (l, _, _) =
        indices((&h, &h), &Cuts::whole(), [((c(0, KvPart::V, 3), 0), (c(0, KvPart::K, 0), 0), sb)].into_iter()).unwrap();
    assert_eq!(l, vec![7]);
    // The prepared list holds every slice at its index: entry i is slice coord_of(i).
    let bases = [0x1000_0000u64, 0x2000_0000, 0x3000_0000, 0x4000_0000];
    for geo in [&g, &h] {
        let all = kvprobe::transport::all_slices(geo, &bases);
        assert_eq!(all.len() as u64, geo.total_slices().unwrap());
        for (i, d) in all.iter().enumerate() {
            assert_eq!(*d, geo.descriptor(&bases, geo.coord_of(i as u32)), "{i}");
        }
    }
}

#[test]
fn prepared_lists_of_unequal_sides_hold_the_pieces_each_link_moves() {
    use kvprobe::pairing::{Sides, tp::Tp};
    // 2 layers, 4 KV heads of 16 bf16 elements (32-byte rows), HND, 8 blocks of 4 tokens:
    // 512-byte slices, 128 bytes per head.
    let g = kvprobe::geometry::Geometry {
        num_layers: 2,
        num_kv_heads: 4,
        head_size: 16,
        block_size: 4,
        num_blocks: 8,
        dtype: kvprobe::geometry::Dtype::Bf16,
        layout: Layout::Hnd,
        mla: false,
    };
    let tp = |p, d| Tp { prefill: p, decode: d, total_kv_heads: 4, mla: false, state: false };
    let c = |layer, kv, block| SliceCoord { layer, kv, block };
    // Decode TP 2 reads half of each prefill block (vLLM's rank_offset): rank 1's piece is
    // bytes 256.. of prefill's 512-byte slice, its own slice whole.
    let s = Sides::derive(&g, None, None, false).unwrap().with_tp(tp(1, 2)).unwrap();
    assert_eq!(s.cuts(0, 0), Some((vec![(0, 256)], vec![])));
    assert_eq!(s.cuts(0, 1), Some((vec![(256, 256)], vec![])));
    let cuts = Cuts { own: vec![], peer: vec![(256, 256)] }; // decode rank 1 READs
    let (l, r, bytes) =
        indices((&s.decode, &s.prefill), &cuts, [((c(1, KvPart::V, 3), 0), (c(0, KvPart::K, 5), 256), 256)].into_iter()).unwrap();
    let (gl, gr) = (s.decode.global_slice(c(1, KvPart::V, 3)) as i32, s.prefill.global_slice(c(0, KvPart::K, 5)) as i32);
    assert_eq!((l, r, bytes), (vec![gl], vec![gr], 256));
    // The other half of the prefill slice is not this link's: no index names it.
    assert!(
        indices((&s.decode, &s.prefill), &cuts, [((c(1, KvPart::V, 3), 0), (c(0, KvPart::K, 5), 0), 256)].into_iter()).is_err()
    );
    // Prefill TP 2 into decode TP 1: each prefill rank fills its heads' part of decode's slice.
    let s = Sides::derive(&g, None, None, false).unwrap().with_tp(tp(2, 1)).unwrap();
    assert_eq!(s.cuts(1, 0), Some((vec![], vec![(256, 256)])));
    // Decode blocks of 8 tokens = 2 prefill blocks (vLLM's block_size_ratio 2): decode's
    // slices come in two pieces, one per prefill block; a pair of two prefill slices that
    // are contiguous is two pieces on each side.
    let s = Sides::derive(&g, None, Some(8), false).unwrap();
    assert_eq!(s.cuts(0, 0), Some((vec![], vec![(0, 512), (512, 512)])));
    let cuts = Cuts { own: vec![(0, 512), (512, 512)], peer: vec![] };
    let (l, r, _) =
        indices((&s.decode, &s.prefill), &cuts, [((c(0, KvPart::K, 1), 0), (c(1, KvPart::K, 2), 0), 1024)].into_iter()).unwrap();
    let (gl, gr) = (s.decode.global_slice(c(0, KvPart::K, 1)) as i32, s.prefill.global_slice(c(1, KvPart::K, 2)) as i32);
    assert_eq!((l, r), (vec![2 * gl, 2 * gl + 1], vec![gr, gr + 1]));
    let (l, _, _) =
        indices((&s.decode, &s.prefill), &cuts, [((c(0, KvPart::K, 1), 512), (c(1, KvPart::K, 2), 0), 512)].into_iter()).unwrap();
    assert_eq!(l, vec![2 * gl + 1]);
    // A piece that starts inside a cut (a tear, a planted offset) has none.
    assert!(
        indices((&s.decode, &s.prefill), &cuts, [((c(0, KvPart::K, 1), 256), (c(1, KvPart::K, 2), 0), 512)].into_iter()).is_err()
    );
    // The prepared list: cut i of the slice at global index q is entry q x cuts + i.
    let bases = [0x1000_0000u64, 0x2000_0000];
    let all = kvprobe::transport::all_cuts(&s.decode, &bases, &cuts.own);
    assert_eq!(all.len() as u64, 2 * s.decode.total_slices().unwrap());
    for (i, d) in all.iter().enumerate() {
        let (start, len) = s.decode.descriptor(&bases, s.decode.coord_of(i as u32 / 2));
        assert_eq!(len, 1024);
        assert_eq!(*d, (start + (i as u64 % 2) * 512, 512), "{i}");
    }
    // Equal sides: whole slices.
    assert_eq!(Sides::derive(&g, None, None, false).unwrap().cuts(0, 0), Some((vec![], vec![])));
}

#[test]
fn a_pool_beyond_32_bit_indices_needs_create_requests() {
    // 40000 layers x K/V x 32768 blocks = 2 621 440 000 slices of 32 bytes: more than
    // makeXferReq's int indices reach. Refused before anything is allocated, naming the way
    // out; with --xfer-req create this check passes (the run then stops on host memory).
    let geo = ["--layers", "40000", "--blocks", "32768", "--kv-heads", "1", "--head-size", "16", "--block-size", "1"];
    let mut args = vec!["run", "--memory", "dram", "--iterations", "1"];
    args.extend(geo);
    let (code, _, err) = kvprobe(&args);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--xfer-req prepared: the pool has 2621440000 block slices, and NIXL's makeXferReq indexes at most 2147483647; use --xfer-req create"), "{err}");
    args.extend(["--xfer-req", "create"]);
    let (code, _, err) = kvprobe(&args);
    assert_eq!(code, 2, "{err}");
    assert!(!err.contains("makeXferReq"), "{err}");
}

#[test]
fn backend_param_keys_are_checked_against_the_plugins_own() {
    use kvprobe::nixl::check_backend_params;
    let defaults: Vec<String> = ["ucx_devices", "num_workers", "ucx_error_handling_mode"].iter().map(|k| k.to_string()).collect();
    let one = |k: &str| std::collections::BTreeMap::from([(k.to_string(), "1".to_string())]);
    // A default key and a key the UCX plugin reads beyond its defaults are valid.
    assert!(check_backend_params("UCX", &defaults, &one("num_workers")).is_ok());
    assert!(check_backend_params("UCX", &defaults, &one("num_threads")).is_ok());
    // Another plugin knows only its own defaults: UCX's extra keys are not its.
    let e = check_backend_params("POSIX", &["use_uring".to_string()], &one("num_threads")).unwrap_err();
    assert_eq!(e.exit() as i32, 2);
    assert!(e.to_string().contains("NIXL backend POSIX has no parameter \"num_threads\" (valid: use_uring)"), "{e}");
    // An unknown key: exit 2, the valid keys sorted.
    let e = check_backend_params("UCX", &defaults, &one("num_thread")).unwrap_err();
    assert!(
        e.to_string().contains(
            "(valid: device_list, engine_config, num_threads, num_workers, split_batch_size, ucx_devices, ucx_error_handling_mode, ucx_num_device_channels)"
        ),
        "{e}"
    );
}

/// Issue 33 item 12: UCX's TCP transport listens on every network interface it may use, one
/// socket per interface and agent (a one-host run listened on the host's 192.0.2.2 beside
/// 127.0.0.1). Seen from outside, in /proc, while a scenario runs: every listener of a run on
/// one host is on loopback, and kvprobe says it set `UCX_NET_DEVICES`.
#[test]
fn a_run_on_one_host_listens_on_loopback_only() {
    // One process; prefill in its own process (--decode-process: the child's listeners too).
    listens_on_loopback_only(&["--iterations", "1000000"], 2);
    listens_on_loopback_only(&["--decode-process", "--iterations", "1000000"], 2);
}

/// Runs `kvprobe run --memory dram ARGS` until its first iteration (every NIXL agent is up),
/// then reads what it and its children listen on (at least `agents` sockets: one per agent on
/// loopback) and interrupts it: every socket is on loopback.
fn listens_on_loopback_only(args: &[&str], agents: usize) {
    let dir = tmpdir("listen-lo");
    let report = dir.join("r.json");
    let mut child = std::process::Command::new(crate::common::bin())
        .args(["run", "--memory", "dram"])
        .args(args)
        .arg("--report")
        .arg(&report)
        .env_remove("UCX_NET_DEVICES")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    crate::common::wait_for_stderr_line(&mut child, "iteration 1/");
    let seen: Vec<std::net::SocketAddr> = std::iter::once(pid)
        .chain(crate::common::children(pid))
        .flat_map(|p| kvprobe::sys::net::listening(p).unwrap_or_default())
        .collect();
    assert!(seen.len() >= agents, "{args:?}: {seen:?}");
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(pid as i32, libc::SIGINT) };
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(130), "{args:?}: interrupted");
    for a in &seen {
        let lo = match a.ip() {
            std::net::IpAddr::V4(v4) => v4.octets()[0] == 127,
            std::net::IpAddr::V6(v6) => v6 == std::net::Ipv6Addr::LOCALHOST,
        };
        assert!(lo, "{args:?}: a one-host run listens on {a}: {seen:?}");
    }
    let r = read_report(&report);
    let defaults = r["environment"]["transport_env_defaults"].as_array().unwrap();
    assert!(defaults.iter().any(|d| d == "UCX_NET_DEVICES"), "{defaults:?}");
}

/// A listener an agent's backend opens on a wildcard address (the test hook opens one as a
/// library could) is refused, exit 2 naming it; a run
/// whose `UCX_NET_DEVICES` the user set to loopback is held to it too.
#[test]
fn an_agent_listening_wider_than_asked_is_not_run() {
    for user_lo in [false, true] {
        let mut env = vec![("KVPROBE_TEST_WIDE_LISTENER", "1")];
        if user_lo {
            env.push(("UCX_NET_DEVICES", "lo"));
        }
        let (code, _, log) = run("listen-wide", &["--iterations", "1"], &env);
        assert_eq!(code, 2, "{log}");
        assert!(log.contains("listens on 0.0.0.0:") && log.contains("wider than asked"), "{log}");
        assert!(
            log.contains(if user_lo { "UCX_NET_DEVICES=lo asks for loopback only" } else { "asks for loopback only" }),
            "{log}"
        );
    }
    // Without the hook the same run is clean.
    let (code, _, log) = run("listen-ok", &["--iterations", "1"], &[]);
    assert_eq!(code, 0, "{log}");
}
