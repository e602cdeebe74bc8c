//! Rotary position embedding on one head slice.

use charm_shared::config::RopeSpec;

/// cos/sin tables for one position: `dim / 2` each, attention factor applied.
#[derive(Debug, Clone)]
pub struct RopeAt {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeAt {
    pub fn new(spec: &RopeSpec, pos: usize) -> Self {
        let p = pos as f32;
        let (mut cos, mut sin) = (
            Vec::with_capacity(spec.dim / 2),
            Vec::with_capacity(spec.dim / 2),
        );
        for &f in &spec.inv_freq {
            let a = (p * f) as f64; // torch: position (f32) * inv_freq (f32), then cos/sin in f32
            cos.push(a.cos() as f32 * spec.attention_factor);
            sin.push(a.sin() as f32 * spec.attention_factor);
        }
        Self { cos, sin }
    }

    /// Rotates `x` (`dim` values) in place. Interleaved input pairs `(x[2i], x[2i+1])` or half-split
    /// pairs `(x[i], x[i + dim/2])`; the output is always half-split (`[rotated firsts, rotated
    /// seconds]`), exactly as transformers lays it out. Queries and keys go through the same
    /// permutation, so their dot products are those of the reference.
    pub fn apply(&self, x: &mut [f32], interleaved: bool) {
        let h = self.cos.len();
        debug_assert_eq!(x.len(), 2 * h);
        let rotate = |i: usize, a: f32, b: f32| {
            (
                a * self.cos[i] - b * self.sin[i],
                b * self.cos[i] + a * self.sin[i],
            )
        };
        if !interleaved {
            // half-split pairs rotate in place
            for i in 0..h {
                (x[i], x[i + h]) = rotate(i, x[i], x[i + h]);
            }
            return;
        }
        // Interleaved input, half-split output: through a buffer (on the stack for the head sizes
        // real models use; this runs per head, per token, per layer).
        let mut stack = [0.0f32; 256];
        let mut heap = Vec::new();
        let out: &mut [f32] = if 2 * h <= stack.len() {
            &mut stack[..2 * h]
        } else {
            heap.resize(2 * h, 0.0);
            &mut heap
        };
        for i in 0..h {
            (out[i], out[i + h]) = rotate(i, x[2 * i], x[2 * i + 1]);
        }
        x.copy_from_slice(out);
    }
}
