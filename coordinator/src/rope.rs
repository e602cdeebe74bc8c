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
        let mut out = vec![0.0f32; 2 * h];
        for i in 0..h {
            let (a, b) = if interleaved {
                (x[2 * i], x[2 * i + 1])
            } else {
                (x[i], x[i + h])
            };
            out[i] = a * self.cos[i] - b * self.sin[i];
            out[i + h] = b * self.cos[i] + a * self.sin[i];
        }
        x.copy_from_slice(&out);
    }
}
