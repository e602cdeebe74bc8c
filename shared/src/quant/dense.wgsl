// The dense skeleton on the GPU: the GPU twins of the CPU kernels a decoder layer runs outside the
// routed experts (`kernels::dot` and `Matrix::matmul`, `scalar::row_dot`, `kernels::rms_norm`,
// `RopeAt::apply`, `kernels::softmax`, `kernels::axpy`, the residual and bias additions, SwiGLU's
// `silu(g) * u`). Concatenated after softfloat.wgsl: every float step is an `sf_*` function, so
// each output has the bits the CPU computes. (The integer path of int8 activations runs
// expert.wgsl's `quantize` and `matvec`, built with this module's bindings.)
//
// Buffers (words; f32 values are their bit patterns):
// - `w` (read-only): one weight: an f32 matrix or vector, or a quantized matrix as the container
//   lays it out row-major (packed codes, `row_bytes` a row, from word `w_data`), its scales
//   `[rows, groups]` from `w_scales` and int2's minimums from `w_mins`.
// - `arena` (read-write): a step's activations at word offsets the host computes.
// - `p` (uniform, one block a dispatch through a dynamic offset).
// - `kv` (read-write): one sequence's KV cache, `kv_width` words a token from word `kv_base`.
//
// Arithmetic promised, per kernel (the CPU function it mirrors):
// - `linear`: `Matrix::matmul` (f32 weights: `dot`, 8 lanes of multiply-then-add, the fixed tree,
//   then the tail) or `scalar::row_dot` (quantized weights with f32 activations: per group 8 lane
//   partials by fused multiply-adds, each lane's `fma(scale, partial, acc)`, the tree, int2's
//   offsets `fma(min, xsum, offs)` added last; bf16's scale is 1).
// - `rmsnorm`: `rms_norm`: `dot(x, x) / d`, `1 / sqrt(ss + eps)`, `w * (x * r)`.
// - `add`: `x + y` elementwise (`y` from the arena, or a bias from `w` repeated every `cols`).
// - `silu_mul`: `silu(g) * u`.
// - `rope`: `RopeAt::apply`: `(a cos - b sin, b cos + a sin)`, interleaved pairs in, half-split out.
// - `to_kv`: copies rows into the cache (no arithmetic).
// - `gqa_scores`: `dot(q, k) * scale` for every causal key; `softmax_keys`: `softmax` over a query's
//   keys (max, `exp(v - max)` with charm's exp, the sum in key order, then each divided by it);
//   `gqa_values`: the value rows added in key order, `o += p * v` unfused from `o = +0`.
// - `finite`: sets a flag word when any value is NaN or infinite.
// - `dsa_topk`: `routing::top_k_set` (no arithmetic): a query's `k` best scores by `rank_bits`,
//   ties to the lower key, as its ascending key list.

struct Params {
    n: u32,
    rows: u32,
    cols: u32,
    // linear: 0 f32, 1 bf16, 2 int8, 3 int4, 4 int2; add: 1 when the second operand is `w`;
    // rope: 1 for interleaved input pairs
    kind: u32,
    group: u32,
    w_data: u32,
    w_scales: u32,
    w_mins: u32,
    in0: u32,
    in1: u32,
    in2: u32,
    out0: u32,
    eps: u32,
    scale: u32,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    // the score row's stride (the most keys any query of the step sees)
    ctx: u32,
    kv_width: u32,
    kv_off: u32,
    v_off: u32,
    // position of the dispatch's first row in its sequence
    pos0: u32,
    stride_in: u32,
    stride_out: u32,
    rope_off: u32,
    half: u32,
    kv_base: u32,
    // MLA: latent rank, rotary dims, no-rope dims of a query head, value dims of a head
    lat: u32,
    rd: u32,
    nope: u32,
    vd: u32,
    // the step's key lists (`[count, positions...]`, `ctx + 1` words a row) when `sel` is 1
    keys: u32,
    sel: u32,
    // what a sum of f32 starts from (`Iterator::sum`'s initial value) and the DSA head scale
    start: u32,
    hs: u32,
    _pad: array<vec4<u32>, 7>,
}

@group(0) @binding(0) var<storage, read> w: array<u32>;
@group(0) @binding(1) var<storage, read_write> arena: array<u32>;
@group(0) @binding(2) var<uniform> p: Params;
@group(0) @binding(3) var<storage, read_write> kv: array<u32>;

// ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)), as `kernels::dot` and `quant::tree`.
fn tree8(a: array<u32, 8>) -> u32 {
    return sf_add(sf_add(sf_add(a[0], a[4]), sf_add(a[1], a[5])), sf_add(sf_add(a[2], a[6]), sf_add(a[3], a[7])));
}

// Where `dot` reads a vector: the arena, the KV cache, the weight as stored, or the weight's
// dequantized row (`wval`, base = the row).
const ARENA: u32 = 0u;
const KV: u32 = 1u;
const W: u32 = 2u;
const WROW: u32 = 3u;

fn load(src: u32, base: u32, i: u32) -> u32 {
    switch src {
        case 0u: {
            return arena[base + i];
        }
        case 1u: {
            return kv[base + i];
        }
        case 2u: {
            return w[base + i];
        }
        default: {
            return wval(base, i);
        }
    }
}

// `kernels::dot` of `len` values: 8 lanes of multiply-then-add, the fixed tree, then the tail.
fn dot8(sa: u32, a0: u32, sb: u32, b0: u32, len: u32) -> u32 {
    var acc: array<u32, 8>;
    let full = len - len % 8u;
    for (var j = 0u; j < full; j++) {
        acc[j % 8u] = sf_add(acc[j % 8u], sf_mul(load(sa, a0, j), load(sb, b0, j)));
    }
    var tail = 0u;
    for (var j = full; j < len; j++) {
        tail = sf_add(tail, sf_mul(load(sa, a0, j), load(sb, b0, j)));
    }
    return sf_add(tree8(acc), tail);
}

// IEEE maxNum as Rust's f32::max: a NaN operand gives the other.
fn sf_max(a: u32, b: u32) -> u32 {
    if (sf_is_nan(a)) {
        return b;
    }
    if (sf_is_nan(b)) {
        return a;
    }
    let a_neg = (a >> 31u) != 0u;
    let b_neg = (b >> 31u) != 0u;
    var a_less: bool;
    if (a_neg != b_neg) {
        a_less = a_neg;
    } else if (a_neg) {
        a_less = (a & 0x7fffffffu) > (b & 0x7fffffffu);
    } else {
        a_less = a < b;
    }
    if (a_less) {
        return b;
    }
    return a;
}

fn wbyte(b: u32) -> u32 {
    return (w[b >> 2u] >> ((b & 3u) * 8u)) & 0xffu;
}

// Element `j` of a quantized row starting at byte `rb0`, as f32 bits (`scalar::codes8`).
fn code(rb0: u32, j: u32) -> u32 {
    switch p.kind {
        case 1u: {
            return (wbyte(rb0 + 2u * j) | (wbyte(rb0 + 2u * j + 1u) << 8u)) << 16u;
        }
        case 2u: {
            return sf_from_i32(bitcast<i32>(wbyte(rb0 + j) << 24u) >> 24u);
        }
        case 3u: {
            return sf_from_i32(i32((wbyte(rb0 + j / 2u) >> (4u * (j % 2u))) & 15u) - 8i);
        }
        default: {
            return sf_from_i32(i32((wbyte(rb0 + j / 4u) >> (2u * (j % 4u))) & 3u));
        }
    }
}

