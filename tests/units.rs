//! Library pieces of the scenario machinery: the request stream, race flags, the tier
//! store, and the `ab` exit rule.

use kvprobe::Exit;
use kvprobe::ab::{AbRow, matrix_exit};
use kvprobe::mechanism::{Fencing, Mechanism, RaceSpec, Races, Scenario};
use kvprobe::pool::TableEntry;
use kvprobe::tier::{Content, Store};
use kvprobe::workload::{Workload, WorkloadConfig, chain_hash};

fn wl(prefix_share: f64) -> WorkloadConfig {
    WorkloadConfig { min_blocks: 2, max_blocks: 8, prefix_share, abort_rate: 0.1 }
}

#[test]
fn workload_is_seeded_and_shares_prefixes() {
    let mut a = Workload::new(wl(0.5), 7);
    let mut b = Workload::new(wl(0.5), 7);
    let ra: Vec<_> = (0..500).map(|_| a.next_request()).collect();
    let rb: Vec<_> = (0..500).map(|_| b.next_request()).collect();
    assert_eq!(ra, rb, "same seed, same stream");
    let mut c = Workload::new(wl(0.5), 8);
    assert_ne!(ra[1..20], (0..20).map(|_| c.next_request()).collect::<Vec<_>>()[1..20]);
    let shared = ra.iter().filter(|r| r.shared > 0).count();
    assert!((150..350).contains(&shared), "about half share a prefix: {shared}");
    let aborts = ra.iter().filter(|r| r.abort).count();
    assert!((20..90).contains(&aborts), "about 10% abort: {aborts}");
    for (i, r) in ra.iter().enumerate() {
        assert!((2..=8).contains(&r.hashes.len()));
        assert_eq!(r.id, i as u64);
        // A shared prefix is exactly some earlier prompt's leading blocks; the rest chain on.
        if r.shared > 0 {
            assert!(ra[..i].iter().any(|e| e.hashes.len() >= r.shared && e.hashes[..r.shared] == r.hashes[..r.shared]));
        }
    }
    let none: Vec<_> = {
        let mut w = Workload::new(wl(0.0), 7);
        (0..200).map(|_| w.next_request()).collect()
    };
    assert!(none.iter().all(|r| r.shared == 0));
}

#[test]
fn chain_hash_depends_on_parent_and_tokens() {
    assert_ne!(chain_hash(1, 5), chain_hash(2, 5));
    assert_ne!(chain_hash(1, 5), chain_hash(1, 6));
    assert_eq!(chain_hash(9, 9), chain_hash(9, 9));
}

#[test]
fn race_flags_parse_and_resolve() {
    let s: RaceSpec = "save-after-free".parse().unwrap();
    assert_eq!((s.mechanism, s.fencing), (Mechanism::SaveAfterFree, Fencing::Unfenced));
    let f: RaceSpec = "unfenced-load=fenced".parse().unwrap();
    assert_eq!(f.fencing, Fencing::Fenced);
    assert!("save-after-free=sometimes".parse::<RaceSpec>().is_err());
    assert!("nope".parse::<RaceSpec>().unwrap_err().contains("load-into-reading"));
    let r = Races::from_specs(&[
        "save-after-free".parse().unwrap(),
        "unfenced-load".parse().unwrap(),
        "save-after-free=fenced".parse().unwrap(),
    ]);
    assert_eq!(r.list(), vec![Mechanism::UnfencedLoad], "later flags win");
    assert!(Races::from_specs(&[]).all_fenced());
    for m in Mechanism::ALL {
        assert_eq!(m.name().parse::<Mechanism>().unwrap(), m);
        assert!(m.explain().starts_with("unfenced:"));
        assert_eq!(Races::only(m).list(), vec![m]);
    }
    assert!(Scenario::Stacked.uses_nixl() && Scenario::Stacked.uses_tier());
    assert!(!Scenario::TierOnly.uses_nixl() && !Scenario::NixlOnly.uses_tier());
}

fn te(block: u32, generation: u32) -> TableEntry {
    TableEntry::new(block, generation)
}

#[test]
fn store_reserves_completes_pins_and_evicts_lru() {
    let mut s = Store::new(2, 64, None).unwrap();
    let a = s.reserve(10, te(10, 1)).unwrap();
    assert!(s.reserve(10, te(10, 2)).is_none(), "a pending key is not saved twice");
    assert!(s.lookup_prefix(&[10]).is_empty(), "pending entries are invisible");
    s.arena().unwrap().write_entry(a, |mut b| b.write_at(0, &[0xAB; 64])).unwrap().unwrap();
    s.complete(a, Content { id: te(10, 1), cause: None });
    s.unpin(a);
    assert_eq!(s.lookup_prefix(&[10, 11]), vec![a], "longest complete prefix");
    s.unpin(a);
    let b = s.reserve(11, te(11, 1)).unwrap();
    s.complete(b, Content { id: te(11, 1), cause: None });
    s.unpin(b);
    assert_eq!(s.len(), 2);
    // Full: the least recently used unpinned entry (10) goes.
    let c = s.reserve(12, te(12, 1)).unwrap();
    assert_eq!(c, a, "entry 10's slot is reused");
    assert_eq!(s.evictions, 1);
    assert!(!s.contains(10) && s.contains(11) && s.contains(12));
    // Everything pinned: the save is skipped and counted.
    s.pin(b);
    assert!(s.reserve(13, te(13, 1)).is_none());
    assert_eq!(s.full_skips, 1);
    assert_eq!(s.promised(b), te(11, 1));
    assert_eq!(s.arena().unwrap().read_entry(b, |b| b.len()).unwrap(), 64);
}

fn row(unfenced: Option<Mechanism>, corrupt: u64, verdict: &str, pass: bool, unexplained: u64) -> AbRow {
    AbRow {
        name: "x".into(),
        scenario: Scenario::Stacked,
        unfenced,
        push: false,
        staging: false,
        requests: 1,
        slices_checked: 1,
        corrupt,
        classes: Default::default(),
        unexplained,
        ownership_violations: Some(0),
        expect: if unfenced.is_some() { "detected" } else { "clean" }.into(),
        verdict: verdict.into(),
        why: None,
        pass,
    }
}

#[test]
fn ab_exit_rule() {
    let ok = vec![row(None, 0, "clean", true, 0), row(Some(Mechanism::SaveAfterFree), 5, "detected", true, 0)];
    assert_eq!(matrix_exit(&ok), Exit::Clean);
    let missed = vec![row(None, 0, "clean", true, 0), row(Some(Mechanism::SaveAfterFree), 0, "not reproduced", false, 0)];
    assert_eq!(matrix_exit(&missed), Exit::NotReproduced);
    let defect = vec![row(None, 3, "corrupt", false, 3), row(Some(Mechanism::SaveAfterFree), 0, "not reproduced", false, 0)];
    assert_eq!(matrix_exit(&defect), Exit::Corrupt, "a corrupt fenced row wins over a missed mechanism");
    let unexplained = vec![row(None, 0, "clean", true, 0), row(Some(Mechanism::UnfencedLoad), 9, "detected", false, 2)];
    assert_eq!(matrix_exit(&unexplained), Exit::Corrupt);
    // A fenced row that broke a block's ownership fails the matrix as corruption would.
    let broken = vec![AbRow { ownership_violations: Some(4), pass: false, ..row(None, 0, "clean", false, 0) }, ok[1].clone()];
    assert_eq!(matrix_exit(&broken), Exit::Corrupt);
    assert_eq!(Exit::NotReproduced as u8, 6);
}

