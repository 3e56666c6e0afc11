//! Tensor parallelism on the two sides: which KV heads each TP rank holds and which
//! prefill ranks a decode rank reads them from, by vLLM's rules.
//!
//! Sources: vLLM `ModelConfig.get_num_kv_heads` (each rank holds `max(1, H / tp)` KV heads; a
//! TP size above the KV heads replicates each head on `tp / H` ranks), and NixlConnector's
//! `TpKVTopology` (`vllm/distributed/kv_transfer/kv_connector/utils.py`): `tp_ratio` (from
//! decode's view: `D / P` when decode has at least as many ranks, else `-(P / D)`),
//! `is_kv_replicated` (`remote_tp > total_kv_heads`), `replicates_kv_cache` (MLA or
//! replicated), `get_target_remote_ranks` (`[d / r]` for a positive ratio; `[d·|r| + i]`
//! for a negative one), and `_validate_remote_agent_handshake`, which refuses a prefill with
//! more ranks than decode when prefill's KV cache is replicated — unless the model is MLA or
//! has Mamba-style state layers (vLLM PR #37635: then a decode rank reads each head from the
//! first target rank holding it, `compute_tp_mapping`'s one rank per unique head).
//!
//! Where a decode rank holds fewer heads than its prefill rank (decode TP > prefill TP),
//! `NixlConnectorWorker.add_remote_agent` reads the chunk of the prefill block at
//! `rank_offset = d mod r × local block length`; with GQA replication on decode (decode TP
//! above the KV heads) that offset must count *heads*, not ranks: decode rank `d` holds head
//! `d / (D / H)`, which sits at head `d / (D / H) − p · H / P` of prefill rank `p` — what
//! [`Tp::sources`] gives (the missing head replication of field reports reads
//! `d mod r` heads in, past the prefill block for `D / H > 1`).

use std::ops::Range;

/// The most TP ranks a side may have (`--prefill-tp`, `--decode-tp`): each rank is a pool and
/// a NIXL agent of one kvprobe process, and an agent takes about a second to start.
pub const MAX_RANKS: u32 = 64;

/// The TP sizes of a pair and the model's KV heads (reports: `config.tp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tp {
    /// Prefill's TP size (`--prefill-tp`).
    pub prefill: u32,
    /// Decode's TP size (`--decode-tp`).
    pub decode: u32,
    /// The model's KV heads (`num_key_value_heads`; 1 for MLA).
    pub total_kv_heads: u32,
    /// MLA: every rank holds the whole latent (never split).
    pub mla: bool,
    /// The model has state layers (Mamba, gated DeltaNet, KDA: vLLM's `_has_mamba`), for which
    /// vLLM accepts prefill TP > decode TP with replicated KV heads (PR #37635): a decode rank
    /// reads each of its heads from the first of its target ranks that holds it. Absent from
    /// reports of attention-only models.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub state: bool,
}

/// Where some of a decode rank's heads come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// The prefill rank read.
    pub prefill_rank: u32,
    /// The global KV heads read from it.
    pub heads: Range<u32>,
    /// The first of them as a head position in the prefill rank's slice.
    pub src_head: u32,
    /// The first of them as a head position in the decode rank's slice.
    pub dst_head: u32,
}

impl Tp {
    /// One rank on each side holding all `heads` (MLA: the latent).
    pub fn single(heads: u32, mla: bool) -> Tp {
        Tp { prefill: 1, decode: 1, total_kv_heads: if mla { 1 } else { heads }, mla, state: false }
    }

    /// True when both sides have one rank.
    pub fn is_single(&self) -> bool {
        self.prefill == 1 && self.decode == 1
    }

    /// The (prefill rank, decode rank) pairs a sweep moves blocks between, decode rank by
    /// decode rank: each decode rank with the prefill ranks it reads ([`Tp::sources`]).
    pub fn links(&self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for d in 0..self.decode {
            for s in self.sources(d) {
                if !out.contains(&(s.prefill_rank, d)) {
                    out.push((s.prefill_rank, d));
                }
            }
        }
        out
    }

