//! Two sides that differ: how prefill's blocks line up with decode's when the two engines
//! disagree on the KV-cache layout (NHD/HND), the block size (tokens per block) or the tensor
//! parallelism ([`tp`]: which ranks hold which KV heads), and the descriptors and
//! decode-side conversion that follow vLLM's NixlConnector.
//!
//! **Groups.** With prefill blocks of `Bp` tokens and decode blocks of `Bd` tokens (one a
//! multiple of the other), a *group* is `G = max(Bp, Bd)` tokens: `G / Bp` consecutive
//! prefill blocks and `G / Bd` consecutive decode blocks hold the same tokens. The sweep's
//! block map permutes groups; both pools hold the same tokens (decode's `num_blocks` is
//! prefill's × `Bp / Bd`). A group's logical block names its rows, and a block holding the
//! group's tokens from `k` on carries `token_base = k` ([`crate::core::fingerprint::BlockIdentity`]).
//! With equal block sizes a group is one block and everything is as between equal sides.
//!
//! **Descriptors** ([`Sides::chunks`]): bytes move verbatim, as NIXL moves them.
//! - Decode's block a multiple of prefill's (`Bd = r × Bp`, vLLM's `block_size_ratio = r`;
//!   `NixlConnectorWorker.add_remote_agent` sets `remote_kv_block_len = local_len // r`):
//!   prefill block `k` of the group lands whole at byte `k × prefill_slice_bytes` of the
//!   decode slice, one descriptor per prefill slice.
//! - Prefill's block a multiple of decode's (`Bp = k × Bd`): vLLM refuses this direction
//!   (`block_size_ratio` must be ≥ 1). kvprobe's own rule cuts each prefill block into
//!   `k` decode blocks: prefill NHD, decode block `j` takes the contiguous tokens
//!   `j × Bd ..` (one descriptor); prefill HND, one descriptor per head (each head's run of
//!   `Bd` tokens), landing head after head.
//!
//! Either way a decode slice first holds its rows in prefill's order, in chunks of
//! `b = min(Bp, Bd)` tokens ([`Sides::received_row`]).
//!
//! **Conversion on receive** ([`Sides::convert`]): decode rearranges each received slice
//! into its own order when the orders agree (vLLM's `kv_postprocess_blksize_on_receive`,
//! HND chunks of `Bp` tokens into one block of `Bd`; NHD needs nothing) or when
//! `--permute-local-kv` is given (vLLM's `enable_permute_local_kv`,
//! `kv_postprocess_layout_on_receive` and `_blksize_and_layout_on_receive`). Without it,
//! two layouts are copied verbatim and every slice with more than one head and token holds
//! the right rows at the wrong positions (class `layout`): what a connector without vLLM's
//! handshake check (`_validate_remote_agent_handshake` compares `kv_cache_layout`) does.
//! vLLM converts remote HND into local NHD only; kvprobe converts either way (the
//! permutation is the same) and [`Sides::vllm_refuses`] says what vLLM would refuse.

use crate::core::fingerprint::RowOrder;
use crate::core::geometry::{Geometry, Layout};

pub mod tp;

/// A run's two sides: prefill's and decode's geometry (one TP rank's each), their tensor
/// parallelism and decode's conversion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sides {
    /// A prefill rank's pool (the run's `config.geometry`).
    pub prefill: Geometry,
    /// A decode rank's pool (`config.decode_geometry`, or prefill's when absent).
    pub decode: Geometry,
    /// `--permute-local-kv`: decode converts a received slice from prefill's layout to its own.
    pub permute_local_kv: bool,
    /// The TP sizes ([`tp::Tp`]; one rank each without `--prefill-tp`/`--decode-tp`).
    pub tp: tp::Tp,
}

/// One descriptor of a prefill slice's transfer: `len` bytes from `src_off` of the prefill
/// slice to `dst_off` of decode block `dst_block` of the group (0-based within the group's
/// decode blocks), same layer and K/V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Byte offset in the prefill slice.
    pub src_off: u64,
    /// Decode block within the group (`0 .. G / Bd`).
    pub dst_block: u32,
    /// Byte offset in that decode slice.
    pub dst_off: u64,
    /// Bytes.
    pub len: u64,
    /// The rows moved are not the ones due there (a planted offset, [`Plant`]).
    pub displaced: bool,
}

