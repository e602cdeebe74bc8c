//! f32 reference kernels: matmul against `[out, in]` weights, norms, activations.
//!
//! Every reduction runs in a fixed order per output element (8 interleaved partial sums, then a
//! fixed tree), independent of how many tokens are in the batch and of the thread count, so one
//! row's result is bit-identical whether it is computed alone or in a batch.

/// A row-major `[rows, cols]` f32 weight (PyTorch `nn.Linear.weight` layout: `[out, in]`).
#[derive(Clone, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Matrix[{}x{}]", self.rows, self.cols)
    }
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(
            rows * cols,
            data.len(),
            "matrix data does not match its shape"
        );
        Self { rows, cols, data }
    }

    /// Row `r`.
    #[inline]
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }

    /// Rows `[start, start + n)` as a new matrix.
    pub fn slice_rows(&self, start: usize, n: usize) -> Matrix {
        Matrix::new(
            n,
            self.cols,
            self.data[start * self.cols..(start + n) * self.cols].to_vec(),
        )
    }

    /// `y[t, o] = sum_i x[t, i] * self[o, i]` for `n` tokens: `x` is `[n, cols]`, `y` is `[n, rows]`.
    /// Every element is [`dot`] of its row and token, whatever the split into threads and blocks.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        assert_eq!(x.len(), n * self.cols, "matmul input is not [n, cols]");
        let cols = self.cols;
        par_row_blocks(self.rows, n, 4, 4 * cols, |r0, out| {
            let k = out.len() / n.max(1);
            let full = k - k % 4;
            for i in (0..full).step_by(4) {
                let rows: [&[f32]; 4] = std::array::from_fn(|j| self.row(r0 + i + j));
                for t in 0..n {
                    let v = dots(rows, &x[t * cols..(t + 1) * cols]);
                    for (j, vj) in v.into_iter().enumerate() {
                        out[(i + j) * n + t] = vj;
                    }
                }
            }
            for i in full..k {
                let w = self.row(r0 + i);
                for t in 0..n {
                    out[i * n + t] = dot(w, &x[t * cols..(t + 1) * cols]);
                }
            }
        })
    }
}