/// UCX_PROTO_INFO output as UCX 1.19 (the NIXL wheel's) prints it on the H200 host for a
/// VRAM READ on one GPU without cuda_ipc get-zcopy, with a host-memory table around it.
const UCX_EMULATION_LOG: &str = "\
[1795982121.101940] [vm:921  :0]   +--------------------------------+-------------------------------------+
[1795982121.101940] [vm:921  :0]   | remote memory write by ucp_put* from host memory to host |
[1795982121.101940] [vm:921  :0]   +---------------+-------------+----------------------------+
[1795982121.101940] [vm:921  :0]   | Range         | Description | Config                     |
[1795982121.101940] [vm:921  :0]   +---------------+-------------+----------------------------+
[1795982121.101940] [vm:921  :0]   | 0..inf        | zero-copy   | cma/memory                 |
[1795982121.101940] [vm:921  :0]   +---------------+-------------+----------------------------+
[1795982121.202020] [vm:921  :0]   | remote memory read by ucp_get*(multi) into cuda/dev[0] from cuda/dev[0] |
[1795982121.202020] [vm:921  :0]   +--------+--------------------+--------+
[1795982121.202020] [vm:921  :0]   | Range  | Description        | Config |
[1795982121.202020] [vm:921  :0]   +--------+--------------------+--------+
[1795982121.202020] [vm:921  :0]   | 0..inf | software emulation | tcp/lo |
[1795982121.202020] [vm:921  :0]   +--------+--------------------+--------+
[1795982121.303030] [vm:921  :0]        ucp_worker.c:1234 UCX  WARN  something UCX wanted said
";

#[test]
fn ucx_tables_are_parsed_and_emulation_is_flagged() {
    use kvprobe::ucx::{TransportPath, classify, parse};
    let sel = parse(UCX_EMULATION_LOG);
    assert_eq!(sel.len(), 2, "{sel:?}");
    assert_eq!(sel[0].operation, "remote memory write by ucp_put* from host memory to host");
    assert_eq!((sel[0].rows[0].description.as_str(), sel[0].rows[0].config.as_str()), ("zero-copy", "cma/memory"));
    let base = || TransportPath { backend: "UCX".into(), ..Default::default() };
    // A VRAM READ: the cuda table only, flagged, with the advice.
    let p = classify(UCX_EMULATION_LOG, base(), "READ", true);
    assert_eq!(p.selections.len(), 1);
    assert!(p.selections[0].operation.contains("into cuda/dev[0] from cuda/dev[0]"));
    assert!(p.emulated);
    assert!(p.warning.as_deref().unwrap().contains("UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y"));
    assert_eq!(p.ucx_messages.len(), 1);
    assert!(p.ucx_messages[0].contains("UCX  WARN"));
    // A DRAM READ saw no host read table: unknown, not guessed.
    let p = classify(UCX_EMULATION_LOG, base(), "READ", false);
    assert!(p.selections.is_empty() && !p.emulated && p.warning.is_none());
    assert!(p.unknown_because.unwrap().contains("remote memory read"));
    // A DRAM WRITE: the host table, not emulated.
    let p = classify(UCX_EMULATION_LOG, base(), "WRITE", false);
    assert_eq!(p.selections.len(), 1);
    assert!(!p.emulated);
    assert_eq!(kvprobe::ucx::describe(&p), "UCX 0..inf zero-copy via cma/memory");
    // The same table printed again (one per endpoint configuration) is listed once.
    let twice = format!("{UCX_EMULATION_LOG}{UCX_EMULATION_LOG}");
    assert_eq!(parse(&twice).len(), 4);
    assert_eq!(classify(&twice, base(), "WRITE", false).selections.len(), 1);
    assert_eq!(classify(&twice, base(), "READ", true).selections.len(), 1);
}

#[test]
fn a_bench_sweep_on_an_emulated_path_is_marked_not_given_as_the_transfer_rate() {
    use kvprobe::bench::{path_of, rate_words};
    use kvprobe::ucx::{TransportPath, classify};
    let base = || TransportPath { backend: "UCX".into(), ..Default::default() };
    // The VRAM READ of UCX_EMULATION_LOG: software emulation over tcp/lo.
    let emulated = classify(UCX_EMULATION_LOG, base(), "READ", true);
    let (path, flag) = path_of(Some(&emulated));
    assert!(flag);
    assert_eq!(path.as_deref(), Some("UCX 0..inf software emulation via tcp/lo"));
    assert_eq!(rate_words(0.33, flag), "0.33 GB/s EMULATED (UCX's software emulation, not the hardware's transfer rate)");
    // A zero-copy path (the host WRITE table): the plain rate.
    let (path, flag) = path_of(Some(&classify(UCX_EMULATION_LOG, base(), "WRITE", false)));
    assert!(!flag);
    assert_eq!(path.as_deref(), Some("UCX 0..inf zero-copy via cma/memory"));
    assert_eq!(rate_words(3.9, flag), "3.90 GB/s");
    // No path known: not marked, nothing claimed.
    assert_eq!(path_of(None), (None, false));
}

