// A routed expert on the GPU: the GPU twins of the CPU's int8-activation path
// (`scalar::quantize_group`, `scalar::nibble_order`, `scalar::row_dot_i8`) and of the SwiGLU between
// the projections (`kernels::silu(g) * u`). Concatenated after softfloat.wgsl, whose `sf_*`
// functions do every float step in integer arithmetic, so each output has the CPU's bits.
//
// Buffers (all words little-endian u32; f32 values are their bit patterns):
// - `w` (read-only): one expert's matrices, each as the container lays it out (row-major): its
//   packed codes, `row_bytes / 4` words per row (int8: one byte a weight; int4: two weights a
//   byte, the even element in the low nibble, stored as `q + 8`), then its scales `[rows, groups]`.
// - `arena` (read-write): every input, intermediate and output of one submission, at word offsets
//   the host computes (`p.in0`, `p.out0`, ...). Quantized activations of `n` rows of `cols` are
//   three regions: codes (`cols / 4` words a row; for int4 weights each nibble block of `nb` codes
//   in nibble order, its even elements then its odd ones), scales `[n, groups]` and code sums
//   `[n, groups]` (i32).
// - `p` (uniform, one per dispatch through a dynamic offset): shapes and offsets.
//
// Arithmetic promised, per kernel:
// - `quantize`: per row and group, `amax` of |x| (NaN skipped, as f32::max does), scale
//   `amax / 127`, codes `round_half_away(x * (1 / scale))` clamped to +-127 (NaN to 0): exactly
//   `scalar::quantize_group`, with the same code sum.
// - `matvec` (and `matvec_tiled`, the same arithmetic from weights read a tile at a time): per
//   output row, token and group the exact i32 dot product of the codes (packed 4 x i8 dot
//   products; int4's `+ 8` removed with the code sum), then
//   `acc = fma(scale_w * scale_x, f32(isum), acc)` from `acc = +0` in group order, each step
//   rounded once as IEEE binary32 (sf_mul, sf_from_i32, sf_fma): exactly `scalar::row_dot_i8`.
// - `swiglu`: `silu(g) * u` with charm's SiLU (`softfloat::silu`, the CPU's definition), then
//   one rounded product.

