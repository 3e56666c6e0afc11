//! `--dump DIR`: the failing block slices exactly as they arrived, for a vendor to check
//! without kvprobe's GPU or NIXL (`kvprobe report check`, `check`).
//!
//! Layout (docs/report.md "Dumps"): `DIR/index.json` ([`DumpIndex`], schema [`SCHEMA`]),
//! `DIR/slices/<iteration>-<layer>-<K|V|latent>-<block>.bin` (one per dumped slice, the bytes
//! the verify pass read back from the decode slot: on VRAM only that failing slice crosses to
//! the host, the buffer the classification already reads; in a run whose decode converts on
//! receive, the converted bytes the verify judged, with the bytes NIXL delivered beside them as
//! `<name>.received.bin`, [`DumpEntry::received_file`]), and `DIR/scripts/fingerprint_ref.py`
//! (kvprobe's independent Python reference of the fingerprint, so each slice's `regenerate`
//! command, and its `observed_regenerate` command where the slice is exactly another identity's
//! fingerprint or the poison, runs from `DIR` as written).
//!
//! Slices are written as failures are classified, up to a cap of bytes (`--dump-max-bytes`);
//! counts stay complete ([`ClassCount`]). The cap keeps variety ([`Dumper::wants`]): half of
//! it is reserved room split evenly between the classes, so the first failures of every
//! class are taken before more of any one class fill the other half. A write that fails
//! (disk full) stops the dump (`dump_truncated`, with the reason) and never the run.

use crate::core::fingerprint::{RowOrder, RowShape};
use crate::core::pairing::tp::Tp;
use crate::core::verify::Class;
use crate::error::{Error, Result};
pub use crate::report::DumpSummary;
use crate::report::Failure;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Schema of `index.json`.
pub const SCHEMA: &str = "kvprobe.dump/1";

/// Default cap of slice bytes written (`--dump-max-bytes`): 256 MiB.
pub const DEFAULT_MAX_BYTES: u64 = 256 << 20;

/// Which fingerprint definition the expected bytes follow (docs/fingerprint.md "Fingerprint format",
/// `csrc/fingerprint.h`, `pysrc/fingerprint_ref.py`).
pub const FINGERPRINT: &str = crate::core::fingerprint::FORMAT;

/// The fingerprint's Python reference, copied into every dump as `scripts/fingerprint_ref.py`.
pub const REF_SCRIPT: &str = include_str!("../../pysrc/fingerprint_ref.py");

/// The cap's rule, as written into `index.json`.
pub const RULE: &str = "a slice is written while bytes_written + its size <= max_bytes, and then: into its class's \
reserved room (reserve_per_class_bytes = max_bytes / (2 x 8 classes)) while the class has written no more than that; \
else always when its class has no slice written yet; else into the shared room (max_bytes - 8 x reserve_per_class_bytes) \
while the bytes written beyond every class's reserve fit in it";

/// Slices of one class written and left out (cap or a failed write).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClassCount {
    /// Slices written to `slices/`.
    pub written: u64,
    /// Slices not written (the cap, or the dump stopped: `dump_truncated`).
    pub omitted: u64,
}