    /// Checks the sizes as vLLM does. Errors: a TP size of 0 or above [`MAX_RANKS`]; KV heads that do not split
    /// evenly (`H mod tp ≠ 0` for `tp ≤ H`, `tp mod H ≠ 0` above); one TP size not a multiple
    /// of the other (`TpKVTopology.tp_ratio` asserts it); prefill with more ranks than decode
    /// while prefill's KV cache is replicated, not MLA and the model has no state layers
    /// (`_validate_remote_agent_handshake`: `not use_mla and not _has_mamba`).
    pub fn check(&self) -> Result<(), String> {
        let h = self.total_kv_heads;
        for (side, tp) in [("prefill", self.prefill), ("decode", self.decode)] {
            if tp == 0 {
                return Err(format!("--{side}-tp must be at least 1"));
            }
            if tp > MAX_RANKS {
                return Err(format!(
                    "--{side}-tp {tp}: at most {MAX_RANKS} ranks per side (each is a pool and a NIXL agent in one process)"
                ));
            }
            if !self.mla && ((tp <= h && !h.is_multiple_of(tp)) || (tp > h && !tp.is_multiple_of(h))) {
                return Err(format!(
                    "--{side}-tp {tp}: the {h} KV heads do not split evenly over {tp} ranks (vLLM's get_num_kv_heads needs one to divide the other)"
                ));
            }
        }
        let (big, small) = (self.prefill.max(self.decode), self.prefill.min(self.decode));
        if !big.is_multiple_of(small) {
            return Err(format!(
                "prefill TP {} and decode TP {} do not divide one another (vLLM's TpKVTopology.tp_ratio asserts it)",
                self.prefill, self.decode
            ));
        }
        if self.prefill > self.decode && !self.mla && !self.state && self.prefill > h {
            return Err(format!(
                "prefill TP {} > decode TP {} with prefill's {h} KV heads replicated over its ranks: vLLM's \
                 _validate_remote_agent_handshake refuses it for a model without state layers (a decode rank would read \
                 one head from several copies; with Mamba-style state vLLM reads each head from one rank)",
                self.prefill, self.decode
            ));
        }
        Ok(())
    }

    /// `TpKVTopology.tp_ratio` from decode's view: `D / P` when `D ≥ P`, else `−(P / D)`.
    pub fn ratio(&self) -> i64 {
        if self.decode >= self.prefill { (self.decode / self.prefill) as i64 } else { -((self.prefill / self.decode) as i64) }
    }

    /// KV heads per rank of a side of `tp` ranks (`get_num_kv_heads`: `max(1, H / tp)`; MLA 1).
    pub fn heads_per_rank(&self, tp: u32) -> u32 {
        if self.mla { 1 } else { (self.total_kv_heads / tp).max(1) }
    }

    /// The global KV heads rank `rank` of a side of `tp` ranks holds: `rank · H / tp ..` for
    /// `tp ≤ H`; head `rank / (tp / H)` (a replica) above; MLA head 0 (the latent).
    pub fn heads_of(&self, tp: u32, rank: u32) -> Range<u32> {
        if self.mla {
            return 0..1;
        }
        let h = self.total_kv_heads;
        if tp <= h {
            let n = h / tp;
            rank * n..(rank + 1) * n
        } else {
            let head = rank / (tp / h);
            head..head + 1
        }
    }

    /// `get_target_remote_ranks` for decode rank `d`: the prefill ranks it hands off with
    /// (and notifies).
    pub fn targets(&self, d: u32) -> Vec<u32> {
        match self.ratio() {
            r if r > 0 => vec![d / r as u32],
            r => {
                let n = (-r) as u32;
                (d * n..(d + 1) * n).collect()
            }
        }
    }

    /// Where decode rank `d` reads its heads from: for each head of `d`, the first target
    /// rank that holds it (MLA and replicated heads: one read of the whole block from the
    /// first target; vLLM reads replicated caches from one rank and notifies the others),
    /// merged into runs of consecutive heads from one rank.
    pub fn sources(&self, d: u32) -> Vec<Source> {
        let mine = self.heads_of(self.decode, d);
        let targets = self.targets(d);
        let mut out: Vec<Source> = Vec::new();
        for head in mine.clone() {
            let p = *targets
                .iter()
                .find(|&&p| self.heads_of(self.prefill, p).contains(&head))
                .expect("Tp::check: a target rank holds every head of its decode rank");
            let src_head = head - self.heads_of(self.prefill, p).start;
            match out.last_mut() {
                Some(s) if s.prefill_rank == p && s.heads.end == head => s.heads.end += 1,
                _ => out.push(Source { prefill_rank: p, heads: head..head + 1, src_head, dst_head: head - mine.start }),
            }
        }
        out
    }
}