// One lane per (output row r, input row t): y[t, r] = W[r] . x[t].
@compute @workgroup_size(64)
fn linear(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    let t = gid.y;
    if (r >= p.rows || t >= p.n) {
        return;
    }
    let x0 = p.in0 + t * p.cols;
    if (p.kind == 0u) {
        arena[p.out0 + t * p.rows + r] = dot8(W, p.w_data + r * p.cols, ARENA, x0, p.cols);
        return;
    }
    var acc: array<u32, 8>;
    var bits = 16u;
    if (p.kind == 2u) {
        bits = 8u;
    } else if (p.kind == 3u) {
        bits = 4u;
    } else if (p.kind == 4u) {
        bits = 2u;
    }
    let rb0 = p.w_data * 4u + r * (p.cols * bits / 8u);
    let ng = p.cols / p.group;
    var offs = 0u;
    for (var g = 0u; g < ng; g++) {
        var l: array<u32, 8>;
        for (var i = g * p.group; i < (g + 1u) * p.group; i += 8u) {
            for (var k = 0u; k < 8u; k++) {
                l[k] = sf_fma(code(rb0, i + k), arena[x0 + i + k], l[k]);
            }
        }
        var s = 0x3f800000u;
        if (p.kind != 1u) {
            s = w[p.w_scales + r * ng + g];
        }
        for (var k = 0u; k < 8u; k++) {
            acc[k] = sf_fma(s, l[k], acc[k]);
        }
        if (p.kind == 4u) {
            // the group's sum of x (`lane_sum_scalar`): 8 lanes, then the tree
            var xl: array<u32, 8>;
            for (var i = g * p.group; i < (g + 1u) * p.group; i += 8u) {
                for (var k = 0u; k < 8u; k++) {
                    xl[k] = sf_add(xl[k], arena[x0 + i + k]);
                }
            }
            offs = sf_fma(w[p.w_mins + r * ng + g], tree8(xl), offs);
        }
    }
    arena[p.out0 + t * p.rows + r] = sf_add(tree8(acc), offs);
}

// One lane per row of `cols` values (`n` rows): in0 -> out0 (may be the same), weight `w`.
@compute @workgroup_size(64)
fn rmsnorm(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let t = gid.x + gid.y * nw.x * 64u;
    if (t >= p.n) {
        return;
    }
    var stride = p.stride_in;
    if (stride == 0u) {
        stride = p.cols;
    }
    let x0 = p.in0 + t * stride;
    let ss = sf_div(dot8(ARENA, x0, ARENA, x0, p.cols), sf_from_i32(i32(p.cols)));
    let r = sf_div(0x3f800000u, sf_sqrt(sf_add(ss, p.eps)));
    let o0 = p.out0 + t * stride;
    for (var j = 0u; j < p.cols; j++) {
        arena[o0 + j] = sf_mul(w[p.w_data + j], sf_mul(arena[x0 + j], r));
    }
}

fn flat(gid: vec3<u32>, nw: vec3<u32>) -> u32 {
    return gid.x + gid.y * nw.x * 64u;
}

// One lane per element of `[n]`: out0 = in0 + (in1, or w's bias at `i % cols`).
@compute @workgroup_size(64)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(gid, nw);
    if (i >= p.n) {
        return;
    }
    var b: u32;
    if (p.kind == 1u) {
        b = w[p.w_data + i % p.cols];
    } else {
        b = arena[p.in1 + i];
    }
    arena[p.out0 + i] = sf_add(arena[p.in0 + i], b);
}

// One lane per element of `[n]`: out0 = silu(in0) * in1.
@compute @workgroup_size(64)
fn silu_mul(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(gid, nw);
    if (i >= p.n) {
        return;
    }
    arena[p.out0 + i] = sf_mul(sf_silu(arena[p.in0 + i]), arena[p.in1 + i]);
}

// One lane per (head, row): rotates `2 * half` values at `in0 + t * stride_in + h * cols +
// rope_off` in place with row t's cos (`in1`) and sin (`in2`) tables of `half` values.
@compute @workgroup_size(64)
fn rope(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.x;
    let t = gid.y;
    if (h >= p.heads || t >= p.n) {
        return;
    }
    let x0 = p.in0 + t * p.stride_in + h * p.cols + p.rope_off;
    let c0 = p.in1 + t * p.half;
    let s0 = p.in2 + t * p.half;
    var out: array<u32, 512>;
    for (var i = 0u; i < p.half; i++) {
        var a: u32;
        var b: u32;
        if (p.kind == 1u) {
            a = arena[x0 + 2u * i];
            b = arena[x0 + 2u * i + 1u];
        } else {
            a = arena[x0 + i];
            b = arena[x0 + i + p.half];
        }
        let c = arena[c0 + i];
        let s = arena[s0 + i];
        out[i] = sf_sub(sf_mul(a, c), sf_mul(b, s));
        out[i + p.half] = sf_add(sf_mul(b, c), sf_mul(a, s));
    }
    for (var i = 0u; i < 2u * p.half; i++) {
        arena[x0 + i] = out[i];
    }
}