/// A planted misplacement of a prefill slice's rows (`--inject head-offset` /
/// `--inject token-offset`): every row but the last head (token) takes the row of the next
/// head (token) of the same slice, as a wrong TP rank head offset or a wrong token offset
/// in a block-size conversion would; the verifier must find class `layout` with that
/// displacement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plant {
    /// The rows due.
    None,
    /// Row (t, h) ← row (t, h + 1) for h < heads − 1.
    HeadOffset,
    /// Row (t, h) ← row (t + 1, h) for t < block_size − 1.
    TokenOffset,
}

/// Pieces of a block slice: (byte offset, bytes) ranges, sorted and disjoint; empty = the
/// whole slice ([`Sides::cuts`]).
pub type Pieces = Vec<(u64, u64)>;

/// Position of row (token `t`, head `h`) in a slice of `order` with `block` tokens and
/// `heads` heads (NHD: token-major; HND: head-major; MLA: one row per token).
pub fn row_position(order: RowOrder, block: u32, heads: u32, t: u32, h: u32) -> u64 {
    match order {
        RowOrder::Nhd => t as u64 * heads as u64 + h as u64,
        RowOrder::Hnd => h as u64 * block as u64 + t as u64,
        RowOrder::Mla | RowOrder::Rows => t as u64,
    }
}

impl Sides {
    /// The sides of a run whose decode side takes `decode_layout` and `decode_block_size`
    /// (each: prefill's when `None`); decode's `num_blocks` holds prefill's tokens
    /// (`num_blocks × Bp / Bd`). Errors (usage): the block sizes do not divide one another,
    /// prefill's blocks do not fill whole decode blocks, or decode's geometry is invalid.
    pub fn derive(
        prefill: &Geometry,
        decode_layout: Option<Layout>,
        decode_block_size: Option<u32>,
        permute: bool,
    ) -> Result<Sides, String> {
        prefill.validate().map_err(|e| e.to_string())?;
        let bp = prefill.block_size;
        let bd = decode_block_size.unwrap_or(bp);
        if bd == 0 {
            return Err("--decode-block-size must be at least 1".into());
        }
        let (big, small) = (bp.max(bd), bp.min(bd));
        if !big.is_multiple_of(small) {
            return Err(format!(
                "prefill's block size {bp} and decode's {bd} do not divide one another (vLLM's NixlConnector needs \
                 block_size_ratio = decode // prefill to be a whole number; kvprobe also cuts a prefill block into whole decode blocks)"
            ));
        }
        let tokens = prefill.num_blocks as u64 * bp as u64;
        if !tokens.is_multiple_of(bd as u64) {
            return Err(format!(
                "prefill's {} blocks of {bp} tokens do not fill whole decode blocks of {bd} tokens: --blocks must be a multiple of {}",
                prefill.num_blocks,
                bd / bp
            ));
        }
        let num_blocks = u32::try_from(tokens / bd as u64)
            .map_err(|_| format!("decode would need {} blocks of {bd} tokens (at most {})", tokens / bd as u64, u32::MAX))?;
        // MLA has one latent row per token: a layout means nothing there.
        let layout = if prefill.mla { prefill.layout } else { decode_layout.unwrap_or(prefill.layout) };
        let decode = Geometry { block_size: bd, num_blocks, layout, ..prefill.clone() };
        decode.validate().map_err(|e| format!("decode's geometry: {e}").replace("--block-size", "--decode-block-size"))?;
        let tp = tp::Tp::single(prefill.num_kv_heads, prefill.mla);
        Ok(Sides { prefill: prefill.clone(), decode, permute_local_kv: permute, tp })
    }

    /// These sides with tensor parallelism `tp`, whose model has `tp.total_kv_heads` KV heads:
    /// each side's geometry becomes one rank's (`num_kv_heads` = [`tp::Tp::heads_per_rank`]).
    /// Errors: [`tp::Tp::check`]'s; a head split between ranks (a decode rank reading part
    /// of a prefill rank's heads, or from several prefill ranks) where prefill's layout is
    /// not HND (vLLM's `get_required_kvcache_layout`: HND for heterogeneous TP) or decode's is
    /// neither HND nor converted (`--permute-local-kv`); prefill with more ranks than decode
    /// and unequal block sizes (vLLM reads several remote blocks into one local block only
    /// with `block_size_ratio` 1; MLA excepted: a decode rank reads one prefill rank).
    pub fn with_tp(mut self, tp: tp::Tp) -> Result<Sides, String> {
        tp.check()?;
        self.prefill.num_kv_heads = tp.heads_per_rank(tp.prefill);
        self.decode.num_kv_heads = tp.heads_per_rank(tp.decode);
        self.prefill.validate().map_err(|e| format!("a prefill rank's geometry: {e}"))?;
        self.decode.validate().map_err(|e| format!("a decode rank's geometry: {e}"))?;
        self.tp = tp;
        if tp.is_single() {
            return Ok(self);
        }
        let split = !tp.mla && self.prefill.num_kv_heads != self.decode.num_kv_heads;
        if split && self.prefill.layout != Layout::Hnd {
            return Err(format!(
                "prefill TP {} and decode TP {} split the KV heads differently: vLLM needs the HND layout for that \
                 (get_required_kvcache_layout; a rank's heads are then one contiguous run): add --layout hnd",
                tp.prefill, tp.decode
            ));
        }
        if split && self.decode.layout != Layout::Hnd && !self.permute_local_kv {
            return Err(
                "decode's NHD layout with heads split between TP ranks needs --permute-local-kv (vLLM reads into HND and permutes on receive)".into(),
            );
        }
        // MLA: a decode rank reads its whole latent from one prefill rank (vLLM checks only
        // `block_len // block_size_ratio` there).
        if tp.prefill > tp.decode && !tp.mla && self.prefill.block_size != self.decode.block_size {
            return Err(format!(
                "prefill TP {} > decode TP {} needs equal block sizes (vLLM: block_size_ratio 1 when a decode block is read from several prefill ranks)",
                tp.prefill, tp.decode
            ));
        }
        Ok(self)
    }

