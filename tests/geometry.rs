//! Geometry and descriptor math: NHD, HND, MLA, odd sizes, one block, overflow.

use kvprobe::geometry::{Dtype, Geometry, GeometryError, KvPart, Layout, Preset, SliceCoord};

#[allow(clippy::too_many_arguments)]
fn g(layers: u32, heads: u32, head: u32, bs: u32, blocks: u32, dtype: Dtype, layout: Layout, mla: bool) -> Geometry {
    Geometry { num_layers: layers, num_kv_heads: heads, head_size: head, block_size: bs, num_blocks: blocks, dtype, layout, mla }
}

#[test]
fn presets_have_the_documented_sizes() {
    let l = Preset::Llama3_8b.geometry();
    l.validate().unwrap();
    assert_eq!(l.slice_bytes().unwrap(), 16 * 8 * 128 * 2);
    assert_eq!(l.pool_bytes().unwrap(), 1 << 30);
    let d = Preset::DeepseekV3.geometry();
    d.validate().unwrap();
    assert_eq!(d.slice_bytes().unwrap(), 64 * 576 * 2);
    assert_eq!(d.slices_per_layer(), 256);
    assert_eq!(d.pool_bytes().unwrap(), 61 * 256 * 73728);
    let s = Preset::Small.geometry();
    assert_eq!(s.pool_bytes().unwrap(), 2 << 20);
}

#[test]
fn nhd_puts_all_k_blocks_before_all_v_blocks() {
    let x = g(2, 2, 64, 16, 10, Dtype::Fp16, Layout::Nhd, false);
    let sb = 16 * 2 * 64 * 2;
    assert_eq!(x.slice_offset(KvPart::K, 0), 0);
    assert_eq!(x.slice_offset(KvPart::K, 9), 9 * sb);
    assert_eq!(x.slice_offset(KvPart::V, 0), 10 * sb);
    assert_eq!(x.slice_offset(KvPart::V, 3), 13 * sb);
    assert_eq!(x.region_bytes().unwrap(), 20 * sb);
    let bases = [0x1000_0000u64, 0x2000_0000];
    let c = SliceCoord { layer: 1, kv: KvPart::V, block: 3 };
    assert_eq!(x.descriptor(&bases, c), (0x2000_0000 + 13 * sb, sb));
}

#[test]
fn hnd_interleaves_k_and_v_per_block() {
    let x = g(1, 4, 128, 16, 6, Dtype::Bf16, Layout::Hnd, false);
    let sb = 16 * 4 * 128 * 2;
    assert_eq!(x.slice_offset(KvPart::K, 0), 0);
    assert_eq!(x.slice_offset(KvPart::V, 0), sb);
    assert_eq!(x.slice_offset(KvPart::K, 5), 10 * sb);
    assert_eq!(x.slice_offset(KvPart::V, 5), 11 * sb);
}

#[test]
fn mla_has_one_latent_slice_per_block() {
    let x = g(3, 1, 576, 64, 4, Dtype::Bf16, Layout::Nhd, true);
    x.validate().unwrap();
    assert_eq!(x.slices_per_layer(), 4);
    assert_eq!(x.parts(), &[KvPart::Latent]);
    assert_eq!(x.slice_offset(KvPart::Latent, 3), 3 * 73728);
    assert_eq!(x.coords().count(), 12);
    let bad = g(3, 2, 576, 64, 4, Dtype::Bf16, Layout::Nhd, true);
    assert!(matches!(bad.validate(), Err(GeometryError::Invalid(_))));
}

#[test]
fn odd_sizes_and_one_block_round_trip() {
    for x in [
        g(3, 5, 72, 3, 7, Dtype::Fp16, Layout::Nhd, false),
        g(3, 5, 72, 3, 7, Dtype::Fp16, Layout::Hnd, false),
        g(1, 1, 32, 1, 1, Dtype::Fp8, Layout::Nhd, false),
        g(5, 1, 16, 1, 1, Dtype::Bf16, Layout::Hnd, true),
    ] {
        x.validate().unwrap();
        let coords: Vec<SliceCoord> = x.coords().collect();
        assert_eq!(coords.len() as u64, x.total_slices().unwrap());
        let mut offsets = std::collections::HashSet::new();
        for (i, c) in coords.iter().enumerate() {
            let gi = x.global_slice(*c);
            assert_eq!(x.coord_of(gi), *c, "{x:?} slice {i}");
            assert!(offsets.insert((c.layer, x.slice_offset(c.kv, c.block))), "overlapping slices in {x:?}");
            assert!(x.slice_offset(c.kv, c.block) + x.slice_bytes().unwrap() <= x.region_bytes().unwrap());
        }
    }
}

#[test]
fn invalid_geometries_are_refused() {
    let ok = Preset::Small.geometry();
    assert!(matches!(Geometry { num_blocks: 0, ..ok.clone() }.validate(), Err(GeometryError::Invalid(_))));
    assert!(matches!(Geometry { num_layers: 70_000, ..ok.clone() }.validate(), Err(GeometryError::Invalid(_))));
    // 3 fp8 elements: 3 bytes, not a multiple of 16.
    let odd = Geometry { num_kv_heads: 1, head_size: 3, block_size: 1, dtype: Dtype::Fp8, ..ok.clone() };
    assert!(matches!(odd.validate(), Err(GeometryError::Invalid(_))));
    // Sizes that overflow u64 are reported, not wrapped.
    let huge = Geometry { num_kv_heads: u32::MAX, head_size: u32::MAX, block_size: u32::MAX, dtype: Dtype::Fp32, ..ok.clone() };
    assert!(matches!(huge.slice_bytes(), Err(GeometryError::Overflow(_))));
    assert!(huge.validate().is_err());
    // Too many slices for 32-bit slice indices.
    let many = Geometry { num_layers: 65535, num_blocks: u32::MAX, num_kv_heads: 1, head_size: 8, block_size: 1, ..ok };
    assert!(many.validate().is_err());
}