// One lane per (value, row): kv[kv_base + (pos0 + t) * kv_width + kv_off + i] = in0[t * stride_in + i],
// `cols` values a row.
@compute @workgroup_size(64)
fn to_kv(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= p.cols || t >= p.n) {
        return;
    }
    kv[p.kv_base + (p.pos0 + t) * p.kv_width + p.kv_off + i] = arena[p.in0 + t * p.stride_in + i];
}

// One lane per (key j, head h, row t) with j <= pos0 + t: the score `dot(q, k_j) * scale` at
// `out0 + (t * heads + h) * ctx + j`. Queries `[n, heads * head_dim]` at in0; key head `h /
// (heads / kv_heads)` at `kv_off` of each cache entry.
@compute @workgroup_size(64)
fn gqa_scores(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (t >= p.n || h >= p.heads || j > p.pos0 + t) {
        return;
    }
    let hd = p.head_dim;
    let kvh = h / (p.heads / p.kv_heads);
    let q0 = p.in0 + (t * p.heads + h) * hd;
    let k0 = p.kv_base + j * p.kv_width + p.kv_off + kvh * hd;
    arena[p.out0 + (t * p.heads + h) * p.ctx + j] = sf_mul(dot8(ARENA, q0, KV, k0, hd), p.scale);
}

// One lane per (value c, head h, row t): `out0[t, h, c] = sum over keys j in order of
// p[t, h, j] * v_j[kvh, c]`, the probabilities at `in0` (as `softmax_keys` left them), each key's
// values at `v_off` of its cache entry.
@compute @workgroup_size(64)
fn gqa_values(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (c >= p.head_dim || h >= p.heads || t >= p.n) {
        return;
    }
    let hd = p.head_dim;
    let kvh = h / (p.heads / p.kv_heads);
    let s0 = p.in0 + (t * p.heads + h) * p.ctx;
    var o = 0u;
    for (var j = 0u; j <= p.pos0 + t; j++) {
        o = sf_add(o, sf_mul(arena[s0 + j], kv[p.kv_base + j * p.kv_width + p.v_off + kvh * hd + c]));
    }
    arena[p.out0 + (t * p.heads + h) * hd + c] = o;
}

// One lane per element of `[n]` at in0: any NaN or infinity sets the word at out0 to 1.
@compute @workgroup_size(64)
fn finite(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let i = flat(gid, nw);
    if (i >= p.n) {
        return;
    }
    if ((arena[p.in0 + i] & 0x7f800000u) == 0x7f800000u) {
        arena[p.out0] = 1u;
    }
}

// Element (r, c) of the weight bound as `w`, as `Linear::row_into` gives it: f32 as stored, bf16
// as its value, int8/int4 `scale * code`, int2 `scale * code + min`.
fn wval(r: u32, c: u32) -> u32 {
    if (p.kind == 0u) {
        return w[p.w_data + r * p.cols + c];
    }
    var bits = 16u;
    if (p.kind == 2u) {
        bits = 8u;
    } else if (p.kind == 3u) {
        bits = 4u;
    } else if (p.kind == 4u) {
        bits = 2u;
    }
    let v = code(p.w_data * 4u + r * (p.cols * bits / 8u), c);
    if (p.kind == 1u) {
        return v;
    }
    let ng = p.cols / p.group;
    let g = r * ng + c / p.group;
    let d = sf_mul(w[p.w_scales + g], v);
    if (p.kind == 4u) {
        return sf_add(d, w[p.w_mins + g]);
    }
    return d;
}

// The keys query row t sees: its list when the step has one, else every causal key.
fn key_count(t: u32) -> u32 {
    if (p.sel == 1u) {
        return arena[p.keys + t * (p.ctx + 1u)];
    }
    return p.pos0 + t + 1u;
}

fn key_at(t: u32, i: u32) -> u32 {
    if (p.sel == 1u) {
        return arena[p.keys + t * (p.ctx + 1u) + 1u + i];
    }
    return i;
}

