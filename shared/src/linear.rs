//! Linear layers: a weight in f32 or quantized, multiplied by the kernel the CPU supports best,
//! and the SwiGLU MLP built from three of them.

use crate::kernels::{silu_mul, Matrix};
use crate::quant::{active_isa, lanes_wanted, Activations, QMatrix};

/// A linear layer's weight `[out, in]`: f32, or quantized ([`QMatrix`]) and multiplied by the
/// kernel the CPU supports best.
#[derive(Debug, Clone, PartialEq)]
pub enum Linear {
    F32(Matrix),
    Quant(QMatrix),
}

impl Linear {
    pub fn rows(&self) -> usize {
        match self {
            Self::F32(m) => m.rows,
            Self::Quant(q) => q.rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            Self::F32(m) => m.cols,
            Self::Quant(q) => q.cols,
        }
    }
    /// `x`: `[n, cols]` -> `[n, rows]`.
    pub fn matmul(&self, x: &[f32], n: usize) -> Vec<f32> {
        match self {
            Self::F32(m) => m.matmul(x, n),
            Self::Quant(q) => q.matmul_with(x, n, active_isa(), q.act),
        }
    }
    /// This weight multiplied with activations `act` (see [`QMatrix::act`]; f32 weights are
    /// unaffected).
    pub fn with_activations(self, act: Activations) -> Self {
        match self {
            Self::Quant(q) => Self::Quant(QMatrix { act, ..q }),
            other => other,
        }
    }
    /// [`Self::with_activations`], in the memory layout the kernels run fastest on: quantized
    /// weights go to [`crate::quant::Layout::Lanes16`] where [`lanes_wanted`] and the shape
    /// allow. The products are bit-identical either way.
    pub fn prepared(self, act: Activations) -> Self {
        match self.with_activations(act) {
            Self::Quant(q) if lanes_wanted(act) && q.lanes_apply() => {
                Self::Quant(q.to_lanes().expect("lanes apply"))
            }
            other => other,
        }
    }
    /// Row `r` as f32 (embedding lookup).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        match self {
            Self::F32(m) => m.row(r).to_vec(),
            Self::Quant(q) => q.dequantize_row(r),
        }
    }
    /// Row `r` as f32, the values [`Self::to_f32`] holds: borrowed from an f32 weight, else
    /// dequantized into `buf` (`cols` floats). Kernels written for f32 rows read a quantized
    /// weight through it at its stored size, with the same bits as from its f32 copy.
    pub fn row_into<'a>(&'a self, r: usize, buf: &'a mut [f32]) -> &'a [f32] {
        match self {
            Self::F32(m) => m.row(r),
            Self::Quant(q) => {
                q.dequantize_row_into(r, buf);
                buf
            }
        }
    }
    /// The whole weight as f32.
    pub fn to_f32(&self) -> Matrix {
        match self {
            Self::F32(m) => m.clone(),
            Self::Quant(q) => q.dequantize(),
        }
    }
    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        match self {
            Self::F32(m) => 4 * m.data.len(),
            Self::Quant(q) => q.data.len() + 4 * (q.scales.len() + q.mins.len()),
        }
    }
    /// Number of weights.
    pub fn params(&self) -> usize {
        self.rows() * self.cols()
    }
}

/// Below this many weight bytes, and for a few tokens, a matmul runs whole on one thread in
/// [`matmul_each`]: started on two threads, a matrix this small streams no faster than on one
/// (`cargo bench --bench kernels -- --summary --quick --yardstick`: the yardstick's 0.16-0.4 MB
/// projections read 59-76% of the probe on two threads, 84-99% on one).
const SMALL_MATMUL_BYTES: usize = 1 << 20;

/// Tokens up to which [`matmul_each`] runs small matrices one per thread (more tokens make each
/// matmul compute-bound, and splitting its rows pays).
const SMALL_MATMUL_TOKENS: usize = 8;

/// `[w x for w in ws]` for weights that read the same input `x` (`[n, cols]`), each product
/// exactly [`Linear::matmul`]'s. Small matrices at a few tokens run side by side, each whole on
/// one thread; others one after the other, each split over the threads.
pub fn matmul_each<const N: usize>(ws: [&Linear; N], x: &[f32], n: usize) -> [Vec<f32>; N] {
    if n <= SMALL_MATMUL_TOKENS && ws.iter().all(|w| w.bytes() < SMALL_MATMUL_BYTES) {
        let mut ys = crate::par::map(N, |i| ws[i].matmul(x, n)).into_iter();
        return std::array::from_fn(|_| ys.next().expect("one product per weight"));
    }
    ws.map(|w| w.matmul(x, n))
}

impl From<Matrix> for Linear {
    fn from(m: Matrix) -> Self {
        Self::F32(m)
    }
}

/// A SwiGLU feed-forward block: `down(silu(gate x) * up x)`. Dense MLPs, shared experts and
/// routed experts are all this.
#[derive(Debug, Clone)]
pub struct SwiGlu {
    /// `[inter, hidden]`
    pub gate: Linear,
    /// `[inter, hidden]`
    pub up: Linear,
    /// `[hidden, inter]`
    pub down: Linear,
}

/// Gate elements per parallel chunk of a SwiGLU block (a step of several tokens through a wide
/// block; fewer run on one thread).
const GATE_CHUNK: usize = 4096;

