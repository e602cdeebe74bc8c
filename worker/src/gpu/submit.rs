//! A submission of expert work: each job's working memory laid out in one arena, its
//! dispatches recorded, submitted, and its outputs read back; and the device's timings for
//! benchmarks.

use charm_shared::linear::SwiGlu;
use charm_shared::quant::gpu::{
    nibble_block, ExpertWords, KernelParams, MatrixWords, PARAMS_BYTES, WORKGROUP,
};

use super::{ExpertLayout, Gpu, GpuError, GpuExpert, Job, Scratch};

/// Words of one job's arena: its input, intermediates and output.
#[derive(Debug, Clone, Copy, Default)]
struct JobArena {
    x: u32,
    qx: [u32; 3],
    g: u32,
    u: u32,
    h: u32,
    qh: [u32; 3],
    y: u32,
    end: u32,
}

impl JobArena {
    /// The regions of a job of `rows` rows at word `at`.
    fn at(at: usize, e: &ExpertLayout, rows: usize) -> Option<Self> {
        let (hidden, inter) = (e.gate.cols, e.gate.rows);
        let mut next = at as u64;
        let mut take = |words: usize| -> u64 {
            let o = next;
            next += words as u64;
            o
        };
        let x = take(rows * hidden);
        let quant = |cols: usize, group: usize, take: &mut dyn FnMut(usize) -> u64| {
            let ng = cols / group;
            [take(rows * cols / 4), take(rows * ng), take(rows * ng)]
        };
        let qx = quant(hidden, e.gate.group, &mut take);
        let g = take(rows * inter);
        let u = take(rows * inter);
        let h = take(rows * inter);
        let qh = quant(inter, e.down.group, &mut take);
        let y = take(rows * e.down.rows);
        let w = |v: u64| u32::try_from(v).ok();
        Some(Self {
            x: w(x)?,
            qx: [w(qx[0])?, w(qx[1])?, w(qx[2])?],
            g: w(g)?,
            u: w(u)?,
            h: w(h)?,
            qh: [w(qh[0])?, w(qh[1])?, w(qh[2])?],
            y: w(y)?,
            end: w(next)?,
        })
    }
}

/// A job's rows in one submission: `(job, first row, rows)`.
type Piece = (usize, usize, usize);

/// A submission recorded by [`Gpu::encode`], not yet submitted.
struct Recorded {
    enc: wgpu::CommandEncoder,
    /// The arena the pieces' regions are in, and the regions.
    arena: wgpu::Buffer,
    arenas: Vec<JobArena>,
}

impl Gpu {
    /// Copies an expert's weights to VRAM.
    pub fn upload(&self, e: &SwiGlu) -> Result<GpuExpert, GpuError> {
        self.upload_words(&ExpertWords::new(e).map_err(GpuError::Format)?)
    }