// One lane per row of `cols` (`n` rows), in place: `layer_norm` (`w` holds the weight, then the
// bias from word `w_scales`): the mean and variance summed in order from `start`.
@compute @workgroup_size(64)
fn layernorm(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let t = flat(gid, nw);
    if (t >= p.n) {
        return;
    }
    let x0 = p.in0 + t * p.cols;
    let d = sf_from_i32(i32(p.cols));
    var s = p.start;
    for (var j = 0u; j < p.cols; j++) {
        s = sf_add(s, arena[x0 + j]);
    }
    let mean = sf_div(s, d);
    var v = p.start;
    for (var j = 0u; j < p.cols; j++) {
        let c = sf_sub(arena[x0 + j], mean);
        v = sf_add(v, sf_mul(c, c));
    }
    let r = sf_div(0x3f800000u, sf_sqrt(sf_add(sf_div(v, d), p.eps)));
    for (var j = 0u; j < p.cols; j++) {
        let c = sf_mul(sf_mul(sf_sub(arena[x0 + j], mean), r), w[p.w_data + j]);
        arena[x0 + j] = sf_add(c, w[p.w_scales + j]);
    }
}

// One lane per (latent c, head h, row t): the absorbed query `q_abs[t, h, c] = sum over d <
// nope, in order, of q[t, h, d] * kv_b[h * (nope + vd) + d, c]` from +0 (`absorb_queries`).
// Queries `[n, heads * head_dim]` at in0, out `[n, heads, lat]`.
@compute @workgroup_size(64)
fn mla_absorb(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (c >= p.lat || h >= p.heads || t >= p.n) {
        return;
    }
    let q0 = p.in0 + t * p.heads * p.head_dim + h * p.head_dim;
    let r0 = h * (p.nope + p.vd);
    var acc = 0u;
    for (var d = 0u; d < p.nope; d++) {
        acc = sf_add(acc, sf_mul(arena[q0 + d], wval(r0 + d, c)));
    }
    arena[p.out0 + (t * p.heads + h) * p.lat + c] = acc;
}

// One lane per (key i, head h, row t): `(dot(latent_j, q_abs) + dot(rope_j, q_rope)) * scale`
// (`attend_latent`), at `out0 + (t * heads + h) * ctx + i`. Absorbed queries at in0, the roped
// queries `[n, heads * head_dim]` at in1 (their rotary part after `nope`).
@compute @workgroup_size(64)
fn mla_scores(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (t >= p.n || h >= p.heads || i >= key_count(t)) {
        return;
    }
    let e0 = p.kv_base + key_at(t, i) * p.kv_width;
    let a0 = p.in0 + (t * p.heads + h) * p.lat;
    let r0 = p.in1 + t * p.heads * p.head_dim + h * p.head_dim + p.nope;
    let lat = dot8(KV, e0, ARENA, a0, p.lat);
    let rot = dot8(KV, e0 + p.lat, ARENA, r0, p.rd);
    arena[p.out0 + (t * p.heads + h) * p.ctx + i] = sf_mul(sf_add(lat, rot), p.scale);
}

// One lane per (head, row): softmax over the row's keys' scores at `in0 + (t * heads + h) * ctx`,
// in place (`kernels::softmax`): its key list's, or every causal key's.
@compute @workgroup_size(64)
fn softmax_keys(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.x;
    let t = gid.y;
    if (h >= p.heads || t >= p.n) {
        return;
    }
    let s0 = p.in0 + (t * p.heads + h) * p.ctx;
    let len = key_count(t);
    var m = 0xff800000u;
    for (var j = 0u; j < len; j++) {
        m = sf_max(m, arena[s0 + j]);
    }
    var s = 0u;
    for (var j = 0u; j < len; j++) {
        let e = sf_exp(sf_sub(arena[s0 + j], m));
        arena[s0 + j] = e;
        s = sf_add(s, e);
    }
    for (var j = 0u; j < len; j++) {
        arena[s0 + j] = sf_div(arena[s0 + j], s);
    }
}

// One lane per (latent c, head h, row t): `ctx[t, h, c] = sum over keys in order of p * latent[c]`
// from +0 (`attend_latent`'s `weighted_rows`), probabilities at in0, out `[n, heads, lat]`.
@compute @workgroup_size(64)
fn mla_context(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (c >= p.lat || h >= p.heads || t >= p.n) {
        return;
    }
    let s0 = p.in0 + (t * p.heads + h) * p.ctx;
    var o = 0u;
    for (var i = 0u; i < key_count(t); i++) {
        o = sf_add(o, sf_mul(arena[s0 + i], kv[p.kv_base + key_at(t, i) * p.kv_width + c]));
    }
    arena[p.out0 + (t * p.heads + h) * p.lat + c] = o;
}