struct Params {
    rows: u32,
    cols: u32,
    group: u32,
    // 1: int4 weights (nibble order, `+ 8` codes); 0: int8
    int4: u32,
    // rows of input (tokens) taken, or elements for `swiglu`
    n: u32,
    nb: u32,
    w_data: u32,
    w_scales: u32,
    // matvec: codes, scales, sums of the input; quantize: the f32 input; swiglu: g and u
    in0: u32,
    in1: u32,
    in2: u32,
    // matvec: the f32 output `[n, rows]`; quantize: codes, scales, sums; swiglu: h
    out0: u32,
    out1: u32,
    out2: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read_write> arena: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;

// The codes of one group of activations, in the order the weights meet them: element `q` of the
// stored group comes from element `src_index(q)` of the input group.
fn src_index(q: u32) -> u32 {
    if (p.int4 == 0u) {
        return q;
    }
    let c = q / p.nb;
    let i = q % p.nb;
    let half = p.nb / 2u;
    if (i < half) {
        return c * p.nb + 2u * i;
    }
    return c * p.nb + 2u * (i - half) + 1u;
}

// One workgroup lane per (group, row of input): x is `[n, cols]` f32 at `in0`.
@compute @workgroup_size(64)
fn quantize(@builtin(global_invocation_id) gid: vec3<u32>) {
    let g = gid.x;
    let t = gid.y;
    let ng = p.cols / p.group;
    if (g >= ng || t >= p.n) {
        return;
    }
    let base = p.in0 + t * p.cols + g * p.group;
    var amax = 0u;
    for (var i = 0u; i < p.group; i++) {
        let a = arena[base + i] & 0x7fffffffu;
        if (a <= 0x7f800000u && a > amax) {
            amax = a;
        }
    }
    // d = amax / 127; inv = 1 / d where d > 0
    let d = sf_div(amax, 0x42fe0000u);
    var inv = 0u;
    if (d != 0u && d <= 0x7f800000u) {
        inv = sf_div(0x3f800000u, d);
    }
    let words = p.group / 4u;
    let codes = p.out0 + t * (p.cols / 4u) + g * words;
    var sum = 0i;
    for (var k = 0u; k < words; k++) {
        var packed = 0u;
        for (var b = 0u; b < 4u; b++) {
            let v = arena[base + src_index(4u * k + b)];
            let c = clamp(sf_round_away_i32(sf_mul(v, inv)), -127i, 127i);
            sum += c;
            packed |= (bitcast<u32>(c) & 0xffu) << (8u * b);
        }
        arena[codes + k] = packed;
    }
    arena[p.out1 + t * ng + g] = d;
    arena[p.out2 + t * ng + g] = bitcast<u32>(sum);
}

// One lane per (output row r, input row t).
@compute @workgroup_size(64)
fn matvec(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    let t = gid.y;
    if (r >= p.rows || t >= p.n) {
        return;
    }
    let ng = p.cols / p.group;
    let row_words = p.cols / (8u - 4u * (1u - p.int4)); // int8: cols / 4; int4: cols / 8
    let gw = p.group / (8u - 4u * (1u - p.int4));
    let ga = p.group / 4u;
    let wrow = p.w_data + r * row_words;
    let arow = p.in0 + t * (p.cols / 4u);
    var acc = 0u;
    for (var g = 0u; g < ng; g++) {
        var isum = 0i;
        let wg = wrow + g * gw;
        let ag = arow + g * ga;
        if (p.int4 == 0u) {
            for (var k = 0u; k < gw; k++) {
                isum += dot4I8Packed(w[wg + k], arena[ag + k]);
            }
        } else {
            // a nibble block: nb / 8 words of weights meet nb / 8 words of low-half codes
            // (low nibbles) and nb / 8 words of high-half codes (high nibbles)
            let bw = p.nb / 8u;
            for (var c = 0u; c < p.group / p.nb; c++) {
                for (var k = 0u; k < bw; k++) {
                    let wv = w[wg + c * bw + k];
                    let lo = wv & 0x0f0f0f0fu;
                    let hi = (wv >> 4u) & 0x0f0f0f0fu;
                    isum += dot4I8Packed(lo, arena[ag + c * 2u * bw + k]);
                    isum += dot4I8Packed(hi, arena[ag + c * 2u * bw + bw + k]);
                }
            }
            isum -= 8i * bitcast<i32>(arena[p.in2 + t * ng + g]);
        }
        let s = sf_mul(w[p.w_scales + r * ng + g], arena[p.in1 + t * ng + g]);
        acc = sf_fma(s, sf_from_i32(isum), acc);
    }
    arena[p.out0 + t * p.rows + r] = acc;
}

// `matvec` with the weights read a tile at a time: a workgroup of 64 lanes takes 64 rows (one
// token); per step the lanes copy 32 words of each of those rows into workgroup memory,
// consecutive lanes reading consecutive words of a row (memory reads that coalesce, where each
// lane reading its own row does not), then each lane computes its row from the tile with
// `matvec`'s arithmetic: the same exact integer sums of each group and the same combines in
// group order, so the same bits.
const TILE_WORDS: u32 = 32u;
// (a word of padding per row: the lanes reading their rows' word j meet different banks)
const TILE_STRIDE: u32 = 33u;
var<workgroup> tile: array<u32, 2112>; // 64 rows x TILE_STRIDE

@compute @workgroup_size(64)
fn matvec_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let r0 = wid.x * 64u;
    let t = wid.y;
    let r = r0 + lane;
    let ng = p.cols / p.group;
    let row_words = p.cols / (8u - 4u * (1u - p.int4)); // int8: cols / 4; int4: cols / 8
    let gw = p.group / (8u - 4u * (1u - p.int4));
    let ga = p.group / 4u;
    let arow = p.in0 + t * (p.cols / 4u);
    var acc = 0u;
    var isum = 0i;
    for (var s0 = 0u; s0 < row_words; s0 += TILE_WORDS) {
        // (every lane has read the last tile)
        workgroupBarrier();
        for (var i = lane; i < 64u * TILE_WORDS; i += 64u) {
            let row = r0 + i / TILE_WORDS;
            let k = s0 + i % TILE_WORDS;
            var v = 0u;
            if (row < p.rows && k < row_words) {
                v = w[p.w_data + row * row_words + k];
            }
            tile[(i / TILE_WORDS) * TILE_STRIDE + i % TILE_WORDS] = v;
        }
        workgroupBarrier();
        if (r < p.rows && t < p.n) {
            for (var j = 0u; j < min(TILE_WORDS, row_words - s0); j++) {
                let q = s0 + j;
                let g = q / gw;
                let qg = q % gw;
                let wv = tile[lane * TILE_STRIDE + j];
                let ag = arow + g * ga;
                if (p.int4 == 0u) {
                    isum += dot4I8Packed(wv, arena[ag + qg]);
                } else {
                    // word `qg` of the group: word `k` of nibble block `c` (see `matvec`)
                    let bw = p.nb / 8u;
                    let c = qg / bw;
                    let k = qg % bw;
                    isum += dot4I8Packed(wv & 0x0f0f0f0fu, arena[ag + c * 2u * bw + k]);
                    isum += dot4I8Packed((wv >> 4u) & 0x0f0f0f0fu, arena[ag + c * 2u * bw + bw + k]);
                }
                if (qg == gw - 1u) {
                    if (p.int4 != 0u) {
                        isum -= 8i * bitcast<i32>(arena[p.in2 + t * ng + g]);
                    }
                    let s = sf_mul(w[p.w_scales + r * ng + g], arena[p.in1 + t * ng + g]);
                    acc = sf_fma(s, sf_from_i32(isum), acc);
                    isum = 0i;
                }
            }
        }
    }
    if (r < p.rows && t < p.n) {
        arena[p.out0 + t * p.rows + r] = acc;
    }
}

// One lane per element of `[n]`: h = silu(g) * u.
@compute @workgroup_size(64)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = gid.x + gid.y * nw.x * 64u;
    if (i >= p.n) {
        return;
    }
    arena[p.out0 + i] = sf_mul(sf_silu(arena[p.in0 + i]), arena[p.in1 + i]);
}