/// One dumped slice: its failure record (the report's fields: coordinates, class, expected
/// identity, `poison_iteration`, digests, `first_bad_offset`, `bad_bytes`, sector map,
/// observed identity), the file holding its bytes, how to regenerate the expected bytes and,
/// when one command can, the received bytes themselves.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DumpEntry {
    /// The slice's bytes exactly as they arrived, relative to the dump directory.
    pub file: String,
    /// Size of `file` (bytes; the geometry's `slice_bytes`).
    pub bytes: u64,
    /// Runs whose decode converts on receive (`--decode-layout`/`--decode-block-size`,
    /// `--permute-local-kv`: [`crate::core::pairing::Sides::converts`]) only: the slice as NIXL
    /// delivered it, before decode's conversion, relative to the dump directory
    /// (`slices/<name>.received.bin`, `bytes` long; `file` holds the converted bytes the verify
    /// judged and the record describes). Recovered from the converted bytes by undoing the
    /// conversion's row permutation ([`crate::core::pairing::Sides::unconvert`]), which moves whole
    /// rows and is a bijection (checked before use), so no byte is lost or made up. Absent
    /// elsewhere.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub received_file: Option<String>,
    /// Index of this slice's record in the report's `failures` (null: not listed there,
    /// `--max-failures`).
    pub report_index: Option<usize>,
    /// A shell command, run from the dump directory, that writes the expected bytes to
    /// `expected/<file name>` and prints their SHA-256 (`expected_digest`): the fingerprint of
    /// `expected`, or for a `stray` slice found by the poison check, the poison of (`slot`,
    /// `poison_iteration`).
    pub regenerate: String,
    /// Present only when `file` (the bytes the verify judged) is *exactly* what one command
    /// regenerates, this command, run from the dump directory like `regenerate`: it writes
    /// those bytes to `observed/<file name>` and prints their SHA-256 (`actual_digest`). Either
    /// the fingerprint of the record's `observed` identity (the decode pool's rows, as
    /// `regenerate`: a `misplaced`, `stale` or `overwritten` slice, a stray that landed whole)
    /// or the poison of (`slot`, `poison_iteration`) (an `unwritten` slice). Decided at dump
    /// time by comparing the bytes with both ([`observed_regenerate_command`]); absent when
    /// neither equals them byte for byte (`bitflip`, `torn`, `garbage`, `layout`: no single
    /// command reproduces them), and in dumps of kvprobes before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_regenerate: Option<String>,
    /// The failure record, as in the report.
    #[serde(flatten)]
    pub failure: Failure,
}

/// `index.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DumpIndex {
    /// Always [`SCHEMA`].
    pub schema: String,
    /// The run's seed (an integer).
    pub seed: u64,
    /// The same seed as `"0x"` + 16 hex digits.
    pub seed_hex: String,
    /// The geometry of the dumped (decode) slices, as the report's
    /// `config.decode_geometry`, else `config.geometry` ([`dumped_geometry`]).
    pub geometry: serde_json::Value,
    /// Bytes per slice file.
    pub slice_bytes: u64,
    /// [`FINGERPRINT`].
    pub fingerprint: String,
    /// The cap (`--dump-max-bytes`, bytes).
    pub max_bytes: u64,
    /// Reserved room per class (bytes).
    pub reserve_per_class_bytes: u64,
    /// [`RULE`].
    pub rule: String,
    /// Bytes of slice files written (`received_file`s included).
    pub bytes_written: u64,
    /// Per class (every class, zeros included): slices written and omitted.
    pub by_class: BTreeMap<String, ClassCount>,
    /// Why the dump stopped before the run ended (a write failed), if it did.
    pub dump_truncated: Option<String>,
    /// The dumped slices, in the order they were found.
    pub slices: Vec<DumpEntry>,
}

/// Test-only fault hook: `KVPROBE_TEST_DUMP_FULL_AFTER=N` makes every slice write after the
/// first N fail with ENOSPC (a full disk), to show that the dump stops and the run does not.
pub const FULL_AFTER_VAR: &str = crate::sys::test_hooks::DUMP_FULL_AFTER;

fn full_after() -> Option<u64> {
    static N: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *N.get_or_init(|| std::env::var(FULL_AFTER_VAR).ok().and_then(|v| v.parse().ok()))
}

