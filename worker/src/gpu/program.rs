//! Programs of kernel dispatches for the dense skeleton: the kernels of
//! [`charm_shared::quant::gpu::DENSE_SHADER`] and the expert kernels' integer path built with one
//! set of bindings (a weight, the step's arena, a parameter block, a KV cache), buffers, and a
//! list of dispatches run in one submission with what it reads back. What the dispatches compute
//! is the caller's (the coordinator's GPU forward); this file only moves bytes and records.

use charm_shared::quant::gpu::{perturbed_dense_shader, DENSE_SHADER, EXPERT_SHADER, WORKGROUP};

use super::{Gpu, GpuError};

/// Bytes of one dispatch's parameter block as the shaders read it (the dense `Params` is 64 words;
/// the expert kernels' 16 words fit in it).
pub const BLOCK_BYTES: usize = 256;

/// The dense kernels and the expert kernels' integer path, built for this device.
pub struct Kernels {
    layout: wgpu::BindGroupLayout,
    pipes: Vec<(&'static str, wgpu::ComputePipeline)>,
    /// Bound where a dispatch reads no weight, and where it has no cache (one buffer cannot be
    /// bound read-only and read-write in one dispatch).
    dummy: [wgpu::Buffer; 2],
    /// Bytes between two dispatches' parameter blocks.
    stride: u64,
    params: std::sync::Mutex<Option<wgpu::Buffer>>,
    params_async: std::sync::Mutex<Option<wgpu::Buffer>>,
    staging: std::sync::Mutex<Option<wgpu::Buffer>>,
}

impl std::fmt::Debug for Kernels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernels({} pipelines)", self.pipes.len())
    }
}

/// The entry points of the dense shader.
const DENSE_ENTRIES: [&str; 20] = [
    "linear",
    "rmsnorm",
    "add",
    "silu_mul",
    "rope",
    "to_kv",
    "gqa_scores",
    "gqa_values",
    "finite",
    "layernorm",
    "mla_absorb",
    "mla_scores",
    "softmax_keys",
    "mla_context",
    "mla_values",
    "mla_expand",
    "mla_naive_scores",
    "mla_naive_values",
    "dsa_scores",
    "dsa_topk",
];

/// One dispatch: a kernel, the buffers it binds, its parameter block and its workgroups.
#[derive(Debug, Clone)]
pub struct Dispatch {
    pub entry: &'static str,
    pub w: Option<wgpu::Buffer>,
    pub kv: Option<wgpu::Buffer>,
    pub params: [u32; BLOCK_BYTES / 4],
    pub groups: [u32; 3],
}

/// Workgroups for `n` lanes along x (at most 65535 a dimension: the rest go to y, which the
/// flat kernels fold back).
pub fn flat_groups(n: usize) -> [u32; 3] {
    let g = (n as u64).div_ceil(WORKGROUP as u64).max(1);
    if g <= 65535 {
        [g as u32, 1, 1]
    } else {
        [65535, g.div_ceil(65535) as u32, 1]
    }
}

/// Workgroups for `x` lanes along x and `y`, `z` along the others.
pub fn grid(x: usize, y: usize, z: usize) -> [u32; 3] {
    [
        (x as u32).div_ceil(WORKGROUP).max(1),
        (y as u32).max(1),
        (z as u32).max(1),
    ]
}