    /// Checks two geometries announced for a pair (`config.geometry` and
    /// `config.decode_geometry`): they may differ only in layout, block size and the number
    /// of blocks that holds the same tokens. Errors: what else differs.
    pub fn check(prefill: &Geometry, decode: &Geometry, permute: bool, tp: Option<tp::Tp>) -> Result<Sides, String> {
        let mut s = Sides::derive(prefill, Some(decode.layout), Some(decode.block_size), permute)?;
        if let Some(tp) = tp {
            // `prefill` is one rank's already: the sides' heads per rank come from `tp`.
            if prefill.num_kv_heads != tp.heads_per_rank(tp.prefill) {
                return Err(format!(
                    "a prefill rank's geometry has {} KV heads; {} over prefill TP {} gives {}",
                    prefill.num_kv_heads,
                    tp.total_kv_heads,
                    tp.prefill,
                    tp.heads_per_rank(tp.prefill)
                ));
            }
            s = s.with_tp(tp)?;
        }
        if s.decode != *decode {
            return Err(format!(
                "decode's geometry differs from prefill's in more than layout and block size (kvprobe pairs sides of one model: \
                 layers, heads, head size, dtype and MLA agree, and decode's blocks hold prefill's tokens: {} blocks of {} tokens)",
                s.decode.num_blocks, s.decode.block_size
            ));
        }
        Ok(s)
    }

    /// True when both sides have one geometry and one rank (the run is as before `--decode-*`
    /// and the TP flags existed).
    pub fn equal(&self) -> bool {
        self.prefill == self.decode && self.tp.is_single()
    }

    /// Tokens per group: the larger block size.
    pub fn group_tokens(&self) -> u32 {
        self.prefill.block_size.max(self.decode.block_size)
    }

    /// Prefill blocks per group (`G / Bp`).
    pub fn prefill_per_group(&self) -> u32 {
        self.group_tokens() / self.prefill.block_size
    }

    /// Decode blocks per group (`G / Bd`).
    pub fn decode_per_group(&self) -> u32 {
        self.group_tokens() / self.decode.block_size
    }

    /// Groups in each pool.
    pub fn groups(&self) -> u32 {
        self.prefill.num_blocks / self.prefill_per_group()
    }

    /// The geometry injections are planned on: one "block" per group of `G` tokens in
    /// prefill's layout, so that one injection touches one group on both sides (a group's
    /// bytes are its prefill slices back to back). Equal sides: prefill's geometry.
    pub fn planning(&self) -> Geometry {
        Geometry { block_size: self.group_tokens(), num_blocks: self.groups(), ..self.prefill.clone() }
    }

    fn heads(g: &Geometry) -> u32 {
        if g.mla { 1 } else { g.num_kv_heads }
    }

    fn row_bytes(&self) -> u64 {
        self.prefill.head_size as u64 * self.prefill.dtype.bytes()
    }

    /// Where decode row (token `t` of the decode block, head `h`) sits in a received slice,
    /// before any conversion: chunks of `b = min(Bp, Bd)` tokens in prefill's row order.
    pub fn received_row(&self, t: u32, h: u32) -> u64 {
        let b = self.prefill.block_size.min(self.decode.block_size);
        let heads = Sides::heads(&self.decode);
        let c = (t / b) as u64;
        c * b as u64 * heads as u64 + row_position(RowOrder::of(&self.prefill), b, heads, t % b, h)
    }