/// Checks, before a run, that `dir` can take a dump: absent (it is created) or an empty
/// directory. Errors: [`Error::Usage`] (exit 2) for a non-empty directory or a non-directory,
/// [`Error::Io`] when it cannot be created.
pub fn check_dir(dir: &Path) -> Result<()> {
    match std::fs::read_dir(dir) {
        Ok(mut it) => {
            if it.next().is_some() {
                return Err(Error::Usage(format!(
                    "--dump {}: the directory is not empty (give a new or empty directory: a dump never mixes runs)",
                    dir.display()
                )));
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::create_dir_all(dir)
            .map_err(|e| Error::Io(format!("--dump {}: cannot create the directory: {e}", dir.display()))),
        Err(_) if dir.exists() => Err(Error::Usage(format!("--dump {}: not a readable directory", dir.display()))),
        Err(e) => Err(Error::Io(format!("--dump {}: {e}", dir.display()))),
    }
}

/// Writes failing slices into a dump directory (see the module docs). The state is shared
/// with the watchdog ([`finish_active`]), so a run it ends still leaves `index.json`.
pub struct Dumper {
    state: Arc<Mutex<State>>,
}

/// The dump being written (at most one at a time: a run, or the ab row in progress), for the
/// watchdog.
static ACTIVE: Mutex<Option<Arc<Mutex<State>>>> = Mutex::new(None);

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

struct State {
    dir: PathBuf,
    index: DumpIndex,
    class_bytes: BTreeMap<Class, u64>,
    /// The decode pool's rows (rank 0's with TP).
    shape: RowShape,
    /// The run's TP sizes (`config.tp`), when it has TP ranks: each failure's rows start at
    /// its decode rank's first head ([`rank_shape`]).
    tp: Option<Tp>,
    names: HashSet<String>,
    /// The class of every failing slice offered or omitted, in the order found.
    found: Vec<Class>,
    /// For each entry of `index.slices`, its position in `found`.
    entry_at: Vec<usize>,
    /// Set once `index.json` was written.
    finished: Option<DumpSummary>,
}

impl Dumper {
    /// A dump into `dir` (checked by [`check_dir`]; created when absent) of slices of
    /// `slice_bytes` bytes, capped at `max_bytes`; `geometry` is the report's
    /// `config.geometry` and `shape` the decode pool's rows (the `regenerate` commands name
    /// them); `config_tp` the report's `config.tp` (null without TP ranks). Writes
    /// `scripts/fingerprint_ref.py` and creates `slices/`.
    pub fn new(
        dir: &Path,
        max_bytes: u64,
        seed: u64,
        geometry: serde_json::Value,
        slice_bytes: u64,
        shape: RowShape,
        config_tp: serde_json::Value,
    ) -> Result<Dumper> {
        check_dir(dir)?;
        let io = |what: &str, e: std::io::Error| Error::Io(format!("--dump {}: {what}: {e}", dir.display()));
        std::fs::create_dir_all(dir.join("slices")).map_err(|e| io("create slices/", e))?;
        std::fs::create_dir_all(dir.join("scripts")).map_err(|e| io("create scripts/", e))?;
        std::fs::write(dir.join("scripts/fingerprint_ref.py"), REF_SCRIPT)
            .map_err(|e| io("write scripts/fingerprint_ref.py", e))?;
        {
            use std::os::unix::fs::PermissionsExt;
            // Executable, as in the repository (`scripts/fingerprint_ref.py …` runs it).
            std::fs::set_permissions(dir.join("scripts/fingerprint_ref.py"), std::fs::Permissions::from_mode(0o755))
                .map_err(|e| io("chmod scripts/fingerprint_ref.py", e))?;
        }
        let tp = serde_json::from_value::<Tp>(config_tp).ok();
        let state = Arc::new(Mutex::new(State {
            dir: dir.to_path_buf(),
            index: DumpIndex {
                schema: SCHEMA.into(),
                seed,
                seed_hex: crate::core::fingerprint::seed_hex(seed),
                geometry,
                slice_bytes,
                fingerprint: FINGERPRINT.into(),
                max_bytes,
                reserve_per_class_bytes: max_bytes / (2 * Class::ALL.len() as u64),
                rule: RULE.into(),
                bytes_written: 0,
                by_class: Class::ALL.iter().map(|c| (c.name().to_string(), ClassCount::default())).collect(),
                dump_truncated: None,
                slices: Vec::new(),
            },
            class_bytes: BTreeMap::new(),
            shape,
            tp,
            names: HashSet::new(),
            found: Vec::new(),
            entry_at: Vec::new(),
            finished: None,
        }));
        *ACTIVE.lock().unwrap_or_else(|p| p.into_inner()) = Some(state.clone());
        Ok(Dumper { state })
    }

    /// Whether a failing slice of `class` and `len` bytes would be written now ([`RULE`]).
    pub fn wants(&self, class: Class, len: u64) -> bool {
        lock(&self.state).wants(class, len)
    }

    /// Counts a failing slice of `class` that is not offered (the caller saw [`Dumper::wants`]
    /// say no).
    pub fn omit(&mut self, class: Class) {
        lock(&self.state).omit(class)
    }

    /// Writes `actual` (the slice as it arrived) with its record `f` when the cap allows
    /// ([`Dumper::wants`]), else counts it as omitted. `report_index`: where `f` is listed in
    /// the report's failures, if it is. A write that fails stops the dump (`dump_truncated`).
    pub fn offer(&mut self, f: &Failure, actual: &[u8], report_index: Option<usize>) {
        lock(&self.state).offer(f, actual, None, report_index)
    }

    /// [`Dumper::offer`] for a run whose decode converts on receive: `actual` is the
    /// converted slice the verify judged, `received` (the same length) the bytes NIXL
    /// delivered, written beside it ([`DumpEntry::received_file`]); the two count against
    /// the cap together.
    pub fn offer_converted(&mut self, f: &Failure, actual: &[u8], received: &[u8], report_index: Option<usize>) {
        lock(&self.state).offer(f, actual, Some(received), report_index)
    }

    /// Writes `index.json` (atomically) and returns what the report records. A failed write
    /// is recorded in `dump_truncated` (the slices stay; the run's outcome is unchanged).
    pub fn finish(&mut self) -> DumpSummary {
        let mut active = ACTIVE.lock().unwrap_or_else(|p| p.into_inner());
        if active.as_ref().is_some_and(|a| Arc::ptr_eq(a, &self.state)) {
            *active = None;
        }
        drop(active);
        lock(&self.state).finish(None)
    }
}

/// The watchdog's end of a dump (`run::expired_report`): the run is ended without
/// returning, so the dump in progress, if any, is finished here against the report that will
/// be written — the one last published, which counts the first `published` failing slices
/// found. Slices found after it are removed from the dump (their files too), so the dump and
/// the report agree, and `dump_truncated` says so. Waits up to 1 s for the run's thread to
/// finish a slice it is writing.
pub fn finish_active(published: u64) -> Option<DumpSummary> {
    let state = ACTIVE.lock().unwrap_or_else(|p| p.into_inner()).take()?;
    let until = std::time::Instant::now() + std::time::Duration::from_secs(1);
    loop {
        match state.try_lock() {
            Ok(mut g) => return Some(g.finish(Some(published as usize))),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner().finish(Some(published as usize))),
            Err(std::sync::TryLockError::WouldBlock) if std::time::Instant::now() < until => {
                std::thread::sleep(std::time::Duration::from_millis(10))
            }
            Err(_) => return None,
        }
    }
}

impl State {
    fn wants(&self, class: Class, len: u64) -> bool {
        let x = &self.index;
        if x.dump_truncated.is_some() || x.bytes_written + len > x.max_bytes {
            return false;
        }
        let reserve = x.reserve_per_class_bytes;
        let mine = self.class_bytes.get(&class).copied().unwrap_or(0);
        if mine + len <= reserve || mine == 0 {
            return true;
        }
        // Bytes beyond each class's reserve, with this slice added.
        let beyond: u64 = Class::ALL
            .iter()
            .map(|c| self.class_bytes.get(c).copied().unwrap_or(0) + if *c == class { len } else { 0 })
            .map(|b| b.saturating_sub(reserve))
            .sum();
        beyond <= x.max_bytes - reserve * Class::ALL.len() as u64
    }

    fn count(&mut self, class: Class, written: bool) {
        let c = self.index.by_class.entry(class.name().to_string()).or_default();
        if written {
            c.written += 1;
        } else {
            c.omitted += 1;
        }
    }

    fn omit(&mut self, class: Class) {
        self.found.push(class);
        self.count(class, false);
    }

    fn offer(&mut self, f: &Failure, actual: &[u8], received: Option<&[u8]>, report_index: Option<usize>) {
        if self.finished.is_some() {
            return; // the watchdog ended the dump
        }
        let len = actual.len() as u64;
        // Both files of a converted slice count against the cap.
        let cost = len + received.map_or(0, |r| r.len() as u64);
        if !self.wants(f.class, cost) {
            return self.omit(f.class);
        }
        let base = match f.tp_rank {
            // Two decode ranks fail at the same slot: the rank is part of the name.
            Some(r) => format!("{}-{}-{}-{}-tp{r}", f.iteration, f.layer, f.kv, f.block),
            None => format!("{}-{}-{}-{}", f.iteration, f.layer, f.kv, f.block),
        };
        let mut name = format!("{base}.bin");
        let mut n = 2;
        while self.names.contains(&name) {
            // The same slot failing twice in one step (a stray found by the poison check, then
            // its verify): keep both.
            name = format!("{base}-{}-{n}.bin", f.class);
            n += 1;
        }
        let rel = format!("slices/{name}");
        let received_rel = received.map(|_| format!("slices/{}.received.bin", name.trim_end_matches(".bin")));
        let full = full_after().is_some_and(|n| self.index.slices.len() as u64 >= n);
        let write = |rel: &str, bytes: &[u8]| {
            if full {
                return Err(std::io::Error::from_raw_os_error(libc::ENOSPC));
            }
            std::fs::File::create_new(self.dir.join(rel)).and_then(|mut file| file.write_all(bytes).and_then(|_| file.flush()))
        };
        let mut written = write(&rel, actual).map_err(|e| (rel.clone(), e));
        if let (Ok(()), Some(r), Some(bytes)) = (&written, &received_rel, received) {
            written = write(r, bytes).map_err(|e| (r.clone(), e));
        }
        if let Err((what, e)) = written {
            let _ = std::fs::remove_file(self.dir.join(&rel));
            if let Some(r) = &received_rel {
                let _ = std::fs::remove_file(self.dir.join(r));
            }
            self.index.dump_truncated = Some(format!("writing {what}: {e}; later slices were not written"));
            return self.omit(f.class);
        }
        self.names.insert(name.clone());
        self.entry_at.push(self.found.len());
        self.found.push(f.class);
        self.index.bytes_written += cost;
        *self.class_bytes.entry(f.class).or_default() += cost;
        self.count(f.class, true);
        let shape = rank_shape(&self.shape, self.tp.as_ref(), f.tp_rank);
        self.index.slices.push(DumpEntry {
            file: rel,
            bytes: len,
            received_file: received_rel,
            report_index,
            regenerate: regenerate_command(f, self.index.seed, &shape, len, &name),
            // `actual` is what `file` holds (the converted bytes in a converting run).
            observed_regenerate: observed_regenerate_command(f, self.index.seed, &shape, actual, &name),
            failure: f.clone(),
        });
    }

    /// Keeps only the first `n` failing slices found (the watchdog's report counts those).
    fn keep_found(&mut self, n: usize) {
        if n >= self.found.len() {
            return;
        }
        let mut dropped = 0;
        let mut kept = Vec::new();
        for (e, at) in std::mem::take(&mut self.index.slices).into_iter().zip(std::mem::take(&mut self.entry_at)) {
            if at < n {
                kept.push(e);
                self.entry_at.push(at);
            } else {
                let _ = std::fs::remove_file(self.dir.join(&e.file));
                if let Some(r) = &e.received_file {
                    let _ = std::fs::remove_file(self.dir.join(r));
                }
                dropped += 1;
            }
        }
        self.index.slices = kept;
        self.found.truncate(n);
        self.index.bytes_written = self.index.slices.iter().map(|e| e.bytes * (1 + e.received_file.is_some() as u64)).sum();
        for c in self.index.by_class.values_mut() {
            *c = ClassCount::default();
        }
        for c in &self.found {
            self.index.by_class.entry(c.name().to_string()).or_default().omitted += 1;
        }
        for e in &self.index.slices {
            let c = self.index.by_class.entry(e.failure.class.name().to_string()).or_default();
            c.omitted -= 1;
            c.written += 1;
        }
        let why = format!(
            "the run was ended by the watchdog (a call past its deadline): the report is the one last published, \
             so the {dropped} slice(s) dumped after it were removed"
        );
        self.index.dump_truncated = Some(match self.index.dump_truncated.take() {
            Some(t) => format!("{t}; {why}"),
            None => why,
        });
    }

    /// Writes `index.json` once (`published`: the watchdog's count, [`finish_active`]).
    fn finish(&mut self, published: Option<usize>) -> DumpSummary {
        if let Some(s) = &self.finished {
            return s.clone();
        }
        if let Some(n) = published {
            self.keep_found(n);
        }
        let index = self.dir.join("index.json");
        let mut truncated = self.index.dump_truncated.clone();
        let body = serde_json::to_vec_pretty(&self.index).map_err(|e| Error::Io(format!("dump: serialise: {e}")));
        if let Err(e) = body.and_then(|mut b| {
            b.push(b'\n');
            crate::report::write_bytes_atomic(&index, &b, "--dump")
        }) {
            let why = format!("index.json not written: {e}");
            truncated = Some(match truncated {
                Some(t) => format!("{t}; {why}"),
                None => why,
            });
        }
        let omitted = self.index.by_class.values().map(|c| c.omitted).sum();
        let summary = DumpSummary {
            dir: self.dir.display().to_string(),
            slices_written: self.index.slices.len() as u64,
            slices_omitted: omitted,
            bytes_written: self.index.bytes_written,
            max_bytes: self.index.max_bytes,
            dump_truncated: truncated,
        };
        self.finished = Some(summary.clone());
        summary
    }
}

/// The command that writes the expected bytes of `f` (slices of `len` bytes cut into rows by
/// `shape`) to `expected/<name>` from the dump directory, with kvprobe's Python reference.
pub fn regenerate_command(f: &Failure, seed: u64, shape: &RowShape, len: u64, name: &str) -> String {
    let out = format!("expected/{name}");
    if f.stray_check == Some(crate::report::StrayCheck::Poison) {
        poison_command(f.slot, f.poison_iteration, len, &out)
    } else {
        fingerprint_command(seed, &f.expected, shape, &out)
    }
}

/// The command that writes exactly `actual` (a dumped slice's bytes, of `f`'s slot, cut into
/// rows by `shape`: the decode pool's rows, [`rank_shape`]) to `observed/<name>` from the dump
/// directory, with kvprobe's Python reference, and prints its SHA-256 ([`DumpEntry::observed_regenerate`]):
///
/// - the fingerprint of `f.observed` in `shape` when `actual` equals it at every offset
///   ([`fingerprint::check`](crate::core::fingerprint::check) finds 0 bad bytes);
/// - else the poison of (`f.slot`, `f.poison_iteration`) when `actual` equals it at every
///   offset ([`fingerprint::check_poison`](crate::core::fingerprint::check_poison));
/// - else `None`, also when the script could not name the bytes (an identity or shape the
///   fingerprint refuses, K/V against the row order, a slot of 2^32 - 1, a length that is not
///   a multiple of 16 from 16 to 2^31). Compares in place: allocates nothing but the command.
pub fn observed_regenerate_command(f: &Failure, seed: u64, shape: &RowShape, actual: &[u8], name: &str) -> Option<String> {
    use crate::core::fingerprint;
    let out = format!("observed/{name}");
    let len = actual.len() as u64;
    if let Some(o) = &f.observed
        && o.layer <= 0xFFFF
        && (o.kv == crate::core::geometry::KvPart::Latent) == (shape.order == RowOrder::Mla)
        && shape.validate(o.token_base).is_ok()
        && shape.slice_bytes() == len
        && fingerprint::check(actual, seed, &shape.slice(*o)).0 == 0
    {
        return Some(fingerprint_command(seed, o, shape, &out));
    }
    let poison_len = (16..=crate::core::geometry::MAX_SLICE_BYTES).contains(&len) && len.is_multiple_of(16);
    if poison_len && f.slot != u32::MAX && fingerprint::check_poison(actual, f.slot, f.poison_iteration).0 == 0 {
        return Some(poison_command(f.slot, f.poison_iteration, len, &out));
    }
    None
}

/// `fingerprint_ref.py poison SLOT ITERATION SLICE_BYTES OUT`, after creating OUT's folder.
fn poison_command(slot: u32, iteration: u32, len: u64, out: &str) -> String {
    let dir = out.split('/').next().unwrap_or(".");
    format!("mkdir -p {dir} && python3 scripts/fingerprint_ref.py poison {slot} {iteration} {len} {out}")
}

/// `fingerprint_ref.py SEED LAYER KV BLOCK GENERATION ORDER BLOCK_SIZE HEADS ROW_BYTES
/// TOKEN_BASE HEAD_BASE OUT` for identity `id` in `shape`, after creating OUT's folder.
fn fingerprint_command(seed: u64, id: &crate::core::fingerprint::BlockIdentity, shape: &RowShape, out: &str) -> String {
    let dir = out.split('/').next().unwrap_or(".");
    let order = match shape.order {
        RowOrder::Nhd => "nhd",
        RowOrder::Hnd => "hnd",
        RowOrder::Mla => "mla",
        RowOrder::Rows => "rows",
    };
    format!(
        "mkdir -p {dir} && python3 scripts/fingerprint_ref.py {} {} {} {} {} {order} {} {} {} {} {} {out}",
        crate::core::fingerprint::seed_hex(seed),
        id.layer,
        id.kv,
        id.block,
        id.generation,
        shape.block_size,
        shape.heads,
        shape.row_bytes,
        id.token_base,
        shape.head_base
    )
}

/// Lists and dumps one failing slice: builds its record with `make` only when it is listed
/// (`list` is the report's failure list when it has room, else `None`) or dumped, then
/// appends it to `list` and offers it with `actual` to `dump`.
pub fn keep(
    dump: Option<&mut Dumper>,
    list: Option<&mut Vec<Failure>>,
    actual: &[u8],
    class: Class,
    make: impl FnOnce() -> Failure,
) {
    keep_converted(dump, list, actual, None, class, make)
}

/// [`keep`] for a run whose decode converts on receive: `received` (when given) is the slice
/// as NIXL delivered it, dumped beside `actual` ([`Dumper::offer_converted`]).
pub fn keep_converted(
    dump: Option<&mut Dumper>,
    list: Option<&mut Vec<Failure>>,
    actual: &[u8],
    received: Option<&[u8]>,
    class: Class,
    make: impl FnOnce() -> Failure,
) {
    let cost = actual.len() as u64 + received.map_or(0, |r| r.len() as u64);
    let dumping = dump.as_ref().is_some_and(|d| d.wants(class, cost));
    match (list, dump) {
        (None, Some(d)) if !dumping => d.omit(class),
        (None, None) => {}
        (list, dump) => {
            let rec = make();
            let at = list.as_ref().map(|l| l.len());
            match (dump, received) {
                (Some(d), Some(r)) => d.offer_converted(&rec, actual, r, at),
                (Some(d), None) => d.offer(&rec, actual, at),
                (None, _) => {}
            }
            if let Some(l) = list {
                l.push(rec);
            }
        }
    }
}

/// The rows of a failing slice of decode TP rank `rank` (`Failure::tp_rank`): `shape` (the
/// decode geometry's rows, [`RowShape::of`]) starting at the rank's first KV head
/// ([`Tp::heads_of`]: vLLM's split of the model's heads over decode's ranks); `shape` itself
/// without TP or rank.
pub fn rank_shape(shape: &RowShape, tp: Option<&Tp>, rank: Option<u32>) -> RowShape {
    match (tp, rank) {
        (Some(t), Some(r)) if !t.mla => RowShape { head_base: t.heads_of(t.decode, r).start, ..*shape },
        _ => *shape,
    }
}

/// The geometry of a run's decode slices in its report `config`: `decode_geometry` when
/// the two sides differ ([`crate::core::pairing`]), else `geometry`. Dumped slices are decode's.
pub fn dumped_geometry(config: &serde_json::Value) -> &serde_json::Value {
    match config.get("decode_geometry") {
        Some(g) if !g.is_null() => g,
        _ => &config["geometry"],
    }
}