// One lane per (value i, head h, row t): `out[t, h * vd + i] = dot(kv_b[h * (nope + vd) + nope + i],
// ctx[t, h])` (`project_values`), contexts at in0.
@compute @workgroup_size(64)
fn mla_values(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (i >= p.vd || h >= p.heads || t >= p.n) {
        return;
    }
    let r = h * (p.nope + p.vd) + p.nope + i;
    let c0 = p.in0 + (t * p.heads + h) * p.lat;
    arena[p.out0 + t * p.heads * p.vd + h * p.vd + i] = dot8(WROW, r, ARENA, c0, p.lat);
}

// One lane per (row r of kv_b, cached key j < n): the naive formulation's expanded keys and
// values `out0[j, r] = dot(kv_b[r], latent_j)` (`Matrix::matmul` of the dequantized kv_b), `rows`
// rows.
@compute @workgroup_size(64)
fn mla_expand(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    let j = gid.y;
    if (r >= p.rows || j >= p.n) {
        return;
    }
    let e0 = p.kv_base + j * p.kv_width;
    arena[p.out0 + j * p.rows + r] = dot8(WROW, r, KV, e0, p.lat);
}

// One lane per (key i, head h, row t), naive MLA: `(dot(q_nope, k_nope_j) + dot(q_rope, rope_j)) *
// scale`; queries at in0, the expanded keys `[keys, rows]` at in1.
@compute @workgroup_size(64)
fn mla_naive_scores(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (t >= p.n || h >= p.heads || i >= key_count(t)) {
        return;
    }
    let j = key_at(t, i);
    let q0 = p.in0 + t * p.heads * p.head_dim + h * p.head_dim;
    let k0 = p.in1 + j * p.rows + h * (p.nope + p.vd);
    let a = dot8(ARENA, q0, ARENA, k0, p.nope);
    let e0 = p.kv_base + j * p.kv_width + p.lat;
    let b = dot8(ARENA, q0 + p.nope, KV, e0, p.rd);
    arena[p.out0 + (t * p.heads + h) * p.ctx + i] = sf_mul(sf_add(a, b), p.scale);
}

// One lane per (value c, head h, row t), naive MLA: the value rows added in key order, `o += p * v`
// from +0; probabilities at in0, the expanded values at in1.
@compute @workgroup_size(64)
fn mla_naive_values(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let h = gid.y;
    let t = gid.z;
    if (c >= p.vd || h >= p.heads || t >= p.n) {
        return;
    }
    let s0 = p.in0 + (t * p.heads + h) * p.ctx;
    var o = 0u;
    for (var i = 0u; i < key_count(t); i++) {
        let v = arena[p.in1 + key_at(t, i) * p.rows + h * (p.nope + p.vd) + p.nope + c];
        o = sf_add(o, sf_mul(arena[s0 + i], v));
    }
    arena[p.out0 + t * p.heads * p.vd + h * p.vd + c] = o;
}

// One lane per (causal key j, row t): the DSA indexer's score, the heads' terms
// `hw[t, h] * hs * max(dot(key_j, q_h) * scale, 0)` summed in head order from `start`
// (`indexer_select`), at `out0 + t * ctx + j`. Queries `[n, heads * head_dim]` at in0, head
// weights `[n, heads]` at in1, keys of `head_dim` at `kv_base + j * kv_width`.
@compute @workgroup_size(64)
fn dsa_scores(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let t = gid.y;
    if (t >= p.n || j > p.pos0 + t) {
        return;
    }
    let k0 = p.kv_base + j * p.kv_width;
    var s = p.start;
    for (var h = 0u; h < p.heads; h++) {
        let q0 = p.in0 + (t * p.heads + h) * p.head_dim;
        let d = sf_mul(dot8(KV, k0, ARENA, q0, p.head_dim), p.scale);
        let term = sf_mul(sf_mul(arena[p.in1 + t * p.heads + h], p.hs), sf_max(d, 0u));
        s = sf_add(s, term);
    }
    arena[p.out0 + t * p.ctx + j] = s;
}

// `routing::rank_bits`: an integer in the scores' order, NaN as negative infinity, -0 as +0.
fn rank_key(b: u32) -> u32 {
    var v = b;
    if ((v & 0x7fffffffu) > 0x7f800000u) {
        v = 0xff800000u;
    } else if ((v & 0x7fffffffu) == 0u) {
        v = 0u;
    }
    if ((v >> 31u) == 1u) {
        return ~v;
    }
    return v | 0x80000000u;
}