    /// True when decode rearranges received slices ([`Sides::convert`] is not the identity).
    pub fn converts(&self) -> bool {
        let (lp, ld) = (RowOrder::of(&self.prefill), RowOrder::of(&self.decode));
        (lp == ld || self.permute_local_kv) && !self.received_is_decode_order()
    }

    /// True when the two layouts differ, nothing converts, and rows land at other positions:
    /// a verbatim copy that corrupts every slice with more than one head and one token.
    pub fn mismatched(&self) -> bool {
        let (lp, ld) = (RowOrder::of(&self.prefill), RowOrder::of(&self.decode));
        lp != ld && !self.permute_local_kv && !self.received_is_decode_order()
    }

    fn received_is_decode_order(&self) -> bool {
        let (bd, heads, ld) = (self.decode.block_size, Sides::heads(&self.decode), RowOrder::of(&self.decode));
        (0..bd).all(|t| (0..heads).all(|h| self.received_row(t, h) == row_position(ld, bd, heads, t, h)))
    }

    /// Decode's conversion on receive as a permutation of a slice's head rows: entry `r` is
    /// the row (in the received slice, [`Sides::received_row`]) that becomes row `r` of
    /// decode's order ([`row_position`]); `block_size × heads` entries. The GPU kernel
    /// (`kvp_permute_rows`) and the host apply it to every slice ([`crate::mem::pool::KvPool::permute_rows`]).
    pub fn row_permutation(&self) -> Vec<u32> {
        let (bd, heads, ld) = (self.decode.block_size, Sides::heads(&self.decode), RowOrder::of(&self.decode));
        let mut perm = vec![0u32; (bd * heads) as usize];
        for t in 0..bd {
            for h in 0..heads {
                perm[row_position(ld, bd, heads, t, h) as usize] = self.received_row(t, h) as u32;
            }
        }
        perm
    }

    /// Rearranges a received decode slice (`received`) into decode's row order (`out`, the
    /// same length): row (t, h) from [`Sides::received_row`] to its place in decode's
    /// layout ([`Sides::row_permutation`]). What still holds poison stays poison: the poison
    /// of a slice is the same in every 16-byte chunk ([`crate::core::fingerprint::poison`]) and a
    /// row is a whole number of chunks, so a dropped or torn transfer stays `unwritten` or
    /// `torn`. Call only when [`Sides::converts`].
    pub fn convert(&self, received: &[u8], out: &mut [u8]) {
        let rb = self.row_bytes() as usize;
        for (to, &from) in self.row_permutation().iter().enumerate() {
            let from = from as usize * rb;
            out[to * rb..(to + 1) * rb].copy_from_slice(&received[from..from + rb]);
        }
    }

    /// The inverse of [`Sides::convert`]: the received slice (`out`, the same length) that
    /// converts to `converted` — each row `r` of `converted` back to row
    /// `row_permutation()[r]`. Exact, because the permutation moves whole rows and is a
    /// bijection ([`crate::mem::pool::KvPool::permute_rows`] refuses any other): what a converting
    /// run's dump keeps as the bytes NIXL delivered ([`crate::report::dump::DumpEntry::received_file`]).
    pub fn unconvert(&self, converted: &[u8], out: &mut [u8]) {
        let rb = self.row_bytes() as usize;
        for (to, &from) in self.row_permutation().iter().enumerate() {
            let from = from as usize * rb;
            out[from..from + rb].copy_from_slice(&converted[to * rb..(to + 1) * rb]);
        }
    }

    /// The descriptors moving the prefill slice at position `pos` of its group
    /// (`0 .. G / Bp`), with `plant` applied (module docs), coalesced where both sides are
    /// contiguous. Without a plant they cover the slice once; equal sides give one chunk.
    pub fn chunks(&self, pos: u32, plant: Plant) -> Vec<Chunk> {
        self.chunks_between(0, 0, pos, plant)
    }