/// Runs `row(state, r, out)` for every output row `r < rows` in parallel, `out` being that row's
/// `n` results (one per token), and returns them token-major as `[n, rows]`. Rows go in blocks of
/// about 1/8 of a thread's share; `init` makes one scratch state per block. Every element is
/// computed by the same call whatever the split, so results do not depend on the thread count.
pub fn par_rows<S>(
    rows: usize,
    n: usize,
    row_bytes: usize,
    init: impl Fn() -> S + Sync,
    row: impl Fn(&mut S, usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    par_row_blocks(rows, n, 1, row_bytes, |r0, out| {
        let mut state = init();
        for (k, o) in out.chunks_mut(n).enumerate() {
            row(&mut state, r0 + k, o);
        }
    })
}

/// Below this many weight bytes times tokens a matmul runs on the calling thread: waking another
/// thread costs more than the work.
const PAR_MIN_WORK: usize = 1 << 15;

/// [`par_rows`] for kernels that take several rows at once: `block(r0, out)` computes rows
/// `r0..r0 + out.len() / n` into `out` (`[rows, n]`), and every block but the last starts at a
/// multiple of `align` rows and holds a multiple of `align` rows. `row_bytes` (the weight bytes
/// of one row) sizes the work: small products run as one block on the calling thread. Returns
/// `[n, rows]`.
pub fn par_row_blocks(
    rows: usize,
    n: usize,
    align: usize,
    row_bytes: usize,
    block: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    let mut yt = vec![0.0f32; n * rows]; // [rows, n] while computing
    split_row_blocks(rows, n, align, row_bytes, &mut yt, block);
    if n == 1 {
        return yt;
    }
    // [rows, n] -> [n, rows] in blocks of 16 rows, so that both sides move through memory in
    // runs rather than one element per cache line.
    let mut y = vec![0.0f32; n * rows];
    for r0 in (0..rows).step_by(16) {
        let rs = 16.min(rows - r0);
        let src = &yt[r0 * n..(r0 + rs) * n];
        for t in 0..n {
            let dst = &mut y[t * rows + r0..t * rows + r0 + rs];
            for (k, d) in dst.iter_mut().enumerate() {
                *d = src[k * n + t];
            }
        }
    }
    y
}

/// [`par_row_blocks`]'s split: `yt` in blocks of rows, in parallel unless the work is small.
fn split_row_blocks(
    rows: usize,
    n: usize,
    align: usize,
    row_bytes: usize,
    yt: &mut [f32],
    block: impl Fn(usize, &mut [f32]) + Sync,
) {
    if rows * row_bytes * n < PAR_MIN_WORK {
        block(0, yt);
    } else {
        let per = rows
            .div_ceil(8 * crate::par::threads())
            .max(16)
            .next_multiple_of(align.max(1));
        crate::par::for_each_chunk_mut(yt, n * per, |b, out| block(b * per, out));
    }
}

/// [`par_row_blocks`] for kernels that compute 16 rows at a time and give each token's 16
/// results together: `block(r0, out)` computes rows `r0..r0 + out.len() / n` (a multiple of 16)
/// into `out`, each 16 rows' part of it `[n, 16]`, so a token's results are stored as one run
/// and move to the returned `[n, rows]` as one. `rows` is a multiple of 16.
pub fn par_lane_blocks(
    rows: usize,
    n: usize,
    row_bytes: usize,
    block: impl Fn(usize, &mut [f32]) + Sync,
) -> Vec<f32> {
    assert!(rows.is_multiple_of(16), "lane blocks take 16 rows");
    let mut yt = vec![0.0f32; n * rows]; // [rows / 16, n, 16] while computing
    split_row_blocks(rows, n, 16, row_bytes, &mut yt, block);
    if n == 1 {
        return yt;
    }
    let mut y = vec![0.0f32; n * rows];
    for (b, src) in yt.chunks_exact(16 * n).enumerate() {
        for (t, run) in src.chunks_exact(16).enumerate() {
            y[t * rows + 16 * b..t * rows + 16 * b + 16].copy_from_slice(run);
        }
    }
    y
}

/// Dot product with a fixed reduction order: 8 lanes of unfused multiply-then-add, the fixed tree
/// `((l0 + l4) + (l1 + l5)) + ((l2 + l6) + (l3 + l7))` over them, then the tail. The AVX2 path
/// performs the same roundings in the same order, so the bits are the same on every CPU.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let [d] = dots([a], b);
    d
}

/// `[dot(xs[0], y), ..., dot(xs[N - 1], y)]`, each with exactly [`dot`]'s arithmetic; computing
/// them together only interleaves their independent addition chains (a lone `dot` waits on its
/// adder's latency).
#[inline]
pub fn dots<const N: usize>(xs: [&[f32]; N], y: &[f32]) -> [f32; N] {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { dots_avx2(xs, y) };
    }
    dots_body(xs, y)
}

/// [`dots_body`] written out in AVX2: lane `k` of each accumulator is `acc[k] += x[k] * y[k]`
/// (multiply, then add: two roundings, as the portable body), then the same tree and tail.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dots_avx2<const N: usize>(xs: [&[f32]; N], y: &[f32]) -> [f32; N] {
    use std::arch::x86_64::*;
    let len = y.len();
    for x in xs {
        assert_eq!(x.len(), len);
    }
    let full = len - len % 8;
    let mut acc = [_mm256_setzero_ps(); N];
    for j in (0..full).step_by(8) {
        // SAFETY: `j + 8 <= full <= len`, the length of `y` and of every `xs[i]`.
        let yv = unsafe { _mm256_loadu_ps(y.as_ptr().add(j)) };
        for i in 0..N {
            // SAFETY: as above.
            let xv = unsafe { _mm256_loadu_ps(xs[i].as_ptr().add(j)) };
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(xv, yv));
        }
    }
    let tails: [f32; N] = std::array::from_fn(|i| {
        let mut tail = 0.0f32;
        for (x, y) in xs[i][full..].iter().zip(&y[full..]) {
            tail += x * y;
        }
        tail
    });
    // The tree ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)): halves added, then pairs.
    let half = |v: __m256| _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let mut out = [0.0f32; N];
    let mut i = 0;
    while i + 4 <= N {
        // hadd(hadd(h0, h1), hadd(h2, h3)) = the four trees, one per lane
        let ab = _mm_hadd_ps(half(acc[i]), half(acc[i + 1]));
        let cd = _mm_hadd_ps(half(acc[i + 2]), half(acc[i + 3]));
        // SAFETY: `tails[i..i + 4]` holds 4 floats.
        let t = unsafe { _mm_loadu_ps(tails.as_ptr().add(i)) };
        let r = _mm_add_ps(_mm_hadd_ps(ab, cd), t);
        // SAFETY: `out[i..i + 4]` has room for 4 floats.
        unsafe { _mm_storeu_ps(out.as_mut_ptr().add(i), r) };
        i += 4;
    }
    while i < N {
        let h = half(acc[i]);
        let p = _mm_hadd_ps(h, h);
        out[i] = _mm_cvtss_f32(_mm_add_ss(
            _mm_add_ss(p, _mm_movehdup_ps(p)),
            _mm_set_ss(tails[i]),
        ));
        i += 1;
    }
    out
}

