//! The lane layout ([`Layout::Lanes16`]): rows in blocks of 16, one row per 32-bit lane.

use super::*;

/// Whether a `[rows, _]` matrix of `kind` in groups of `group` has a [`Layout::Lanes16`] form:
/// int8 or int4, groups a multiple of 64, rows a multiple of 16.
pub fn lanes_fit(kind: QuantKind, rows: usize, group: usize) -> bool {
    matches!(kind, QuantKind::Int8 | QuantKind::Int4)
        && group >= 64
        && group.is_multiple_of(64)
        && rows > 0
        && rows.is_multiple_of(16)
}

/// Rearranges row-major packed weights of `kind` (`cols` per row, in groups of `group`) into
/// [`Layout::Lanes16`] in place; `scratch` is reused between calls. Scales go through the same
/// call as bytes: `lanes_in_place(QuantKind::Int8, 4 * groups, 4, bytes, ..)` (one 4-byte scale
/// per "group" of 4 bytes). Within each block of 16 rows this is the transpose of a
/// `[16, dwords per row]` array of dwords.
pub fn lanes_in_place(
    kind: QuantKind,
    cols: usize,
    group: usize,
    data: &mut [u8],
    scratch: &mut Vec<u8>,
) {
    let rb = cols * kind.bits() / 8;
    debug_assert!(group.is_multiple_of(4) && rb.is_multiple_of(4));
    transpose_blocks(data, rb / 4, true, scratch);
}

/// For each block of 16 rows of `rd` dwords in `data`: the `[16, rd]` to `[rd, 16]` transpose of
/// [`lanes_in_place`] (`to_lanes`), or back.
pub(super) fn transpose_blocks(data: &mut [u8], rd: usize, to_lanes: bool, scratch: &mut Vec<u8>) {
    let simd = to_lanes && Isa::detect() == Isa::Avx512Vnni;
    for blk in data.chunks_exact_mut(64 * rd) {
        scratch.clear();
        scratch.extend_from_slice(blk);
        // columns done 16 at a time by the SIMD transpose, the rest here
        let d0 = match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Isa::Avx512Vnni` is only detected with avx512f/bw/vnni and avx2.
            true => unsafe { avx512::transpose_dwords(scratch, blk, rd) },
            _ => 0,
        };
        for d in d0..rd {
            for r in 0..16 {
                let (rows, lanes) = (4 * (r * rd + d), 4 * (d * 16 + r));
                let (from, to) = if to_lanes {
                    (rows, lanes)
                } else {
                    (lanes, rows)
                };
                blk[to..to + 4].copy_from_slice(&scratch[from..from + 4]);
            }
        }
    }
}

/// Where dword `d` of group `g` of row `r` sits in [`Layout::Lanes16`] (`dpg` dwords per group,
/// `ng` groups per row); with `dpg = 1`, where scale `(r, g)` sits.
#[inline]
pub(super) fn lanes_index(r: usize, g: usize, d: usize, ng: usize, dpg: usize) -> usize {
    (((r / 16) * ng + g) * dpg + d) * 16 + r % 16
}

/// Whether weights multiplied with activations `act` should take
/// [`Layout::Lanes16`]: int8 activations on the VNNI or the AVX2 integer path, whose kernels
/// read that layout directly.
pub fn lanes_wanted(act: Activations) -> bool {
    matches!(active_isa(), Isa::Avx512Vnni | Isa::Avx2) && act == Activations::Int8
}