/// `h[i] = silu(h[i]) * u[i]`, in parallel chunks where there is enough of it (a step of several
/// tokens through a wide block); each element's arithmetic is the same either way.
fn gate_in_place(h: &mut [f32], u: &[f32]) {
    let run = |h: &mut [f32], u: &[f32]| silu_mul(h, &u[..h.len()]);
    if h.len() >= 2 * GATE_CHUNK {
        crate::par::for_each_chunk_mut(h, GATE_CHUNK, |i, c| run(c, &u[i * GATE_CHUNK..]));
    } else {
        run(h, u);
    }
}

impl SwiGlu {
    /// `x`: `[n, hidden]` -> `[n, hidden]`.
    pub fn forward(&self, x: &[f32], n: usize) -> Vec<f32> {
        if let (Linear::Quant(gq), Linear::Quant(uq)) = (&self.gate, &self.up) {
            if let Some(mut y) = QMatrix::matmul_pair_joined(gq, uq, x, n, active_isa()) {
                // each token's gate and up side by side: gated in place, then packed to
                // `[n, inter]` (nothing to move for one token)
                let inter = gq.rows;
                let gate = |row: &mut [f32]| {
                    let (g, u) = row.split_at_mut(inter);
                    silu_mul(g, u);
                };
                if n * inter >= 2 * GATE_CHUNK {
                    crate::par::for_each_chunk_mut(&mut y, 2 * inter, |_, row| gate(row));
                } else {
                    y.chunks_exact_mut(2 * inter).for_each(gate);
                }
                for t in 1..n {
                    y.copy_within(2 * inter * t..2 * inter * t + inter, inter * t);
                }
                y.truncate(n * inter);
                return self.down.matmul(&y, n);
            }
        }
        let (g, u) = (self.gate.matmul(x, n), self.up.matmul(x, n)); // [n, inter] each
        let mut h = g;
        gate_in_place(&mut h, &u);
        self.down.matmul(&h, n)
    }

    /// Parameters in this block.
    pub fn params(&self) -> usize {
        self.gate.params() + self.up.params() + self.down.params()
    }

    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }

    /// Whether each of its matrices is big enough to stream faster split over the threads than
    /// whole on one ([`SMALL_MATMUL_BYTES`]): a GLM-5.2 expert's are, the yardstick's are not.
    pub fn splits(&self) -> bool {
        [&self.gate, &self.up, &self.down]
            .iter()
            .all(|w| w.bytes() >= SMALL_MATMUL_BYTES)
    }
}

/// `f(i)` for `i < count`, each a block's forward ([`SwiGlu::forward`], which starts loops of its
/// own), in parallel and in order. Blocks that [`SwiGlu::splits`] run whole side by side only
/// while a round fills every thread, the rest one after another over all of them
/// ([`crate::par::map_spread`]: one expert on a 16-thread machine reads with 16 threads, not
/// one); small ones run whole, one per thread ([`crate::par::map`]).
pub fn map_blocks<R: Send>(count: usize, splits: bool, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    if splits {
        crate::par::map_spread(count, f)
    } else {
        crate::par::map(count, f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::silu;
    use crate::quant::{QMatrix, QuantKind};

    fn lin(rows: usize, cols: usize, kind: QuantKind, seed: u64, act: Activations) -> Linear {
        let mut s = seed;
        let data = (0..rows * cols)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
            })
            .collect();
        let q = QMatrix::quantize(&Matrix::new(rows, cols, data), kind, 64).unwrap();
        Linear::Quant(q).prepared(act)
    }

    /// [`matmul_each`] gives each weight's own product, side by side (small, few tokens) or one
    /// after the other (large, or many tokens).
    #[test]
    fn matmul_each_equals_each_matmul() {
        let act = Activations::Int8;
        for (rows, cols) in [(48, 128), (1024, 1024)] {
            let ws = [
                lin(rows, cols, QuantKind::Int8, 4, act),
                lin(rows / 2, cols, QuantKind::Int4, 5, act),
                lin(rows, cols, QuantKind::Int4, 6, Activations::F32),
            ];
            for n in [1, 3, 9] {
                let x: Vec<f32> = (0..n * cols)
                    .map(|i| ((i * 13) % 29) as f32 / 14.0 - 1.0)
                    .collect();
                let got = matmul_each([&ws[0], &ws[1], &ws[2]], &x, n);
                for (w, g) in ws.iter().zip(&got) {
                    assert_eq!(g, &w.matmul(&x, n), "{rows}x{cols}, n = {n}");
                }
            }
        }
    }

    /// A SwiGLU block gives, at every token count and in every layout and activation mode, the
    /// bits of its three products taken one at a time and gated element by element.
    #[test]
    fn swiglu_equals_its_products_one_at_a_time() {
        let (hidden, inter) = (128, 192);
        for kind in [QuantKind::Int4, QuantKind::Int8] {
            for act in [Activations::F32, Activations::Int8] {
                let b = SwiGlu {
                    gate: lin(inter, hidden, kind, 1, act),
                    up: lin(inter, hidden, kind, 2, act),
                    down: lin(hidden, inter, kind, 3, act),
                };
                for n in [1, 2, 3, 5, 9] {
                    let x: Vec<f32> = (0..n * hidden)
                        .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
                        .collect();
                    let (g, u) = (b.gate.matmul(&x, n), b.up.matmul(&x, n));
                    let h: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
                    let want = b.down.matmul(&h, n);
                    let got = b.forward(&x, n);
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{kind:?} {act:?} n = {n}");
                }
            }
        }
    }
}