#[inline(always)]
fn dots_body<const N: usize>(xs: [&[f32]; N], y: &[f32]) -> [f32; N] {
    let len = y.len();
    for x in xs {
        assert_eq!(x.len(), len, "dot product of slices of different lengths");
    }
    let mut acc = [[0.0f32; 8]; N];
    let full = len - len % 8;
    for j in (0..full).step_by(8) {
        let yj = &y[j..j + 8];
        for i in 0..N {
            let xj = &xs[i][j..j + 8];
            for k in 0..8 {
                acc[i][k] += xj[k] * yj[k];
            }
        }
    }
    std::array::from_fn(|i| {
        let mut tail = 0.0f32;
        for (x, y) in xs[i][full..].iter().zip(&y[full..]) {
            tail += x * y;
        }
        let a = &acc[i];
        ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])) + tail
    })
}

/// `out[h][i] = dot(entries[i], qs[h])` for every head `h` and each of eight entries, each with
/// exactly [`dot`]'s arithmetic: a block of keys against every head of one query, the block
/// staying in L1 across the heads and its eight sums reduced together.
pub fn dots_heads(entries: [&[f32]; 8], qs: &[&[f32]], out: &mut [[f32; 8]]) {
    let len = entries[0].len();
    assert!(entries.iter().all(|e| e.len() == len) && qs.iter().all(|q| q.len() == len));
    assert_eq!(qs.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the lengths are checked above.
        return unsafe { dots_heads_avx2(entries, qs, out) };
    }
    for (o, q) in out.iter_mut().zip(qs) {
        *o = dots_body(entries, q);
    }
}

/// [`dots_heads`] in AVX2: [`dots8_avx2`] per head. The caller has checked the lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn dots_heads_avx2(entries: [&[f32]; 8], qs: &[&[f32]], out: &mut [[f32; 8]]) {
    use std::arch::x86_64::*;
    for (o, q) in out.iter_mut().zip(qs) {
        // SAFETY: every entry holds `q.len()` floats (checked by the caller); `o` has room for 8.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), dots8_avx2(&entries, q)) };
    }
}

/// `out[h * n + j] = dot(key(j), qs[h])` for `j < n` and every head (`out`: `[heads, n]`): eight
/// keys at a time against every head ([`dots_heads`]), the last ones one by one, each product
/// with exactly [`dot`]'s arithmetic.
pub fn key_dots<'a>(n: usize, key: impl Fn(usize) -> &'a [f32], qs: &[&[f32]], out: &mut [f32]) {
    assert_eq!(out.len(), qs.len() * n, "one score per head and key");
    let mut d8 = vec![[0.0f32; 8]; qs.len()];
    let full = n / 8 * 8;
    for j0 in (0..full).step_by(8) {
        dots_heads(std::array::from_fn(|i| key(j0 + i)), qs, &mut d8);
        for (h, dh) in d8.iter().enumerate() {
            out[h * n + j0..h * n + j0 + 8].copy_from_slice(dh);
        }
    }
    for j in full..n {
        let k = key(j);
        for (h, q) in qs.iter().enumerate() {
            out[h * n + j] = dot(q, k);
        }
    }
}