#[test]
fn ucx_unused_variable_warnings_drop_only_kvprobes_own_defaults() {
    use kvprobe::ucx::drop_unused_defaults;
    let mine = vec!["UCX_CUDA_IPC_ENABLE_GET_ZCOPY".to_string()];
    let log = "\
[1] [vm:1:0]   parser.c:2578 UCX  WARN  unused environment variable: UCX_CUDA_IPC_ENABLE_GET_ZCOPY
[1] [vm:1:0]   parser.c:2578 UCX  WARN  (set UCX_WARN_UNUSED_ENV_VARS=n to suppress this warning)
[2] [vm:1:0]   ucp_worker.c:1 UCX  WARN  something else
";
    assert_eq!(drop_unused_defaults(log, &mine), "[2] [vm:1:0]   ucp_worker.c:1 UCX  WARN  something else\n");
    // A user's variable in the same warning stays, with the hint.
    let both = log.replace("variable: UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "variables: UCX_CUDA_IPC_ENABLE_GET_ZCOPY UCX_TYPO");
    let kept = drop_unused_defaults(&both, &mine);
    assert!(kept.contains("UCX  WARN  unused environment variable: UCX_TYPO\n"), "{kept}");
    assert!(kept.contains("UCX_WARN_UNUSED_ENV_VARS") && !kept.contains("GET_ZCOPY"), "{kept}");
    // Nothing kvprobe set: untouched.
    assert_eq!(drop_unused_defaults(log, &[]), log);
    // UCX 1.19's form ends the list with ';' (seen on a pair's decode side).
    let semi = log.replace("variable: UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "variable: UCX_CUDA_IPC_ENABLE_GET_ZCOPY;");
    assert_eq!(drop_unused_defaults(&semi, &mine), "[2] [vm:1:0]   ucp_worker.c:1 UCX  WARN  something else\n");
}

use kvprobe::geometry::{Geometry, KvPart, Layout, SliceCoord};
use kvprobe::sweep::{coalesce, stages};
use kvprobe::transport::Pair;

fn pair(g: &Geometry, layer: u32, kv: KvPart, src: u32, dst: u32) -> Pair {
    Pair::slice(SliceCoord { layer, kv, block: src }, SliceCoord { layer, kv, block: dst }, g.slice_bytes().unwrap())
}

#[test]
fn contiguous_runs_coalesce_into_one_descriptor_each() {
    let mut g = kvprobe::geometry::Preset::Small.geometry(); // 4 layers, 64 blocks, NHD
    let sb = g.slice_bytes().unwrap();
    // Runs of 4 blocks: prefill 0..4 -> decode 8..12, prefill 4..8 -> decode 0..4.
    let map = |b: u32| if b < 4 { 8 + b } else { b - 4 };
    let pairs: Vec<Pair> = (0..8).map(|b| pair(&g, 1, KvPart::V, b, map(b))).collect();
    let out = coalesce(&g, pairs.clone(), 4);
    assert_eq!(
        out,
        vec![Pair { len: 4 * sb, ..pair(&g, 1, KvPart::V, 0, 8) }, Pair { len: 4 * sb, ..pair(&g, 1, KvPart::V, 4, 0) },]
    );
    // Contiguous on both sides across the run boundary still splits at the run size.
    let ident: Vec<Pair> = (0..8).map(|b| pair(&g, 0, KvPart::K, b, b)).collect();
    assert_eq!(coalesce(&g, ident.clone(), 4).len(), 2);
    assert_eq!(coalesce(&g, ident.clone(), 8).len(), 1);
    assert_eq!(coalesce(&g, ident.clone(), 1).len(), 8);
    // A torn pair stays alone and breaks the run; K and V never merge in NHD.
    let mut torn = ident.clone();
    torn[2].len = 100;
    let out = coalesce(&g, torn, 8);
    assert_eq!(out.iter().map(|p| p.len).collect::<Vec<_>>(), vec![2 * sb, 100, 5 * sb]);
    let kv = vec![pair(&g, 0, KvPart::K, 63, 63), pair(&g, 0, KvPart::V, 0, 0)];
    assert_eq!(coalesce(&g, kv, 64).len(), 2, "K's last block and V's first are adjacent but different runs");
    // HND: a block's K and V are adjacent, so a run of 2 blocks is one descriptor of 4 slices.
    g.layout = Layout::Hnd;
    let hnd: Vec<Pair> = (0..2).flat_map(|b| [pair(&g, 2, KvPart::V, b, b + 2), pair(&g, 2, KvPart::K, b, b + 2)]).collect();
    assert_eq!(coalesce(&g, hnd, 2), vec![Pair { len: 4 * sb, ..pair(&g, 2, KvPart::K, 0, 2) }]);
}

#[test]
fn pipeline_stages_cover_every_layer_once() {
    let mut g = kvprobe::geometry::Preset::Llama3_8b.geometry(); // 32 layers
    // Default: one stage (the transfer measured alone), 8 across two GPUs.
    assert_eq!(stages(&g, None, false), vec![0..32]);
    assert_eq!(stages(&g, None, true).len(), 8);
    let s = stages(&g, Some(8), false);
    assert_eq!(s.len(), 8);
    assert_eq!(s[0], 0..4);
    assert_eq!(s[7], 28..32);
    let s = stages(&g, Some(5), false);
    assert_eq!(s.iter().map(|r| r.len()).sum::<usize>(), 32);
    assert!(s.windows(2).all(|w| w[0].end == w[1].start) && s.iter().all(|r| r.len() >= 6));
    assert_eq!(stages(&g, Some(99), false).len(), 32, "at most one per layer");
    // More than 65536 descriptors per stage: more stages (here 2^20 blocks x 64 slices).
    g.num_blocks = 1 << 20;
    assert_eq!(stages(&g, None, false).len(), 32);
    g.num_blocks = 1 << 14; // 2^20 slices: 16 stages of 2 layers
    assert_eq!(stages(&g, None, false).len(), 16);
}

#[test]
fn byte_counts_read_in_binary_units_with_the_exact_value() {
    use kvprobe::report::{bytes_binary, bytes_exact};
    assert_eq!(bytes_exact(211_353_600_000), "196.84 GiB (211353600000 bytes)");
    assert_eq!(bytes_exact(2 << 20), "2.00 MiB (2097152 bytes)");
    assert_eq!(bytes_exact(1536), "1.50 KiB (1536 bytes)");
    assert_eq!(bytes_exact(1023), "1023 bytes");
    assert_eq!(bytes_binary(16_908_288_000_000), "15.38 TiB");
    assert_eq!(bytes_binary(u64::MAX), "16.00 EiB");
}

#[test]
fn the_bench_breakdown_takes_the_median_iteration_after_the_warm_up() {
    use kvprobe::bench::representative;
    use kvprobe::report::IterationTimes;
    let t = |s: f64| IterationTimes { iteration: s, ..Default::default() };
    assert_eq!(representative(&[]), None);
    assert_eq!(representative(&[t(9.0)]), Some(0), "one iteration: itself");
    assert_eq!(representative(&[t(9.0), t(2.0)]), Some(1), "the warm-up is left out");
    // Neither the warm-up nor the last (no refill for a next iteration): 3, 1 -> lower middle 1
    // at index 2.
    assert_eq!(representative(&[t(9.0), t(3.0), t(1.0), t(2.0)]), Some(2));
    assert_eq!(representative(&[t(9.0), t(3.0), t(0.1)]), Some(1), "three: the middle one");
    // Odd count of steady iterations: 4, 1, 3 -> 3 at index 3.
    assert_eq!(representative(&[t(0.5), t(4.0), t(1.0), t(3.0), t(2.0)]), Some(3));
}

#[test]
fn parallel_passes_visit_every_part_once_whatever_the_thread_count() {
    for threads in [0usize, 1, 2, 7, 64] {
        let mut v = vec![0u32; 1000];
        kvprobe::parallel::for_each(v.chunks_mut(7).enumerate(), threads, |(i, part)| {
            for x in part.iter_mut() {
                *x += i as u32 + 1;
            }
        });
        let want: Vec<u32> = (0..1000).map(|j| (j / 7) as u32 + 1).collect();
        assert_eq!(v, want, "{threads} threads");
    }
}

// The verify kernel's failure list, decoded and checked on the host (issue 13.1): what the
// device returns can never panic kvprobe or pass as fewer failures.
use kvprobe::error::Error;
use kvprobe::pool::decode_device_failures;

/// 2 layers x K/V x 3 blocks = 12 slices of 4 * 1 * 8 * 2 = 64 bytes.
fn failure_list_geom() -> Geometry {
    Geometry {
        num_layers: 2,
        num_kv_heads: 1,
        head_size: 8,
        block_size: 4,
        num_blocks: 3,
        dtype: kvprobe::geometry::Dtype::Bf16,
        layout: Layout::Nhd,
        mla: false,
    }
}

fn failure_rec(slice: u32, bad: u32, first: u32) -> [u8; 16] {
    let mut r = [0u8; 16];
    for (i, v) in [slice, bad, first, 0].into_iter().enumerate() {
        r[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
    }
    r
}

fn failure_list(recs: &[[u8; 16]]) -> Vec<u8> {
    recs.concat()
}

#[test]
fn device_failures_merge_a_slices_parts_and_sort() {
    let raw = failure_list(&[failure_rec(7, 2, 40), failure_rec(0, 1, 0), failure_rec(7, 3, 5), failure_rec(11, 64, 0)]);
    let got: Vec<_> = decode_device_failures(&raw, 4, &failure_list_geom())
        .unwrap()
        .into_iter()
        .map(|f| (f.slice, f.bad_bytes, f.first_bad))
        .collect();
    assert_eq!(got, vec![(0, 1, 0), (7, 5, 5), (11, 64, 0)]);
    assert!(decode_device_failures(&[], 0, &failure_list_geom()).unwrap().is_empty());
}

#[test]
fn a_count_above_the_lists_capacity_is_a_device_error() {
    // The kernel counted 3 records but the list held 2 (raw has only what fit).
    let raw = failure_list(&[failure_rec(1, 1, 0), failure_rec(2, 1, 0)]);
    let e = decode_device_failures(&raw, 3, &failure_list_geom()).unwrap_err();
    assert!(matches!(e, Error::Device(_)), "{e:?}");
    assert!(e.to_string().contains("counted 3 failing slice parts but its list holds 2"), "{e}");
    // A garbage count from a stale allocation: an error, not a huge allocation or panic.
    assert!(matches!(decode_device_failures(&[], u32::MAX, &failure_list_geom()), Err(Error::Device(_))));
}

#[test]
fn impossible_failure_records_are_device_errors_not_panics() {
    for bad in [
        failure_rec(12, 1, 0),
        failure_rec(u32::MAX, 1, 0),
        failure_rec(3, 0, 0),
        failure_rec(3, 65, 0),
        failure_rec(3, 1, 64),
        failure_rec(3, 1, u32::MAX),
    ] {
        let raw = failure_list(&[failure_rec(0, 1, 0), bad]);
        let e = decode_device_failures(&raw, 2, &failure_list_geom()).unwrap_err();
        assert!(matches!(e, Error::Device(_)), "{e:?}");
        assert!(e.to_string().contains("impossible failure record"), "{e}");
    }
    // The largest valid record is accepted.
    assert_eq!(decode_device_failures(&failure_rec(11, 64, 63), 1, &failure_list_geom()).unwrap().len(), 1);
}

/// The `ls -l /proc/self/fd` of a child started through kvprobe's spawner, given `keep` (a
/// descriptor to inherit).
fn child_fds(keep: Option<i32>) -> String {
    use std::process::Stdio;
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", "ls -l /proc/self/fd"]).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = kvprobe::child::spawn_keeping(cmd, keep.as_slice()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The descriptor numbers `ls -l /proc/self/fd` lists as sockets.
fn socket_fds(ls: &str) -> Vec<i32> {
    ls.lines()
        .filter(|l| l.contains("-> socket:"))
        .filter_map(|l| l.split(" -> ").next()?.split_whitespace().last()?.parse().ok())
        .collect()
}

#[test]
fn a_child_inherits_no_descriptor_a_library_opened_without_close_on_exec() {
    // As UCX opens its sockets: no SOCK_CLOEXEC. Two of them, one given to the child.
    // SAFETY: socket(2) with constant arguments; the descriptors are closed below.
    let (leaked, given) =
        unsafe { (libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0), libc::socket(libc::AF_UNIX, libc::SOCK_STREAM, 0)) };
    assert!(leaked >= 3 && given >= 3, "socket(2) failed");
    // SAFETY: fcntl(2) F_GETFD on descriptors just opened.
    let flags = unsafe { (libc::fcntl(leaked, libc::F_GETFD), libc::fcntl(given, libc::F_GETFD)) };
    assert_eq!((flags.0 & libc::FD_CLOEXEC, flags.1 & libc::FD_CLOEXEC), (0, 0), "the sockets are not close-on-exec");
    let plain = socket_fds(&child_fds(None));
    let kept = socket_fds(&child_fds(Some(given)));
    // SAFETY: closes the two descriptors this test opened.
    unsafe {
        libc::close(leaked);
        libc::close(given);
    }
    // The child's own standard streams are pipes here, so any socket it holds came from
    // this process (other tests' sockets included: none may reach it).
    assert_eq!(plain, Vec::<i32>::new(), "a child inherited sockets it was not given");
    assert_eq!(kept, vec![given], "the child given descriptor {given} holds these sockets");
}

#[test]
fn a_shareable_pools_memfd_reaches_only_the_child_it_is_given_to() {
    let buf = kvprobe::hostmem::HostBuffer::alloc_shareable(1 << 16).unwrap();
    let fd = buf.shared_fd().unwrap();
    // An ordinary child (as mooncake_master, env's probes, nvidia-smi are started) does not
    // inherit it, through kvprobe's spawner or a plain std spawn alike.
    let plain = child_fds(None);
    assert!(!plain.contains("memfd:kvprobe-pool"), "{plain}");
    let out = std::process::Command::new("sh").args(["-c", "ls -l /proc/self/fd"]).output().unwrap();
    let std_spawn = String::from_utf8(out.stdout).unwrap();
    assert!(!std_spawn.contains("memfd:kvprobe-pool"), "{std_spawn}");
    // The child it is given to (as the Mooncake worker is given the pools' memfds and the
    // prefill process of --decode-process its socket) holds it under the same number.
    let kept = child_fds(Some(fd));
    assert!(kept.lines().any(|l| l.contains(&format!(" {fd} -> /memfd:kvprobe-pool"))), "fd {fd}: {kept}");
    assert_eq!(kept.matches("memfd:kvprobe-pool").count(), 1, "{kept}");
    // Giving it to one child leaks it to no later one.
    let after = child_fds(None);
    assert!(!after.contains("memfd:kvprobe-pool"), "{after}");
}

#[test]
fn a_child_outlives_the_thread_that_asked_for_it() {
    // PR_SET_PDEATHSIG fires when the forking *thread* exits: children are forked by
    // kvprobe's long-lived spawner thread, so one requested from a thread that has ended is
    // not killed. It exits by itself with 7; killed, it would report SIGKILL.
    let mut child = std::thread::spawn(|| {
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", "sleep 1; exit 7"]);
        kvprobe::child::spawn(cmd).unwrap()
    })
    .join()
    .unwrap();
    let st = child.wait().unwrap();
    assert_eq!(st.code(), Some(7), "{st:?}");
}

#[test]
fn host_buffer_ranges_are_checked_not_panics() {
    use kvprobe::hostmem::HostBuffer;
    let mut b = HostBuffer::alloc(4096).unwrap();
    b.write_at(4000, &[7u8; 96]).unwrap();
    let mut got = [0u8; 96];
    b.read_at(4000, &mut got).unwrap();
    assert_eq!(got, [7u8; 96]);
    let usage = |r: kvprobe::error::Result<()>| match r {
        Err(e @ Error::Usage(_)) => assert!(e.to_string().contains("outside") || e.to_string().contains("copy of"), "{e}"),
        r => panic!("expected a usage error, got {r:?}"),
    };
    usage(b.read_at(4000, &mut [0u8; 97]));
    usage(b.read_at(usize::MAX, &mut [0u8; 2]));
    usage(b.write_at(4096, &[1]));
    usage(b.write_at(usize::MAX - 1, &[1, 2, 3]));
    usage(b.span(4095, 2).map(|_| ()));
    usage(b.span_mut(1, 4096).map(|_| ()));
    // Nothing outside the range was touched by the refused writes.
    b.read_at(4000, &mut got).unwrap();
    assert_eq!(got, [7u8; 96]);
    // Spans: sub-ranges are checked too; pieces cover the range once, in order.
    let s = b.span(0, 4096).unwrap();
    usage(s.sub(4000, 97).map(|_| ()));
    usage(s.read_at(4095, &mut [0u8; 2]));
    let lens: Vec<usize> = s.chunks(1000).map(|c| c.len()).collect();
    assert_eq!(lens, [1000, 1000, 1000, 1000, 96]);
    let mut m = b.span_mut(0, 4096).unwrap();
    usage(m.write_at(4095, &[0, 0]));
    usage(m.sub_mut(1, 4096).map(|_| ()));
    for (i, mut c) in m.into_chunks(1024).enumerate() {
        c.write_at(0, &[i as u8 + 1; 1024]).unwrap();
    }
    for i in 0..4 {
        let mut one = [0u8; 1024];
        b.read_at(i * 1024, &mut one).unwrap();
        assert_eq!(one, [i as u8 + 1; 1024]);
    }
    let mut other = HostBuffer::alloc(4096).unwrap();
    usage(other.span_mut(0, 4096).unwrap().copy_from(b.span(0, 4095).unwrap()));
    other.span_mut(0, 4096).unwrap().copy_from(b.span(0, 4096).unwrap()).unwrap();
    let (mut x, mut y) = (vec![0u8; 4096], vec![0u8; 4096]);
    b.read_at(0, &mut x).unwrap();
    other.read_at(0, &mut y).unwrap();
    assert_eq!(x, y);
}

#[test]
fn every_child_process_in_src_is_started_by_the_spawner() {
    // PR_SET_PDEATHSIG and descriptor inheritance are only right for children forked by
    // kvprobe::child's spawner thread: no other module of src/ may spawn one itself (clippy.toml
    // says the same to `cargo clippy`).
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut seen = 0;
    let mut files = Vec::new();
    let mut todo = vec![dir];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(d).unwrap() {
            let path = e.unwrap().path();
            if path.is_dir() {
                todo.push(path);
            } else if path.extension().is_some_and(|x| x == "rs") && !path.ends_with("sys/child.rs") {
                files.push(path);
            }
        }
    }
    assert!(files.len() >= 50, "{files:?}");
    let spawns = regex::Regex::new(r"crate::(sys::)?child::(spawn|spawn_keeping|output)\(").unwrap();
    for path in files {
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            for call in [".spawn()", ".output()", ".status()", "pre_exec(", "libc::fork"] {
                assert!(!line.contains(call), "{}:{}: {call} outside src/sys/child.rs: {line}", path.display(), i + 1);
            }
        }
        seen += spawns.find_iter(&text).count();
    }
    // The master, the worker, the prefill process of --decode-process, env's probe runs and
    // nvidia-smi.
    assert!(seen >= 5, "{seen} spawns through kvprobe::child");
}

/// docs/fingerprint.md's poison of (slot, iteration): little-endian u32 elements, `slot` at even
/// element indices and 0x5A000000 | (iteration & 0xFFFFFF) at odd ones (written here from
/// the definition, not with the code under test).
fn readme_poison(len: usize, slot: u32, iteration: u32) -> Vec<u8> {
    (0..len / 4).flat_map(|e| if e % 2 == 0 { slot } else { 0x5A00_0000 | (iteration & 0xFF_FFFF) }.to_le_bytes()).collect()
}

/// Plants `(offset, byte)` writes into `s`; returns the bad bytes and first bad offset the
/// test expects (a planted byte equal to the poison's is no difference; none: the length).
fn plant(s: &mut [u8], writes: &[(usize, u8)]) -> (u64, u64) {
    let orig = s.to_vec();
    for &(at, b) in writes {
        s[at] = b;
    }
    let bad: Vec<usize> = (0..s.len()).filter(|&i| s[i] != orig[i]).collect();
    (bad.len() as u64, bad.first().map_or(s.len() as u64, |&i| i as u64))
}

#[test]
fn cpu_poison_check_counts_exactly_the_planted_bytes() {
    use kvprobe::fingerprint::{check_poison, poison};
    for (len, slot, iteration) in
        [(16usize, 0u32, 1u32), (48, 7, 0xFF_FFFE), (512, 12345, 3), (528, 9, 2), (4096, 0xFFFF_FFFE, 77)]
    {
        let mut s = readme_poison(len, slot, iteration);
        let mut mine = vec![0u8; len];
        poison(&mut mine, slot, iteration);
        assert_eq!(mine, s, "the code's poison is docs/fingerprint.md's");
        assert_eq!(check_poison(&s, slot, iteration), (0, len as u64), "intact {len}");
        // Another iteration's or slot's poison differs in their bytes only.
        let other_it = readme_poison(len, slot, iteration ^ 1);
        assert_eq!(check_poison(&other_it, slot, iteration), ((len / 8) as u64, 4), "{len}");
        let writes: Vec<(usize, u8)> =
            [(len - 1, 0xEE), (len / 2 + 3, 0x00), (len / 3, s[len / 3]), (5, 0x5A ^ 0xFF), (len - 16, 1)].into_iter().collect();
        let want = plant(&mut s, &writes);
        assert!(want.0 >= 3, "{len}: the planted bytes differ");
        assert_eq!(check_poison(&s, slot, iteration), want, "{len}: planted {writes:?}");
        // Only the last byte.
        let mut t = readme_poison(len, slot, iteration);
        let flipped = !t[len - 1];
        let want = plant(&mut t, &[(len - 1, flipped)]);
        assert_eq!(check_poison(&t, slot, iteration), want);
        assert_eq!(want, (1, len as u64 - 1));
    }
}

#[test]
fn dram_pool_poison_check_reports_each_changed_slice_once_apart_from_verify() {
    use kvprobe::geometry::Dtype;
    let g = Geometry {
        num_layers: 3,
        num_kv_heads: 2,
        head_size: 64,
        block_size: 16,
        num_blocks: 5,
        dtype: Dtype::Bf16,
        layout: Layout::Hnd,
        mla: false,
    };
    let sb = g.slice_bytes().unwrap() as usize;
    let mut pool = kvprobe::pool::KvPool::host(&g, 3).unwrap();
    pool.poison(4).unwrap();
    pool.check_poison_layers(0..3, 4).unwrap();
    assert_eq!(pool.take_poison_failures().unwrap(), (vec![], 30), "an intact pool: every slice checked, none failing");
    // Damage two slices of layers 1 and 2; check layers 1..3.
    let mut expect = Vec::new();
    for (c, writes) in [
        (SliceCoord { layer: 2, kv: KvPart::V, block: 4 }, vec![(100usize, 0x11u8), (sb - 1, 0x22)]),
        (SliceCoord { layer: 1, kv: KvPart::K, block: 0 }, vec![(0, 0xAB)]),
    ] {
        let slot = g.global_slice(c);
        let mut s = readme_poison(sb, slot, 4);
        let (bad, first) = plant(&mut s, &writes);
        pool.write_slice(c, &s).unwrap();
        expect.push((slot, bad, first));
    }
    expect.sort();
    pool.check_poison_layers(1..3, 4).unwrap();
    let (fails, checked) = pool.take_poison_failures().unwrap();
    assert_eq!(checked, 20);
    assert_eq!(fails.iter().map(|f| (f.slice, f.bad_bytes, f.first_bad)).collect::<Vec<_>>(), expect);
    // Taken: the next take is empty, and the verify passes' counts never saw the checks.
    assert_eq!(pool.take_poison_failures().unwrap(), (vec![], 0));
    assert_eq!(pool.take_compared(), kvprobe::pool::Compared::default());
}

/// Memory that records when it is freed.
struct Tracked(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn registered_memory_is_freed_only_when_no_request_holds_a_share_of_it() {
    use kvprobe::nixl::Registered;
    use std::sync::atomic::{AtomicBool, Ordering};
    // No request: dropping the guard frees the memory.
    let f = std::sync::Arc::new(AtomicBool::new(false));
    let g = Registered::with_empty_registration(Tracked(f.clone()));
    assert!(!f.load(Ordering::SeqCst));
    drop(g);
    assert!(f.load(Ordering::SeqCst), "the guard held the last share: memory freed");
    // A request's share (as `Posted` holds one) outlives the guard: the memory is kept.
    let kept = std::sync::Arc::new(AtomicBool::new(false));
    let g = Registered::with_empty_registration(Tracked(kept.clone()));
    let share = g.lease().clone();
    drop(g);
    assert!(!kept.load(Ordering::SeqCst), "a share is held: the memory must not be freed");
    drop(share);
    assert!(!kept.load(Ordering::SeqCst), "kept until exit, not freed when the share goes later");
}

#[test]
fn repeated_ucx_messages_are_given_once_with_their_count() {
    let log = "\
[1796109764.818706] [vm:1    :0]        mpool.c:40   UCX  WARN  object 0x7f3218243a00 {<no debug info>} was not returned to mpool ucp_requests
[1796109764.818710] [vm:1    :0]   | remote memory read by ucp_get* from host memory to host |
[1796109764.818711] [vm:1    :0]        mpool.c:40   UCX  WARN  object 0x7f3218243b40 {<no debug info>} was not returned to mpool ucp_requests
[1796109764.818712] [vm:1    :7]         parser.c:2578 UCX  WARN  unused environment variable: UCX_FOO
[1796109764.818799] [vm:1    :0]        mpool.c:40   UCX  WARN  object 0x7f32182441c0 {<no debug info>} was not returned to mpool ucp_requests
";
    let m = kvprobe::ucx::collapse_messages(log);
    assert_eq!(m.len(), 2, "{m:?}");
    assert!(m[0].contains("0x7f3218243a00") && m[0].ends_with("ucp_requests (and 2 more like it)"), "{m:?}");
    assert!(m[1].ends_with("unused environment variable: UCX_FOO"), "{m:?}");
}

#[test]
fn proc_net_addresses_are_read_as_the_kernel_writes_them() {
    use kvprobe::mooncake::proc_net_addr;
    // /proc/net/tcp on little-endian Linux: 127.0.0.1:8080, 0.0.0.0:15128, 192.0.2.2:49737.
    assert_eq!(proc_net_addr("0100007F:1F90"), Some("127.0.0.1:8080".parse().unwrap()));
    assert_eq!(proc_net_addr("00000000:3B18"), Some("0.0.0.0:15128".parse().unwrap()));
    assert_eq!(proc_net_addr("020200C0:C249"), Some("192.0.2.2:49737".parse().unwrap()));
    // tcp6: [::]:15115, [::1]:80, [::ffff:127.0.0.1]:80.
    assert_eq!(proc_net_addr("00000000000000000000000000000000:3B0B"), Some("[::]:15115".parse().unwrap()));
    assert_eq!(proc_net_addr("00000000000000000000000001000000:0050"), Some("[::1]:80".parse().unwrap()));
    assert_eq!(proc_net_addr("0000000000000000FFFF00000100007F:0050"), Some("[::ffff:127.0.0.1]:80".parse().unwrap()));
    assert_eq!(proc_net_addr("0100007F"), None);
    assert_eq!(proc_net_addr("01007F:0050"), None);
}

#[test]
fn a_server_listening_wider_than_asked_is_refused() {
    use kvprobe::mooncake::check_listening;
    let lo = std::net::IpAddr::from([127, 0, 0, 1]);
    // A child listening on every interface, as Mooncake's metadata server did.
    let wide = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = wide.local_addr().unwrap().port();
    let me = std::process::id();
    let e = check_listening("the test", me, lo).unwrap_err();
    assert_eq!(e.exit(), kvprobe::error::Exit::Usage, "{e:?}");
    assert!(e.to_string().contains(&format!("0.0.0.0:{port}")) && e.to_string().contains("wider than 127.0.0.1"), "{e}");
    // Asked for every interface, it is what was asked.
    assert!(check_listening("the test", me, std::net::IpAddr::from([0, 0, 0, 0])).unwrap().iter().any(|a| a.port() == port));
    drop(wide);
}

/// The Mooncake worker's bind() shim (csrc/bind_host.c), preloaded into a Python process as
/// kvprobe preloads it into the worker: binds to 0.0.0.0 and to a dual-stack [::] land on the
/// address in KVPROBE_BIND_HOST, a named address and a v6-only [::] pass unchanged, and
/// without the variable nothing changes.
#[test]
fn the_bind_shim_narrows_wildcard_binds_to_the_asked_address() {
    let d = crate::common::tmpdir("bind-shim");
    let so = d.join("shim.so");
    std::fs::write(&so, kvprobe::mooncake::BIND_SHIM).unwrap();
    let script = r#"
import socket
def bound(family, addr, v6only=None):
    s = socket.socket(family, socket.SOCK_STREAM)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind(addr)
    return s.getsockname()[0]
print(bound(socket.AF_INET, ("0.0.0.0", 0)))
print(bound(socket.AF_INET6, ("::", 0), 0))
print(bound(socket.AF_INET6, ("::", 0), 1))
print(bound(socket.AF_INET, ("127.0.0.2", 0)))
"#;
    let run = |env: &[(&str, &str)]| {
        let o = std::process::Command::new("python3")
            .args(["-c", script])
            .env("LD_PRELOAD", &so)
            .env_remove("KVPROBE_BIND_HOST")
            .envs(env.iter().copied())
            .output()
            .expect("python3");
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8(o.stdout).unwrap().lines().map(str::to_string).collect::<Vec<_>>()
    };
    assert_eq!(run(&[("KVPROBE_BIND_HOST", "127.0.0.1")]), ["127.0.0.1", "::ffff:127.0.0.1", "::", "127.0.0.2"]);
    assert_eq!(run(&[("KVPROBE_BIND_HOST", "::1")]), ["0.0.0.0", "::1", "::1", "127.0.0.2"]);
    assert_eq!(run(&[]), ["0.0.0.0", "::", "::", "127.0.0.2"]);
    assert_eq!(run(&[("KVPROBE_BIND_HOST", "not-an-address")]), ["0.0.0.0", "::", "::", "127.0.0.2"]);
}

/// An injection is detected as predicted only when it reached a slice and every slice it
/// reached was found as predicted: one that reached nothing is not (sweeps and scenarios).
#[test]
fn an_injection_that_reached_no_slice_is_not_detected() {
    use kvprobe::inject::detected_as_predicted;
    assert!(!detected_as_predicted([]), "reached nothing");
    assert!(detected_as_predicted([true]));
    assert!(detected_as_predicted([true, true, true]));
    assert!(!detected_as_predicted([true, false, true]), "one slice not as predicted");
    assert!(!detected_as_predicted([false]));
}

#[test]
fn tier_entries_are_copied_one_at_a_time_through_spans() {
    use kvprobe::pool::KvPool;
    use kvprobe::tier::TierArena;
    let g = kvprobe::geometry::Preset::Small.geometry();
    let mut src = KvPool::host(&g, 1).unwrap();
    let mut dst = KvPool::host(&g, 2).unwrap();
    let bb = src.block_bytes() as usize;
    // A block of known bytes (not the fingerprint: independent of the code copying it).
    let pattern: Vec<u8> = (0..bb).map(|i| (i * 7 + 3) as u8).collect();
    src.write_block(5, &pattern).unwrap();
    let arena = TierArena::new(3, bb as u64, None).unwrap();
    // A save into entry 1 covers entry 1 only: its span is one block long.
    arena
        .write_entry(1, |e| {
            assert_eq!(e.len(), bb);
            src.read_block_into(5, e)
        })
        .unwrap()
        .unwrap();
    // A load from entry 1 into another pool's block 2 delivers the same bytes.
    arena.read_entry(1, |e| dst.write_block_from(2, e)).unwrap().unwrap();
    let mut got = vec![0u8; bb];
    dst.read_block(2, &mut got).unwrap();
    assert!(got == pattern, "the block came back changed");
    // Its neighbours were not written.
    for id in [0, 2] {
        let mut n = vec![1u8; bb];
        arena.read_entry(id, |e| e.read_at(0, &mut n)).unwrap().unwrap();
        assert!(n.iter().all(|&b| b == 0), "entry {id} was written");
    }
    // An entry past the capacity is an error, not a panic.
    assert!(arena.read_entry(3, |_| ()).is_err());
    assert!(arena.write_entry(u32::MAX, |_| ()).is_err());
}

/// Issue 33 item 7: the shadow takes a prefill write's cause only when it can exist in the run:
/// a mechanism the run leaves unfenced, and never one of decode's own (failed-as-complete,
/// decode-abort-free); anything else is a protocol error (exit 3) and the event is not
/// applied.
#[test]
fn the_shadow_refuses_a_prefill_write_whose_cause_cannot_exist() {
    use kvprobe::peer::steps::{EngineId, Event, What};
    use kvprobe::scenario::shadow::Shadow;
    let genesis = vec![TableEntry::new(7, 0); 4];
    let write = |seq: u64, cause: Option<Mechanism>| Event {
        engine: EngineId::Prefill,
        step: 1,
        seq,
        what: What::Write { block: 1, content: Content { id: TableEntry::new(9, seq as u32), cause } },
    };
    let refused = |s: &mut Shadow, seq: u64, m: Mechanism, why: &str| {
        let e = s.observe(write(seq, Some(m))).unwrap_err();
        assert_eq!(e.exit(), Exit::Transport, "{m}: {e}");
        let msg = e.to_string();
        assert!(msg.contains("a protocol error") && msg.contains(m.name()) && msg.contains(why), "{m}: {msg}");
    };
    // All fenced: a write with no cause is taken; any cause is refused.
    let mut s = Shadow::new(&genesis, Races::default());
    s.observe(write(1, None)).unwrap();
    for m in Mechanism::ALL {
        refused(&mut s, 2, m, "fenced in this run");
    }
    // The refused events were not applied: block 1 still holds the first write, and the next
    // event in sequence is 2.
    assert_eq!(s.content(1), Content { id: TableEntry::new(9, 1), cause: None });
    s.observe(write(2, None)).unwrap();
    // save-after-free and failed-as-complete unfenced: save-after-free's writes are taken;
    // failed-as-complete (decode's own) and a fenced mechanism are refused.
    let races = Races::from_specs(&["save-after-free".parse().unwrap(), "failed-as-complete".parse().unwrap()]);
    let mut s = Shadow::new(&genesis, races);
    s.observe(write(1, Some(Mechanism::SaveAfterFree))).unwrap();
    assert_eq!(s.content(1).cause, Some(Mechanism::SaveAfterFree));
    refused(&mut s, 2, Mechanism::UnfencedLoad, "fenced in this run");
    refused(&mut s, 2, Mechanism::FailedAsComplete, "decode's own");
    let push = Races::from_specs(&["decode-abort-free".parse().unwrap()]);
    refused(&mut Shadow::new(&genesis, push), 1, Mechanism::DecodeAbortFree, "decode's own");
}

/// Issue 33 item 7: a corrupt slice is attributed only to a mechanism stamped on a content
/// that supplied its wrong data. Here an unstamped write during the READ window supplies all of
/// it, and the content at post (stamped, but supplying nothing) lends no cause: unexplained.
/// Stamped on the supplier instead, the same slice is explained by it.
#[test]
fn attribution_takes_no_cause_from_a_content_that_supplied_nothing() {
    use kvprobe::fingerprint::{RowShape, expected};
    use kvprobe::geometry::{KvPart, SliceCoord};
    use kvprobe::scenario::shadow::attribute;
    let g = kvprobe::geometry::Preset::Small.geometry();
    let shape = RowShape::of(&g);
    let seed = 11;
    let c = SliceCoord { layer: 1, kv: KvPart::V, block: 5 };
    let print = |t: TableEntry| expected(seed, &shape.slice(t.identity(c)));
    let (due, at_post, during) = (TableEntry::new(100, 3), TableEntry::new(200, 2), TableEntry::new(300, 3));
    let (want, actual) = (print(due), print(during));
    let m = Mechanism::SaveAfterFree;
    let written = [Content { id: at_post, cause: Some(m) }, Content { id: during, cause: None }];
    assert_eq!(attribute(&actual, &want, seed, &shape, c, &written), (None, during));
    let written = [Content { id: at_post, cause: None }, Content { id: during, cause: Some(m) }];
    assert_eq!(attribute(&actual, &want, seed, &shape, c, &written), (Some(m), during));
}

#[test]
fn the_environment_is_changed_only_while_the_process_has_one_thread() {
    use kvprobe::sys::process::{Resource, SingleThreadedEnv, raise_soft_limit, thread_count};
    // A second thread alive while the leave is asked for: none is given.
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let t = std::thread::spawn(move || rx.recv());
    assert!(thread_count().unwrap() >= 2);
    assert!(SingleThreadedEnv::take().is_none(), "a leave to set_var with other threads alive");
    tx.send(()).unwrap();
    t.join().unwrap().unwrap();
    // The limits as /proc/self/limits states them (read here, not through getrlimit); with a
    // soft limit at least `min` nothing is raised.
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits.lines().find(|l| l.starts_with("Max open files")).unwrap();
    let v: Vec<u64> = line["Max open files".len()..].split_whitespace().take(2).map(|x| x.parse().unwrap()).collect();
    let r = raise_soft_limit(Resource::OpenFiles, 0, 1).unwrap();
    assert_eq!((r.soft, r.hard), (v[0], v[1]));
}

#[test]
fn library_constructors_hold_the_defaults_and_derivations_the_command_line_uses() {
    use kvprobe::geometry::{Dtype, Geometry, Layout};
    use kvprobe::pool::MemoryKind;
    use kvprobe::scenario::config::ScenarioConfig;
    use kvprobe::sweep::{DecodeSide, RunConfig};
    let g = Geometry {
        num_layers: 4,
        num_kv_heads: 8,
        head_size: 64,
        block_size: 16,
        num_blocks: 64,
        dtype: Dtype::Bf16,
        layout: Layout::Hnd,
        mla: false,
    };
    // Prefill TP 2, decode TP 4 and decode blocks of 32 tokens: 4 heads per prefill rank, 2
    // per decode rank, and 64 x 16 tokens in 32-token decode blocks = 32 blocks.
    let mut c = RunConfig::new(MemoryKind::Dram, g.clone());
    let side = DecodeSide { block_size: Some(32), prefill_tp: Some(2), decode_tp: Some(4), ..Default::default() };
    assert_eq!(c.set_decode_side(side).unwrap(), Vec::<String>::new());
    assert_eq!((c.geometry.num_kv_heads, c.geometry.block_size, c.geometry.num_blocks), (4, 16, 64));
    let d = c.decode_geometry.clone().unwrap();
    assert_eq!((d.num_kv_heads, d.block_size, d.num_blocks, d.layout), (2, 32, 32, Layout::Hnd));
    let tp = c.tp.unwrap();
    assert_eq!((tp.prefill, tp.decode, tp.total_kv_heads), (2, 4, 8));
    // A flag that changes nothing is a note; sides vLLM cannot pair are a usage error.
    let mut c = RunConfig::new(MemoryKind::Dram, g.clone());
    let notes = c.set_decode_side(DecodeSide { permute_local_kv: true, ..Default::default() }).unwrap();
    assert!(notes.len() == 1 && notes[0].contains("--permute-local-kv changes nothing"), "{notes:?}");
    assert!(c.decode_geometry.is_none() && c.tp.is_none() && c.permute_local_kv);
    let bad =
        RunConfig::new(MemoryKind::Dram, g.clone()).set_decode_side(DecodeSide { block_size: Some(24), ..Default::default() });
    assert!(matches!(bad, Err(kvprobe::Error::Usage(ref m)) if m.contains("do not divide")), "{bad:?}");
    // The default tier: 16 x the pool's blocks; a tier block is 4 layers x K/V x 16 tokens x
    // 8 heads x 64 x 2 bytes = 128 KiB, so 4 GiB hold 32768 of them; in-flight requests
    // pin 2 x concurrency x their largest prompt.
    assert_eq!(ScenarioConfig::default_tier_blocks(&g, 16, 8), 16 * 64);
    let big = Geometry { num_blocks: 4096, ..g.clone() };
    assert_eq!(ScenarioConfig::default_tier_blocks(&big, 16, 8), 32768);
    assert_eq!(ScenarioConfig::default_tier_blocks(&g, 100, 20), 2 * 100 * 20);
}

#[test]
fn the_failure_tally_counts_every_slice_and_lists_within_each_budget() {
    use kvprobe::fingerprint::BlockIdentity;
    use kvprobe::geometry::{KvPart, SliceCoord};
    use kvprobe::report::{Budget, Failure, Report, Tally};
    use kvprobe::verify::{Class, Verdict};
    let make = |block: u32, class: Class| {
        move || {
            let c = SliceCoord { layer: 0, kv: KvPart::K, block };
            let raw = kvprobe::pool::RawFailure { slice: block, bad_bytes: 1, first_bad: 0 };
            let v = Verdict { class, observed: None, bit_flips: None, sectors: None, displacement: None, rows: None };
            let id = BlockIdentity { layer: 0, kv: KvPart::K, block, generation: 1, token_base: 0 };
            Failure::new(1, c, &raw, v, &[0], &[1], id, block)
        }
    };
    // One budget of 2 (sweeps): 5 slices counted, the first 2 listed, 3 omitted.
    let mut r = Report::start(serde_json::Value::Null);
    let mut t = Tally::new(2);
    let listed: Vec<bool> =
        (0..5).map(|b| t.record(&mut r, None, Budget::Shared, Class::Bitflip, &[1], None, make(b, Class::Bitflip))).collect();
    assert_eq!(listed, [true, true, false, false, false]);
    assert_eq!((r.summary.blocks_corrupt, r.summary.by_class["bitflip"], r.summary.failures_omitted), (5, 5, 3));
    assert_eq!(r.failures.iter().map(|f| f.block).collect::<Vec<_>>(), [0, 1]);
    // Budgets of 2 each (scenarios): 4 explained slices then 3 unexplained ones: the
    // unexplained are listed although the explained budget ran out.
    let mut r = Report::start(serde_json::Value::Null);
    let mut t = Tally::new(2);
    for b in 0..4 {
        t.record(&mut r, None, Budget::Explained, Class::Stale, &[1], None, make(b, Class::Stale));
    }
    for b in 10..13 {
        t.record(&mut r, None, Budget::Unexplained, Class::Unwritten, &[1], None, make(b, Class::Unwritten));
    }
    assert_eq!((r.summary.blocks_corrupt, r.summary.failures_omitted), (7, 3));
    assert_eq!((r.summary.by_class["stale"], r.summary.by_class["unwritten"]), (4, 3));
    assert_eq!(r.failures.iter().map(|f| f.block).collect::<Vec<_>>(), [0, 1, 10, 11]);
}

/// The `--self-test` verdict, from a report's counts alone: it passes only when something
/// was planted, everything asked for was planted, every planted fault was detected as
/// predicted and nothing else is corrupt; each shortfall is named.
#[test]
fn the_self_test_verdict_names_each_shortfall() {
    use kvprobe::geometry::{Dtype, Geometry, Layout};
    use kvprobe::pool::MemoryKind;
    use kvprobe::report::Report;
    use kvprobe::run::self_test_verdict;
    use kvprobe::sweep::RunConfig;
    let g = Geometry {
        num_layers: 4,
        num_kv_heads: 8,
        head_size: 64,
        block_size: 16,
        num_blocks: 64,
        dtype: Dtype::Bf16,
        layout: Layout::Hnd,
        mla: false,
    };
    let mut cfg = RunConfig::new(MemoryKind::Dram, g);
    cfg.self_test = true;
    cfg.iterations = 3;
    cfg.inject = vec!["torn:2".parse().unwrap()];
    // 2 faults x 3 iterations asked for.
    let report = |planted: u64, detected: u64, unexpected: u64| {
        let mut r = Report::start(serde_json::Value::Null);
        r.summary.iterations = 3;
        r.summary.injections_planted = planted;
        r.summary.injections_detected = detected;
        r.summary.unexpected_failures = unexpected;
        r
    };
    assert_eq!(self_test_verdict(&cfg, &report(6, 6, 0)), Ok(()));
    let e = self_test_verdict(&cfg, &report(6, 5, 0)).unwrap_err();
    assert_eq!(e, "1 of 6 planted faults not detected as predicted (injections[].detected)");
    let e = self_test_verdict(&cfg, &report(6, 6, 3)).unwrap_err();
    assert_eq!(e, "3 corrupt block slices that no planted fault predicts");
    let e = self_test_verdict(&cfg, &report(4, 4, 0)).unwrap_err();
    assert_eq!(e, "2 of the 6 faults asked for were never planted (too few requests: raise --requests)");
    let e = self_test_verdict(&cfg, &report(6, 4, 1)).unwrap_err();
    assert!(e.contains("2 of 6 planted") && e.contains("; 1 corrupt block slices"), "{e}");
    cfg.inject.clear();
    let e = self_test_verdict(&cfg, &report(0, 0, 0)).unwrap_err();
    assert!(e.starts_with("nothing was planted"), "{e}");
}

/// UCX's "connect(...) failed" errors, read from its log: each address once, with its reason;
/// other lines (warnings, errors of another form) are not connections.
#[test]
fn ucx_connect_failures_name_each_address_and_reason() {
    let log = "\
[1796609581.367479] [vm:1    :0]            sock.c:355  UCX  ERROR   connect(fd=31, dest_addr=198.18.0.2:48027) failed: Connection timed out
[1796609581.367480] [vm:1    :0]            sock.c:355  UCX  ERROR   connect(fd=32, dest_addr=198.18.0.2:48027) failed: Connection timed out
[1796609581.367481] [vm:1    :0]            sock.c:355  UCX  ERROR   connect(fd=33, dest_addr=[fe80::1]:5000) failed: No route to host
[1796609574.991959] [vm:1    :0]          parser.c:2578 UCX  WARN  unused environment variable: UCX_CUDA_IPC_ENABLE_SAME_PROCESS;
[1796609574.991960] [vm:1    :0]       ucp_worker.c:100 UCX  ERROR   failed to create endpoint
";
    assert_eq!(
        kvprobe::ucx::connect_failures(log),
        vec![
            ("198.18.0.2:48027".to_string(), "Connection timed out".to_string()),
            ("[fe80::1]:5000".to_string(), "No route to host".to_string())
        ]
    );
    assert!(kvprobe::ucx::connect_failures("").is_empty());
}