// Lanes of a `dsa_topk` workgroup: one query's keys (up to the whole context) are a long pass.
const TOPK_LANES: u32 = 256u;

var<workgroup> topk_hist: array<atomic<u32>, 256>;
var<workgroup> topk_lane: array<vec2<u32>, TOPK_LANES>;
var<workgroup> topk_at: vec2<u32>;

// One workgroup per query row t of a span (`n` rows from position `pos0`): its `k` (`rows`)
// best keys of the `pos0 + t + 1` it sees, by their scores at `in0 + t * ctx`, written as the
// key list MLA reads (`[count, keys...]` at `out0 + t * (ctx + 1)`, ascending): `top_k_set`'s
// choice, exactly. The k-th best rank is found a byte at a time from the top (a histogram of
// the ranks that share the bytes found so far); every key above it is taken, and of those equal
// to it the lowest, as many as are left.
@compute @workgroup_size(TOPK_LANES)
fn dsa_topk(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lane: u32) {
    let t = wg.x;
    if (t >= p.n) {
        return;
    }
    let len = p.pos0 + t + 1u;
    let k = p.rows;
    let src = p.in0 + t * p.ctx;
    let dst = p.out0 + t * (p.ctx + 1u);
    if (len <= k) {
        for (var i = lane; i < len; i += TOPK_LANES) {
            arena[dst + 1u + i] = i;
        }
        if (lane == 0u) {
            arena[dst] = len;
        }
        return;
    }
    var found = 0u;
    var left = k;
    for (var byte = 0u; byte < 4u; byte++) {
        let shift = 24u - 8u * byte;
        for (var b = lane; b < 256u; b += TOPK_LANES) {
            atomicStore(&topk_hist[b], 0u);
        }
        workgroupBarrier();
        for (var i = lane; i < len; i += TOPK_LANES) {
            let key = rank_key(arena[src + i]);
            if (byte == 0u || (key >> (shift + 8u)) == found) {
                atomicAdd(&topk_hist[(key >> shift) & 255u], 1u);
            }
        }
        workgroupBarrier();
        if (lane == 0u) {
            // the byte where the ranks above it, counted from the top, reach the `left` wanted
            var b = 255u;
            var above = 0u;
            loop {
                let c = atomicLoad(&topk_hist[b]);
                if (above + c >= left || b == 0u) {
                    break;
                }
                above += c;
                b -= 1u;
            }
            topk_at = vec2<u32>((found << 8u) | b, left - above);
        }
        workgroupBarrier();
        found = topk_at.x;
        left = topk_at.y;
        workgroupBarrier();
    }
    // `found` is the k-th best rank; `left` keys of that rank are taken, the lowest first. Each
    // lane takes a run of keys: it counts its keys above and at that rank, lane 0 turns the
    // counts into where each run starts in the list, then each lane writes its chosen keys.
    let per = (len + TOPK_LANES - 1u) / TOPK_LANES;
    let lo = min(lane * per, len);
    let hi = min(lo + per, len);
    var above = 0u;
    var at = 0u;
    for (var i = lo; i < hi; i++) {
        let key = rank_key(arena[src + i]);
        if (key > found) {
            above += 1u;
        } else if (key == found) {
            at += 1u;
        }
    }
    topk_lane[lane] = vec2<u32>(above, at);
    workgroupBarrier();
    if (lane == 0u) {
        var out = 0u;
        var ties = 0u;
        for (var j = 0u; j < TOPK_LANES; j++) {
            let c = topk_lane[j];
            topk_lane[j] = vec2<u32>(out, ties);
            out += c.x + min(c.y, left - min(ties, left));
            ties += c.y;
        }
        arena[dst] = k;
    }
    workgroupBarrier();
    var o = topk_lane[lane].x;
    var tie = topk_lane[lane].y;
    for (var i = lo; i < hi; i++) {
        let key = rank_key(arena[src + i]);
        var take = key > found;
        if (key == found) {
            take = tie < left;
            tie += 1u;
        }
        if (take) {
            arena[dst + 1u + o] = i;
            o += 1u;
        }
    }
}