/// `dot(entries[i], y)` for the eight entries, lane `i` of the result: the accumulators of
/// [`dots_avx2`], their trees side by side ([`tree8`]), plus the tails.
///
/// # Safety
/// AVX2 is present and every entry holds at least `y.len()` floats.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dots8_avx2(entries: &[&[f32]; 8], y: &[f32]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let n = y.len();
    let full = n - n % 8;
    let p: [*const f32; 8] = entries.map(|e| e.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut j = 0;
    while j < full {
        // SAFETY: `j + 8 <= full <= n`, within `y` and (by the contract) every entry.
        let yv = unsafe { _mm256_loadu_ps(y.as_ptr().add(j)) };
        for i in 0..8 {
            // SAFETY: as above.
            let xv = unsafe { _mm256_loadu_ps(p[i].add(j)) };
            acc[i] = _mm256_add_ps(acc[i], _mm256_mul_ps(xv, yv));
        }
        j += 8;
    }
    if full == n {
        // no tails: their zeros added in a register (a stored array read back as one vector
        // would wait on store forwarding)
        return _mm256_add_ps(tree8(acc), _mm256_setzero_ps());
    }
    let mut tails = [0.0f32; 8];
    for (i, t) in tails.iter_mut().enumerate() {
        for k in full..n {
            // SAFETY: `k < n`, as above.
            *t += unsafe { *p[i].add(k) } * y[k];
        }
    }
    // SAFETY: `tails` holds 8 floats.
    _mm256_add_ps(tree8(acc), unsafe { _mm256_loadu_ps(tails.as_ptr()) })
}

/// Lane `i` of the result is [`dots_avx2`]'s tree over `acc[i]`:
/// `((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7))`. The 128-bit halves of `acc[i]` and
/// `acc[i + 4]` are added side by side, then two rounds of pairwise additions finish all eight.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn tree8(acc: [std::arch::x86_64::__m256; 8]) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    // [lo(acc[i]) + hi(acc[i]) | lo(acc[i + 4]) + hi(acc[i + 4])]
    let h = |i: usize| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(acc[i], acc[i + 4]),
            _mm256_permute2f128_ps::<0x31>(acc[i], acc[i + 4]),
        )
    };
    _mm256_hadd_ps(_mm256_hadd_ps(h(0), h(1)), _mm256_hadd_ps(h(2), h(3)))
}

/// `out[h][c] += p[h][j] * rows[j][c]` for every head `h < H` and row `j` in order: each element
/// gets exactly the sequence of unfused multiply-adds that `axpy(out[h], p[h][j], rows[j])` for
/// `j = 0, 1, ...` gives it, but the sums stay in registers across rows and each row is loaded once
/// for all `H` heads.
pub fn weighted_rows<const H: usize>(out: [&mut [f32]; H], p: [&[f32]; H], rows: &[&[f32]]) {
    let len = out.first().map_or(0, |o| o.len());
    for h in 0..H {
        assert!(out[h].len() == len && p[h].len() == rows.len());
    }
    for r in rows {
        assert_eq!(r.len(), len);
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present; the lengths are checked above.
        return unsafe { weighted_rows_avx2(out, p, rows) };
    }
    for (j, r) in rows.iter().enumerate() {
        for h in 0..H {
            axpy_body(out[h], p[h][j], r);
        }
    }
}

/// [`weighted_rows`] for any number of heads (`out[h]` with `p[h]`), four at a time: each row
/// loaded once per four heads, every element the additions of `axpy` row after row.
pub fn weighted_rows_heads(out: &mut [&mut [f32]], p: &[&[f32]], rows: &[&[f32]]) {
    assert_eq!(out.len(), p.len(), "one weight vector per head");
    for (o4, p4) in out.chunks_mut(4).zip(p.chunks(4)) {
        if let ([a, b, c, d], [pa, pb, pc, pd]) = (&mut *o4, p4) {
            weighted_rows([a, b, c, d].map(|x| &mut **x), [pa, pb, pc, pd], rows);
        } else {
            for (o, ph) in o4.iter_mut().zip(p4) {
                weighted_rows([&mut **o], [ph], rows);
            }
        }
    }
}