    /// [`Sides::chunks`] from prefill rank `p`'s slice into decode rank `d`'s: the rows of
    /// the heads `d` reads from `p` ([`tp::Tp::sources`]), each to its head position in `d`'s
    /// slice. Empty when `d` reads nothing from `p`.
    pub fn chunks_between(&self, p: u32, d: u32, pos: u32, plant: Plant) -> Vec<Chunk> {
        let (bp, bd) = (self.prefill.block_size, self.decode.block_size);
        let heads = Sides::heads(&self.prefill);
        let lp = RowOrder::of(&self.prefill);
        let rb = self.row_bytes();
        let first = self.tp.heads_of(self.tp.prefill, p).start;
        let sources: Vec<tp::Source> = self.tp.sources(d).into_iter().filter(|s| s.prefill_rank == p).collect();
        // Head position in p's slice → head position in d's slice.
        let dst_head = |h: u32| {
            let global = first + h;
            sources.iter().find(|s| s.heads.contains(&global)).map(|s| s.dst_head + global - s.heads.start)
        };
        let mut rows: Vec<(u32, u32)> = (0..bp).flat_map(|t| (0..heads).map(move |h| (t, h))).collect();
        rows.sort_by_key(|&(t, h)| row_position(lp, bp, heads, t, h));
        let mut out: Vec<Chunk> = Vec::new();
        for (t, h) in rows {
            let Some(hd) = dst_head(h) else { continue };
            let token = pos * bp + t; // within the group
            let (dst_block, td) = (token / bd, token % bd);
            let (st, sh) = match plant {
                Plant::HeadOffset if h + 1 < heads => (t, h + 1),
                Plant::TokenOffset if t + 1 < bp => (t + 1, h),
                _ => (t, h),
            };
            let c = Chunk {
                src_off: row_position(lp, bp, heads, st, sh) * rb,
                dst_block,
                dst_off: self.received_row(td, hd) * rb,
                len: rb,
                displaced: (st, sh) != (t, h),
            };
            match out.last_mut() {
                Some(q)
                    if q.dst_block == c.dst_block
                        && q.displaced == c.displaced
                        && q.src_off + q.len == c.src_off
                        && q.dst_off + q.len == c.dst_off =>
                {
                    q.len += rb
                }
                _ => out.push(c),
            }
        }
        out
    }

    /// The pieces of a block slice that the descriptors of link (prefill rank `p`, decode
    /// rank `d`) move, as (byte offset, bytes), sorted: on prefill's slices and on decode's
    /// (empty: the whole slice). They are what [`Sides::chunks_between`] moves without a
    /// plant, over every prefill slice of a group; the transport prepares its descriptor
    /// lists with them ([`crate::xfer::transport::Cuts`]), as vLLM's NixlConnector prepares a
    /// decode rank's part of each remote block (`add_remote_agent`: `rank_offset`,
    /// `block_len`) and a block of `block_size_ratio` remote blocks in pieces. `None` when
    /// `d` reads nothing from `p`, or when pieces of different slices overlap (no prepared
    /// list can name both: requests are then built with createXferReq).
    pub fn cuts(&self, p: u32, d: u32) -> Option<(Pieces, Pieces)> {
        let (mut pc, mut dc) = (Vec::new(), Vec::new());
        for pos in 0..self.prefill_per_group() {
            for c in self.chunks_between(p, d, pos, Plant::None) {
                pc.push((c.src_off, c.len));
                dc.push((c.dst_off, c.len));
            }
        }
        if pc.is_empty() {
            return None;
        }
        let norm = |mut v: Vec<(u64, u64)>, sb: u64| -> Option<Vec<(u64, u64)>> {
            v.sort_unstable();
            v.dedup();
            if v.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0) {
                return None;
            }
            if v == [(0, sb)] {
                v.clear();
            }
            Some(v)
        };
        Some((norm(pc, self.prefill.slice_bytes().ok()?)?, norm(dc, self.decode.slice_bytes().ok()?)?))
    }

    /// Why vLLM's NixlConnector would not run this pair as kvprobe does, if it would not
    /// (`_validate_remote_agent_handshake`, `block_size_ratio`); empty for a pair it runs.
    pub fn vllm_refuses(&self) -> Vec<String> {
        let mut why = Vec::new();
        if self.prefill.block_size > self.decode.block_size {
            why.push(format!(
                "vLLM needs decode's block size to be a multiple of prefill's (block_size_ratio = {} // {} < 1); kvprobe cuts \
                 each prefill block into {} decode blocks by its own rule",
                self.decode.block_size,
                self.prefill.block_size,
                self.prefill.block_size / self.decode.block_size
            ));
        }
        if !self.prefill.mla && self.prefill.layout != self.decode.layout {
            if !self.permute_local_kv {
                why.push(
                    "vLLM's handshake refuses two kv_cache_layouts without enable_permute_local_kv; kvprobe copies the bytes \
                     verbatim, as a connector without that check would"
                        .into(),
                );
            } else if self.prefill.layout == Layout::Nhd {
                why.push(
                    "vLLM's enable_permute_local_kv converts a remote HND cache into a local NHD one only; kvprobe converts \
                     prefill NHD into decode HND too"
                        .into(),
                );
            }
        }
        why
    }
}
