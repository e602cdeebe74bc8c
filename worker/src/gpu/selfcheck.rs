//! The self-check a device passes when it opens: these experts on these inputs, bit for bit
//! as the CPU computes them. The experts and inputs: int4 in groups of 64 and int8 in groups of
//! 32 (both nibble blocks and both code widths), rows of typical values, a zero row, tiny and
//! huge values, so the soft-float steps meet subnormal products and large exponents.

use charm_shared::kernels::Matrix;
use charm_shared::linear::{Linear, SwiGlu};
use charm_shared::quant::{Activations, QMatrix, QuantKind};

use super::{same_bits, Gpu, GpuError, Job};

fn matrix(rows: usize, cols: usize, seed: u32, scale: f32) -> Matrix {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
    Matrix::new(
        rows,
        cols,
        (0..rows * cols)
            .map(|i| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                let v = ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * scale;
                // a zero row and a row of one large value
                match i / cols {
                    1 => 0.0,
                    2 if i % cols == 3 => 1e4,
                    _ => v,
                }
            })
            .collect(),
    )
}

fn expert(kind: QuantKind, group: usize, hidden: usize, inter: usize, seed: u32) -> SwiGlu {
    let q = |m: Matrix| {
        Linear::Quant(QMatrix::quantize(&m, kind, group).expect("quantizes"))
            .with_activations(Activations::Int8)
    };
    SwiGlu {
        gate: q(matrix(inter, hidden, seed, 0.2)),
        up: q(matrix(inter, hidden, seed + 1, 0.2)),
        down: q(matrix(hidden, inter, seed + 2, 0.2)),
    }
}

/// `(expert, x, rows)` triples the device must reproduce bit for bit.
pub fn cases() -> Vec<(SwiGlu, Vec<f32>, usize)> {
    // enough groups that every kind of combine step is met (a fused and an unfused
    // multiply-add differ in a few outputs in a hundred at this size)
    let (hidden, inter, rows) = (512, 256, 5);
    let mut x = matrix(rows, hidden, 7, 4.0).data;
    // a zero row, one of tiny values (subnormal scale products), one of huge ones
    x[hidden..2 * hidden].fill(0.0);
    for v in &mut x[3 * hidden..4 * hidden] {
        *v *= 1e-36;
    }
    for v in &mut x[4 * hidden..] {
        *v *= 1e30;
    }
    vec![
        (
            expert(QuantKind::Int4, 64, hidden, inter, 1),
            x.clone(),
            rows,
        ),
        (expert(QuantKind::Int8, 32, hidden, inter, 2), x, rows),
    ]
}

impl Gpu {
    /// The fixed expert of the self-check against the CPU, bit for bit.
    pub(super) fn self_check(&self) -> Result<(), GpuError> {
        for (e, x, rows) in cases() {
            let on_gpu = self.upload(&e)?;
            let got = self
                .run(&[Job {
                    expert: &on_gpu,
                    x: &x,
                    rows,
                }])?
                .remove(0);
            let want = e.forward(&x, rows);
            if let Some(index) = (0..want.len()).find(|&i| !same_bits(got[i], want[i])) {
                return Err(GpuError::SelfCheck {
                    adapter: self.name.clone(),
                    driver: self.driver.clone(),
                    index,
                    gpu: got[index],
                    cpu: want[index],
                    gpu_bits: got[index].to_bits(),
                    cpu_bits: want[index].to_bits(),
                });
            }
        }
        Ok(())
    }
}