/// [`weighted_rows`] in AVX2: column tiles of 8 x `V` lanes, `V` wide enough for eight
/// independent accumulators (one head: 64 columns a tile; two: 32; more: 16), so the adders'
/// latency is hidden. The caller has checked the lengths.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn weighted_rows_avx2<const H: usize>(out: [&mut [f32]; H], p: [&[f32]; H], rows: &[&[f32]]) {
    match H {
        1 => weighted_rows_tiles::<H, 8>(out, p, rows),
        2 => weighted_rows_tiles::<H, 4>(out, p, rows),
        _ => weighted_rows_tiles::<H, 2>(out, p, rows),
    }
}

/// [`weighted_rows_avx2`] in tiles of `8 * V` columns, 16 then 8 columns at a time for what the
/// tiles leave, then the tail element by element: every element gets the same multiply, then add,
/// for each row in order.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2")]
fn weighted_rows_tiles<const H: usize, const V: usize>(
    out: [&mut [f32]; H],
    p: [&[f32]; H],
    rows: &[&[f32]],
) {
    use std::arch::x86_64::*;
    let len = out.first().map_or(0, |o| o.len());
    macro_rules! tiles {
        ($v:expr, $from:expr, $to:expr) => {
            for c in ($from..$to).step_by(8 * $v) {
                let mut acc: [[__m256; $v]; H] = std::array::from_fn(|h| {
                    // SAFETY: `c + 8 * V <= len`.
                    std::array::from_fn(|k| unsafe {
                        _mm256_loadu_ps(out[h].as_ptr().add(c + 8 * k))
                    })
                });
                for (j, r) in rows.iter().enumerate() {
                    // SAFETY: every row has `len` floats.
                    let l: [__m256; $v] = std::array::from_fn(|k| unsafe {
                        _mm256_loadu_ps(r.as_ptr().add(c + 8 * k))
                    });
                    for h in 0..H {
                        let pv = _mm256_set1_ps(p[h][j]);
                        for k in 0..$v {
                            acc[h][k] = _mm256_add_ps(acc[h][k], _mm256_mul_ps(pv, l[k]));
                        }
                    }
                }
                for h in 0..H {
                    for k in 0..$v {
                        // SAFETY: as above.
                        unsafe { _mm256_storeu_ps(out[h].as_mut_ptr().add(c + 8 * k), acc[h][k]) };
                    }
                }
            }
        };
    }
    let wide = len - len % (8 * V);
    tiles!(V, 0, wide);
    let by16 = wide + (len - wide) / 16 * 16;
    tiles!(2, wide, by16);
    let by8 = by16 + (len - by16) / 8 * 8;
    tiles!(1, by16, by8);
    for (j, r) in rows.iter().enumerate() {
        for h in 0..H {
            for (o, x) in out[h][by8..].iter_mut().zip(&r[by8..]) {
                *o += p[h][j] * x;
            }
        }
    }
}

/// `y[i] += a * x[i]` (unfused, element by element: the same bits however wide it runs).
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { axpy_avx2(y, a, x) };
    }
    axpy_body(y, a, x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_body(y, a, x)
}

#[inline(always)]
fn axpy_body(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// RMSNorm in place over rows of width `w.len()`: `x * rsqrt(mean(x^2) + eps) * w`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_mut(d) {
        let ss: f32 = dot(row, row) / d as f32;
        let r = 1.0 / (ss + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = g * (*v * r);
        }
    }
}

/// LayerNorm in place over rows of width `w.len()` (biased variance, as `nn.LayerNorm`).
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let d = w.len();
    for row in x.chunks_mut(d) {
        let mean = row.iter().sum::<f32>() / d as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let r = 1.0 / (var + eps).sqrt();
        for ((v, g), bb) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * r * g + bb;
        }
    }
}

/// `x * sigmoid(x)` as `x / (1 + e^-x)`, with charm's own exponential
/// ([`crate::softfloat::silu`]): built from correctly rounded f32 steps only, so that the GPU's
/// soft-float twin gives the same bits (libm's `expf` is not reproducible there).
#[inline]
pub fn silu(x: f32) -> f32 {
    crate::softfloat::silu(x)
}

/// Numerically stable softmax in place: `e^(x - max)` with charm's own exponential
/// ([`crate::softfloat::exp`]), summed in order, then each divided by the sum. Like [`silu`], built
/// from correctly rounded f32 steps only, so that the GPU's soft-float twin gives the same bits
/// (libm's `expf` is not reproducible there).
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    exp_shifted(x, m);
    let s = x.iter().fold(0.0f32, |s, v| s + v);
    x.iter_mut().for_each(|v| *v /= s);
}