impl Gpu {
    /// Builds the dense kernels (and the expert kernels' integer path) for this device.
    pub fn dense_kernels(&self) -> Result<Kernels, GpuError> {
        let device = &self.device;
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let (layout, pipeline_layout) =
            super::kernel_layouts(device, "charm dense", BLOCK_BYTES as u64, true);
        // (tests of the dense check only: `CHARM_GPU_TEST_PERTURB=dense` builds kernels that
        // sum in another order)
        let dense_src = if std::env::var("CHARM_GPU_TEST_PERTURB").as_deref() == Ok("dense") {
            perturbed_dense_shader().into()
        } else {
            std::borrow::Cow::Borrowed(DENSE_SHADER)
        };
        let module = |label, src: std::borrow::Cow<'static, str>| {
            device.create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(label),
                source: wgpu::ShaderSource::Wgsl(src),
            })
        };
        let (dense, expert) = (
            module("charm dense", dense_src),
            module("charm experts", EXPERT_SHADER.into()),
        );
        let pipeline = |m: &wgpu::ShaderModule, entry: &str| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pipeline_layout),
                module: m,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        let mut pipes: Vec<(&'static str, wgpu::ComputePipeline)> = DENSE_ENTRIES
            .iter()
            .map(|&e| (e, pipeline(&dense, e)))
            .collect();
        pipes.push(("quantize", pipeline(&expert, "quantize")));
        pipes.push(("matvec", pipeline(&expert, self.matvec_kernel.entry())));
        let dummy = [0, 1].map(|_| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("unbound"),
                size: 256,
                usage: wgpu::BufferUsages::STORAGE,
                mapped_at_creation: false,
            })
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Unsupported {
                adapter: self.name.clone(),
                driver: self.driver.clone(),
                what: format!("the dense kernels ({e})"),
            });
        }
        let stride =
            (device.limits().min_uniform_buffer_offset_alignment as u64).max(BLOCK_BYTES as u64);
        Ok(Kernels {
            layout,
            pipes,
            dummy,
            stride,
            params: Default::default(),
            params_async: Default::default(),
            staging: Default::default(),
        })
    }

    /// The largest buffer one binding may hold, bytes (what [`Gpu::storage`] makes at most).
    pub fn max_binding(&self) -> u64 {
        self.max_binding
    }

    /// A device buffer of `bytes` (a multiple of 4) that kernels read and write and copies
    /// fill and read; its contents start as zeros.
    pub fn storage(&self, bytes: u64, label: &str) -> Result<wgpu::Buffer, GpuError> {
        if bytes > self.max_binding {
            return Err(GpuError::Format(format!(
                "{label}: {bytes} bytes exceed the device's largest binding ({})",
                self.max_binding
            )));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let b = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(4).next_multiple_of(4),
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Device(format!(
                "out of memory for {label} ({bytes} bytes): {e}"
            )));
        }
        Ok(b)
    }

    /// A buffer holding `bytes` (padded to whole words), for weights.
    pub fn constant(&self, bytes: &[u8], label: &str) -> Result<wgpu::Buffer, GpuError> {
        let b = self.storage(bytes.len() as u64, label)?;
        let whole = bytes.len() / 4 * 4;
        self.queue.write_buffer(&b, 0, &bytes[..whole]);
        if whole < bytes.len() {
            let mut last = [0u8; 4];
            last[..bytes.len() - whole].copy_from_slice(&bytes[whole..]);
            self.queue.write_buffer(&b, whole as u64, &last);
        }
        Ok(b)
    }

    /// Writes `data` at word `word` of `buffer`; it lands before the next submission runs.
    pub fn write(&self, buffer: &wgpu::Buffer, word: u64, data: &[f32]) {
        if !data.is_empty() {
            self.queue
                .write_buffer(buffer, word * 4, bytemuck::cast_slice(data));
        }
    }

    /// Runs `ops` in order in one submission, then reads back each `(buffer, word, len)` of
    /// `reads` (after every dispatch). The arena is bound to every dispatch.
    pub fn run_program(
        &self,
        k: &Kernels,
        arena: &wgpu::Buffer,
        ops: &[Dispatch],
        reads: &[(&wgpu::Buffer, u64, usize)],
    ) -> Result<Vec<Vec<f32>>, GpuError> {
        let enc = self.encode_program(k, arena, ops, &k.params)?;
        self.finish_program(k, enc, reads)
    }

    /// Submits `ops` and returns without waiting: the device runs them while the caller goes
    /// on (the next [`Gpu::run_program`] runs after them and waits for both). Its parameter
    /// blocks have a buffer of their own, so the next submission's do not overwrite them.
    pub fn submit_program(
        &self,
        k: &Kernels,
        arena: &wgpu::Buffer,
        ops: &[Dispatch],
    ) -> Result<(), GpuError> {
        let enc = self.encode_program(k, arena, ops, &k.params_async)?;
        self.queue.submit([enc.finish()]);
        Ok(())
    }

    /// `ops` recorded into a command encoder, their parameter blocks written into `slot`'s
    /// buffer (they land before the next submission runs).
    fn encode_program(
        &self,
        k: &Kernels,
        arena: &wgpu::Buffer,
        ops: &[Dispatch],
        slot: &std::sync::Mutex<Option<wgpu::Buffer>>,
    ) -> Result<wgpu::CommandEncoder, GpuError> {
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("dense"),
            });
        if !ops.is_empty() {
            let bytes = k.stride * ops.len() as u64;
            let params = {
                let mut slot = slot.lock().expect("params buffer");
                grown(
                    &self.device,
                    &mut slot,
                    bytes,
                    "dense params",
                    wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                )
            };
            let mut pbytes = vec![0u8; bytes as usize];
            for (i, op) in ops.iter().enumerate() {
                let o = i * k.stride as usize;
                pbytes[o..o + BLOCK_BYTES].copy_from_slice(bytemuck::cast_slice(&op.params));
            }
            self.queue.write_buffer(&params, 0, &pbytes);
            let binds: Vec<wgpu::BindGroup> = ops
                .iter()
                .map(|op| {
                    self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                        label: Some(op.entry),
                        layout: &k.layout,
                        entries: &[
                            wgpu::BindGroupEntry {
                                binding: 0,
                                resource: op.w.as_ref().unwrap_or(&k.dummy[0]).as_entire_binding(),
                            },
                            wgpu::BindGroupEntry {
                                binding: 1,
                                resource: arena.as_entire_binding(),
                            },
                            wgpu::BindGroupEntry {
                                binding: 2,
                                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                    buffer: &params,
                                    offset: 0,
                                    size: wgpu::BufferSize::new(BLOCK_BYTES as u64),
                                }),
                            },
                            wgpu::BindGroupEntry {
                                binding: 3,
                                resource: op.kv.as_ref().unwrap_or(&k.dummy[1]).as_entire_binding(),
                            },
                        ],
                    })
                })
                .collect();
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("dense"),
                timestamp_writes: None,
            });
            for (i, (op, bind)) in ops.iter().zip(&binds).enumerate() {
                let pipe = k
                    .pipes
                    .iter()
                    .find(|(e, _)| *e == op.entry)
                    .map(|(_, p)| p)
                    .ok_or_else(|| GpuError::Format(format!("no kernel {}", op.entry)))?;
                pass.set_pipeline(pipe);
                pass.set_bind_group(0, bind, &[(i as u64 * k.stride) as u32]);
                let [x, y, z] = op.groups;
                pass.dispatch_workgroups(x, y, z);
            }
        }
        Ok(enc)
    }

    /// Copies `reads` out after what `enc` holds, submits it and waits for the device.
    fn finish_program(
        &self,
        k: &Kernels,
        mut enc: wgpu::CommandEncoder,
        reads: &[(&wgpu::Buffer, u64, usize)],
    ) -> Result<Vec<Vec<f32>>, GpuError> {
        let total: usize = reads.iter().map(|r| r.2).sum();
        let staging_bytes = (total as u64 * 4).max(4);
        let staging = {
            let mut slot = k.staging.lock().expect("staging buffer");
            grown(
                &self.device,
                &mut slot,
                staging_bytes,
                "dense staging",
                wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            )
        };
        let mut o = 0u64;
        for &(b, word, len) in reads {
            if len > 0 {
                enc.copy_buffer_to_buffer(b, word * 4, &staging, o, len as u64 * 4);
            }
            o += len as u64 * 4;
        }
        let lens: Vec<usize> = reads.iter().map(|r| r.2).collect();
        self.read_back(enc, &staging, &lens)
    }
}

use super::submit::grown;