    /// Copies an expert already laid out for the GPU ([`ExpertWords`]) to VRAM.
    pub fn upload_words(&self, w: &ExpertWords) -> Result<GpuExpert, GpuError> {
        if w.bytes.len() as u64 > self.max_binding {
            return Err(GpuError::Format(format!(
                "{} bytes exceed the device's largest binding ({})",
                w.bytes.len(),
                self.max_binding
            )));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("expert"),
            size: w.bytes.len() as u64,
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Device(format!(
                "out of memory for an expert: {e}"
            )));
        }
        self.queue.write_buffer(&buffer, 0, &w.bytes);
        Ok(GpuExpert {
            buffer,
            words: ExpertLayout {
                gate: w.gate.clone(),
                up: w.up.clone(),
                down: w.down.clone(),
            },
        })
    }

    /// Each job's `[rows, hidden]` outputs (the expert's `SwiGlu::forward` with int8
    /// activations, bit for bit), in as few submissions as the device's binding size allows.
    pub fn run(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<f32>>, GpuError> {
        let mut outs: Vec<Vec<f32>> = jobs
            .iter()
            .map(|j| Vec::with_capacity(j.rows * j.expert.hidden()))
            .collect();
        for batch in self.batches(jobs)? {
            let ys = self.submit(jobs, &batch)?;
            for (&(i, _, _), y) in batch.iter().zip(ys) {
                outs[i].extend_from_slice(&y);
            }
        }
        Ok(outs)
    }

    /// Seconds one repetition of [`Gpu::run`]'s dispatches for `jobs` takes on the device, for
    /// benchmarks: each submission's dispatches recorded `reps` times over in one command buffer,
    /// submitted once and waited for, the time divided by `reps`. The inputs are written and
    /// flushed before the clock starts and nothing is read back, so this is the kernels' time
    /// (plus one submission's latency spread over `reps`), not the transfers'.
    pub fn time_run(&self, jobs: &[Job<'_>], reps: u32) -> Result<f64, GpuError> {
        let reps = reps.max(1);
        let mut seconds = 0.0;
        for batch in self.batches(jobs)? {
            let mut scratch = self.scratch.lock().expect("gpu scratch");
            let recorded = self.encode(&mut scratch, jobs, &batch, reps)?;
            // the inputs' writes go with the next submission: flush them before the clock starts
            self.queue.submit([]);
            self.wait()?;
            let t = std::time::Instant::now();
            self.queue.submit([recorded.enc.finish()]);
            self.wait()?;
            seconds += t.elapsed().as_secs_f64();
        }
        Ok(seconds / reps as f64)
    }

    /// The device's copy bandwidth in GB/s (1e9 bytes a second), for benchmarks: `reps` copies
    /// of one buffer of `bytes` (at most the device's largest buffer) into another
    /// (`copy_buffer_to_buffer`) in one submission, waited for. Each copy counts its bytes twice,
    /// read and written, so the figure compares with the memory's peak bandwidth.
    pub fn copy_bandwidth(&self, bytes: u64, reps: u32) -> Result<f64, GpuError> {
        // copies move whole words (wgpu::COPY_BUFFER_ALIGNMENT)
        let bytes = bytes.min(self.device.limits().max_buffer_size) / 4 * 4;
        if bytes == 0 {
            return Err(GpuError::Format("a copy of no bytes".into()));
        }
        let reps = reps.max(1);
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = |label| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage: wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        };
        let (src, dst) = (buffer("copy source"), buffer("copy destination"));
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(GpuError::Device(format!(
                "out of memory for two buffers of {bytes} bytes: {e}"
            )));
        }
        let copies = |n: u32| {
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("copies"),
                });
            for _ in 0..n {
                enc.copy_buffer_to_buffer(&src, 0, &dst, 0, bytes);
            }
            enc.finish()
        };
        // one copy untimed: the buffers' first use (wgpu zeroes them then)
        self.queue.submit([copies(1)]);
        self.wait()?;
        let recorded = copies(reps);
        let t = std::time::Instant::now();
        self.queue.submit([recorded]);
        self.wait()?;
        let seconds = t.elapsed().as_secs_f64();
        Ok(2.0 * bytes as f64 * reps as f64 / seconds / 1e9)
    }

    /// Blocks until the device has done every submission; the first error it reported.
    pub(super) fn wait(&self) -> Result<(), GpuError> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::Device(e.to_string()))?;
        match self.error.lock().expect("gpu error slot").take() {
            Some(e) => Err(GpuError::Device(e)),
            None => Ok(()),
        }
    }

    /// The jobs cut into pieces that fit the device's largest binding, the pieces grouped into
    /// submissions (each job's pieces in row order).
    fn batches(&self, jobs: &[Job<'_>]) -> Result<Vec<Vec<Piece>>, GpuError> {
        let mut pieces = Vec::new();
        for (i, j) in jobs.iter().enumerate() {
            if j.x.len() != j.rows * j.expert.hidden() {
                return Err(GpuError::Format(format!(
                    "input of {} values for {} rows of {}",
                    j.x.len(),
                    j.rows,
                    j.expert.hidden()
                )));
            }
            let per_row =
                JobArena::at(0, &j.expert.words, 1).map_or(u64::MAX, |a| a.end as u64 * 4);
            let most = ((self.max_binding / per_row.max(1)) as usize).clamp(1, 4096);
            if per_row > self.max_binding {
                return Err(GpuError::Format(format!(
                    "one row of this expert needs {per_row} bytes of working memory, more than the device's largest binding"
                )));
            }
            let mut r = 0;
            while r < j.rows {
                let n = most.min(j.rows - r);
                pieces.push((i, r, n));
                r += n;
            }
        }
        let mut batches = Vec::new();
        let mut batch: Vec<Piece> = Vec::new();
        let mut words = 0u64;
        for p in pieces {
            let need = JobArena::at(0, &jobs[p.0].expert.words, p.2)
                .map_or(u64::MAX, |a| a.end as u64)
                * 4;
            if !batch.is_empty() && (words + need > self.max_binding || batch.len() >= 256) {
                batches.push(std::mem::take(&mut batch));
                words = 0;
            }
            words += need;
            batch.push(p);
        }
        if !batch.is_empty() {
            batches.push(batch);
        }
        Ok(batches)
    }

    /// One submission: the pieces' inputs written, six dispatches each, the outputs read back.
    fn submit(&self, jobs: &[Job<'_>], pieces: &[Piece]) -> Result<Vec<Vec<f32>>, GpuError> {
        let mut scratch = self.scratch.lock().expect("gpu scratch");
        let Recorded {
            mut enc,
            arena,
            arenas,
        } = self.encode(&mut scratch, jobs, pieces, 1)?;
        let out_words: usize = pieces
            .iter()
            .map(|&(i, _, n)| n * jobs[i].expert.words.down.rows)
            .sum();
        let staging_bytes = (out_words as u64 * 4).max(4);
        let staging = grown(
            &self.device,
            &mut scratch.staging,
            staging_bytes,
            "staging",
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        );
        let mut o = 0u64;
        for (&(i, _, n), a) in pieces.iter().zip(&arenas) {
            let bytes = (n * jobs[i].expert.words.down.rows) as u64 * 4;
            enc.copy_buffer_to_buffer(&arena, a.y as u64 * 4, &staging, o, bytes);
            o += bytes;
        }
        let lens: Vec<usize> = pieces
            .iter()
            .map(|&(i, _, n)| n * jobs[i].expert.words.down.rows)
            .collect();
        self.read_back(enc, &staging, &lens)
    }

    /// Submits `enc`, which ends with copies of `lens` words after one another into `staging`
    /// (from its start), waits for the device and returns those runs.
    pub(super) fn read_back(
        &self,
        enc: wgpu::CommandEncoder,
        staging: &wgpu::Buffer,
        lens: &[usize],
    ) -> Result<Vec<Vec<f32>>, GpuError> {
        self.queue.submit([enc.finish()]);
        let total: usize = lens.iter().sum();
        if total == 0 {
            self.wait()?;
            return Ok(lens.iter().map(|_| Vec::new()).collect());
        }
        let slice = staging.slice(..total as u64 * 4);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .map_err(|_| GpuError::Device("the read-back was dropped".into()))?
            .map_err(|e| GpuError::Device(format!("read-back: {e}")))?;
        let data = slice
            .get_mapped_range()
            .map_err(|e| GpuError::Device(format!("read-back: {e}")))?;
        // (a mapped range is aligned for f32: wgpu maps at multiples of 8 bytes)
        let values: &[f32] = bytemuck::cast_slice(&data);
        let mut outs = Vec::with_capacity(lens.len());
        let mut o = 0usize;
        for &len in lens {
            outs.push(values[o..o + len].to_vec());
            o += len;
        }
        drop(data);
        staging.unmap();
        Ok(outs)
    }

    /// A submission's inputs and parameters written (they go with the next submit) and its six
    /// dispatches a piece recorded `reps` times over (each repetition computes the same outputs).
    fn encode(
        &self,
        scratch: &mut Scratch,
        jobs: &[Job<'_>],
        pieces: &[Piece],
        reps: u32,
    ) -> Result<Recorded, GpuError> {
        // regions
        let mut arenas = Vec::with_capacity(pieces.len());
        let mut at = 0usize;
        for &(i, _, n) in pieces {
            let a = JobArena::at(at, &jobs[i].expert.words, n)
                .ok_or_else(|| GpuError::Format("submission too large".into()))?;
            at = a.end as usize;
            arenas.push(a);
        }
        let arena_bytes = (at as u64 * 4).max(4);
        let params_stride = self
            .device
            .limits()
            .min_uniform_buffer_offset_alignment
            .max(PARAMS_BYTES as u32) as u64;
        let params_bytes = params_stride * 6 * pieces.len() as u64;
        let arena = grown(
            &self.device,
            &mut scratch.arena,
            arena_bytes,
            "arena",
            wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
        );
        let params = grown(
            &self.device,
            &mut scratch.params,
            params_bytes,
            "params",
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        );

        let mut pbytes = vec![0u8; params_bytes as usize];
        let mut set = |slot: usize, p: KernelParams| {
            let o = slot * params_stride as usize;
            pbytes[o..o + PARAMS_BYTES].copy_from_slice(&p.to_bytes());
        };
        for (k, (&(i, r0, n), a)) in pieces.iter().zip(&arenas).enumerate() {
            let e = &jobs[i].expert.words;
            let hidden = e.gate.cols;
            let x = &jobs[i].x[r0 * hidden..(r0 + n) * hidden];
            self.queue
                .write_buffer(&arena, a.x as u64 * 4, bytemuck::cast_slice(x));
            let quant = |cols: usize, m: &MatrixWords, src: u32, dst: [u32; 3]| KernelParams {
                cols: cols as u32,
                group: m.group as u32,
                int4: m.int4 as u32,
                n: n as u32,
                nb: nibble_block(m.group) as u32,
                in0: src,
                out0: dst[0],
                out1: dst[1],
                out2: dst[2],
                ..Default::default()
            };
            let mat = |m: &MatrixWords, src: [u32; 3], dst: u32| KernelParams {
                rows: m.rows as u32,
                cols: m.cols as u32,
                group: m.group as u32,
                int4: m.int4 as u32,
                n: n as u32,
                nb: nibble_block(m.group) as u32,
                w_data: m.data as u32,
                w_scales: m.scales as u32,
                in0: src[0],
                in1: src[1],
                in2: src[2],
                out0: dst,
                ..Default::default()
            };
            let inter = e.gate.rows;
            set(6 * k, quant(hidden, &e.gate, a.x, a.qx));
            set(6 * k + 1, mat(&e.gate, a.qx, a.g));
            set(6 * k + 2, mat(&e.up, a.qx, a.u));
            set(
                6 * k + 3,
                KernelParams {
                    n: (n * inter) as u32,
                    in0: a.g,
                    in1: a.u,
                    out0: a.h,
                    ..Default::default()
                },
            );
            set(6 * k + 4, quant(inter, &e.down, a.h, a.qh));
            set(6 * k + 5, mat(&e.down, a.qh, a.y));
        }
        self.queue.write_buffer(&params, 0, &pbytes);

        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("experts"),
            });
        let groups = |n: usize| (n as u32).div_ceil(WORKGROUP);
        // `reps` times over: each repetition computes the same outputs (for `time_run`)
        let each = || pieces.iter().enumerate();
        for (k, &(i, _, n)) in (0..reps).flat_map(|_| each()) {
            let e = &jobs[i].expert;
            let w = &e.words;
            let bind = self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some("expert"),
                layout: &self.layout,
                entries: &[
                    wgpu::BindGroupEntry {
                        binding: 0,
                        resource: e.buffer.as_entire_binding(),
                    },
                    wgpu::BindGroupEntry {
                        binding: 1,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: &arena,
                            offset: 0,
                            size: wgpu::BufferSize::new(arena_bytes),
                        }),
                    },
                    wgpu::BindGroupEntry {
                        binding: 2,
                        resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                            buffer: &params,
                            offset: 0,
                            size: wgpu::BufferSize::new(PARAMS_BYTES as u64),
                        }),
                    },
                ],
            });
            let (hidden, inter) = (w.gate.cols, w.gate.rows);
            let swiglu_groups = groups(n * inter);
            let steps: [(&wgpu::ComputePipeline, u32, u32); 6] = [
                (&self.quantize, groups(hidden / w.gate.group), n as u32),
                (&self.matvec, groups(w.gate.rows), n as u32),
                (&self.matvec, groups(w.up.rows), n as u32),
                (
                    &self.swiglu,
                    swiglu_groups.min(65535),
                    swiglu_groups.div_ceil(65535),
                ),
                (&self.quantize, groups(inter / w.down.group), n as u32),
                (&self.matvec, groups(w.down.rows), n as u32),
            ];
            for (s, (pipe, x, y)) in steps.into_iter().enumerate() {
                // a pass per dispatch: each reads what the one before it wrote
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: None,
                });
                pass.set_pipeline(pipe);
                pass.set_bind_group(0, &bind, &[((6 * k + s) as u64 * params_stride) as u32]);
                pass.dispatch_workgroups(x, y, 1);
            }
        }
        Ok(Recorded { enc, arena, arenas })
    }
}

/// `slot`'s buffer, replaced by a larger one when it holds fewer than `bytes`.
pub(super) fn grown(
    device: &wgpu::Device,
    slot: &mut Option<wgpu::Buffer>,
    bytes: u64,
    label: &str,
    usage: wgpu::BufferUsages,
) -> wgpu::Buffer {
    if let Some(b) = slot {
        if b.size() >= bytes {
            return b.clone();
        }
    }
    let size = bytes.next_power_of_two().max(256);
    let b = device.create_buffer(&wgpu::BufferDescriptor {
        label: Some(label),
        size,
        usage,
        mapped_at_creation: false,
    });
    *slot = Some(b.clone());
    b
}