/// `x[i] = exp(x[i] - m)` ([`crate::softfloat::exp`]'s bits), eight at a time where the CPU has
/// AVX2.
fn exp_shifted(x: &mut [f32], m: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present. Every lane has the scalar `exp`'s bits.
        return unsafe { crate::softfloat::avx2::exp_shifted(x, m) };
    }
    x.iter_mut()
        .for_each(|v| *v = crate::softfloat::exp(*v - m));
}

/// `h[i] = silu(h[i]) * u[i]` (a SwiGLU gate): [`silu`]'s bits, eight at a time where the CPU has
/// AVX2.
pub fn silu_mul(h: &mut [f32], u: &[f32]) {
    assert_eq!(h.len(), u.len(), "gate and up differ in length");
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: AVX2 is present.
        return unsafe { crate::softfloat::avx2::silu_mul(h, u) };
    }
    for (h, u) in h.iter_mut().zip(u) {
        *h = silu(*h) * u;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `n` values in [-0.5, 0.5) from a linear congruential generator seeded with `seed`.
    pub(crate) fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect()
    }

    #[test]
    fn matmul_matches_f64_reference_on_odd_sizes() {
        for &(r, c, n) in &[(1, 1, 1), (7, 13, 3), (33, 65, 5), (300, 257, 2)] {
            let w = Matrix::new(r, c, lcg(r as u64, r * c));
            let x = lcg(c as u64 + 9, n * c);
            let y = w.matmul(&x, n);
            for t in 0..n {
                for o in 0..r {
                    let want: f64 = (0..c)
                        .map(|i| w.row(o)[i] as f64 * x[t * c + i] as f64)
                        .sum();
                    assert!(
                        (y[t * r + o] as f64 - want).abs() < 1e-5,
                        "{r}x{c} t{t} o{o}"
                    );
                }
            }
        }
    }

    /// The documented arithmetic of [`dot`], written plainly.
    fn dot_reference(a: &[f32], b: &[f32]) -> f32 {
        let mut l = [0.0f32; 8];
        let full = a.len() - a.len() % 8;
        for j in 0..full {
            l[j % 8] += a[j] * b[j];
        }
        let mut tail = 0.0f32;
        for j in full..a.len() {
            tail += a[j] * b[j];
        }
        ((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7])) + tail
    }

    #[test]
    fn dots_and_matmul_are_dot_bit_for_bit() {
        for len in [0, 1, 7, 8, 9, 64, 100, 129] {
            let y = lcg(len as u64 + 3, len);
            let xs: Vec<Vec<f32>> = (0..4).map(|i| lcg(i + 50, len)).collect();
            let got = dots(std::array::from_fn::<_, 4, _>(|i| &xs[i][..]), &y);
            for i in 0..4 {
                assert_eq!(
                    got[i].to_bits(),
                    dot(&xs[i], &y).to_bits(),
                    "len {len} x{i}"
                );
                assert_eq!(got[i].to_bits(), dot_reference(&xs[i], &y).to_bits());
                assert_eq!(got[i].to_bits(), dots_body([&xs[i][..]], &y)[0].to_bits());
            }
        }
        let (r, c) = (37, 129);
        let w = Matrix::new(r, c, lcg(7, r * c));
        let x = lcg(8, 3 * c);
        let y = w.matmul(&x, 3);
        for t in 0..3 {
            for o in 0..r {
                let want = dot_reference(w.row(o), &x[t * c..(t + 1) * c]);
                assert_eq!(y[t * r + o].to_bits(), want.to_bits(), "t{t} o{o}");
            }
        }
    }

    /// [`key_dots`] against [`dot`] per head and key, and its blocks against the portable
    /// [`dots_body`], at key counts with and without whole blocks and lengths that leave every
    /// tail, with signed zeros among the values (a zero tail must still be added).
    #[test]
    fn key_dots_are_dots_bit_for_bit() {
        for (n, len) in [
            (5, 8),
            (8, 0),
            (16, 24),
            (13, 20),
            (21, 160),
            (9, 99),
            (8, 576),
        ] {
            for heads in [1, 2, 3, 5] {
                let mut ks: Vec<Vec<f32>> = (0..n as u64).map(|i| lcg(i + 400, len)).collect();
                ks[3].iter_mut().step_by(3).for_each(|v| *v = -0.0);
                let qs: Vec<Vec<f32>> = (0..heads).map(|h| lcg(h + 500, len)).collect();
                let q: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
                let mut got = vec![0.0f32; heads as usize * n];
                key_dots(n, |j| &ks[j][..], &q, &mut got);
                for h in 0..heads as usize {
                    for j in 0..n {
                        let want = dot(q[h], &ks[j]);
                        assert_eq!(
                            got[h * n + j].to_bits(),
                            want.to_bits(),
                            "{n}x{len} h{h} k{j}"
                        );
                    }
                    for j0 in (0..n / 8 * 8).step_by(8) {
                        let twin: [f32; 8] =
                            dots_body(std::array::from_fn(|i| &ks[j0 + i][..]), q[h]);
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&got[h * n + j0..h * n + j0 + 8]), bits(&twin));
                    }
                }
            }
        }
    }

    /// [`dots_heads`] against [`dots`] per head, at lengths that leave every tail.
    #[test]
    fn dots_heads_are_dots_bit_for_bit() {
        for len in [0, 3, 8, 13, 64, 67, 128] {
            let es: Vec<Vec<f32>> = (0..8).map(|i| lcg(i + 600, len)).collect();
            let e: [&[f32]; 8] = std::array::from_fn(|i| &es[i][..]);
            let qs: Vec<Vec<f32>> = (0..3).map(|h| lcg(h + 700, len)).collect();
            let q: Vec<&[f32]> = qs.iter().map(|q| &q[..]).collect();
            let mut got = vec![[0.0f32; 8]; 3];
            dots_heads(e, &q, &mut got);
            for h in 0..3 {
                let want = dots(e, q[h]);
                for i in 0..8 {
                    assert_eq!(
                        got[h][i].to_bits(),
                        want[i].to_bits(),
                        "len {len} h{h} e{i}"
                    );
                    assert_eq!(got[h][i].to_bits(), dot(q[h], e[i]).to_bits());
                }
            }
        }
    }

    /// [`weighted_rows`] for one to four heads (each its own tile width) at lengths that leave
    /// every kind of remainder: the bits of `axpy` row after row.
    #[test]
    fn weighted_rows_is_repeated_axpy_bit_for_bit() {
        fn check<const H: usize>(len: usize) {
            let rows: Vec<Vec<f32>> = (0..9).map(|j| lcg(j + 100, len)).collect();
            let rr: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
            let p: Vec<Vec<f32>> = (0..H as u64).map(|h| lcg(h + 200, 9)).collect();
            let mut want: Vec<Vec<f32>> = (0..H as u64).map(|h| lcg(h + 300, len)).collect();
            let mut got = want.clone();
            for (j, r) in rr.iter().enumerate() {
                for h in 0..H {
                    axpy_body(&mut want[h], p[h][j], r);
                }
            }
            let mut outs = got.iter_mut();
            let out: [&mut [f32]; H] = std::array::from_fn(|_| &mut outs.next().unwrap()[..]);
            weighted_rows(out, std::array::from_fn(|h| &p[h][..]), &rr);
            for h in 0..H {
                let (a, b): (Vec<u32>, Vec<u32>) = (
                    got[h].iter().map(|v| v.to_bits()).collect(),
                    want[h].iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(a, b, "{H} heads, len {len}, head {h}");
            }
        }
        for len in [0, 5, 8, 16, 24, 37, 64, 72, 88, 128, 135, 200] {
            check::<1>(len);
            check::<2>(len);
            check::<3>(len);
            check::<4>(len);
        }
    }

    #[test]
    fn matmul_is_batch_invariant() {
        let (r, c) = (257, 300);
        let w = Matrix::new(r, c, lcg(1, r * c));
        let x = lcg(2, 9 * c);
        let all = w.matmul(&x, 9);
        for t in 0..9 {
            let one = w.matmul(&x[t * c..(t + 1) * c], 1);
            assert_eq!(one, all[t * r..(t + 1) * r].to_vec(), "token {t}");
        }
    }
}
