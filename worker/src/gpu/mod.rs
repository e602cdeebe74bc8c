//! The GPU backend: a wgpu device (Vulkan on Linux and Windows, Metal on macOS) running the
//! expert kernels of [`charm_shared::quant::gpu`], and the VRAM tier built on it ([`tier`]).
//!
//! Exactness: the kernels do every float step in integer arithmetic (see `expert.wgsl`), so an
//! expert computed here has the bits the CPU's int8-activation path gives. Each device is checked
//! when it opens ([`Gpu::open`]): a fixed expert on fixed inputs, compared bit for bit with the
//! CPU (every NaN counts as every other: see [`same_bits`]); a device that differs is refused, naming the adapter, its driver and the first output
//! that differs. Nothing accepts other bits.

pub mod memory;
pub mod tier;

use std::sync::Mutex;

use charm_shared::linear::SwiGlu;
use charm_shared::quant::gpu::{
    nibble_block, perturbed_shader, ExpertWords, KernelParams, MatrixWords, ALL_ROWS,
    EXPERT_SHADER, PARAMS_BYTES, WORKGROUP,
};

/// Why no device was opened or a dispatch failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GpuError {
    /// No Vulkan or Metal adapter (no GPU, no driver, or no loader).
    #[error("no GPU adapter found (Vulkan or Metal): is a driver installed?")]
    NoAdapter,
    /// `--gpu ID` names an adapter that is not there.
    #[error("no GPU adapter {id}: {count} found (`charm doctor` lists them)")]
    NoSuchAdapter { id: usize, count: usize },
    /// The adapter lacks a feature the kernels need.
    #[error("GPU {adapter} ({driver}) lacks {what}")]
    Unsupported {
        adapter: String,
        driver: String,
        what: String,
    },
    /// The device gave other bits than the CPU on the self-check.
    #[error("GPU {adapter} ({driver}) refused: its expert kernel differs from the CPU at output {index} ({gpu:?} against the CPU's {cpu:?}, bits {gpu_bits:#010x} against {cpu_bits:#010x})")]
    SelfCheck {
        adapter: String,
        driver: String,
        index: usize,
        gpu: f32,
        cpu: f32,
        gpu_bits: u32,
        cpu_bits: u32,
    },
    /// An expert whose formats the kernels do not take.
    #[error("expert not supported on the GPU: {0}")]
    Format(String),
    /// The device reported an error (out of memory, lost device, validation).
    #[error("GPU {0}")]
    Device(String),
}

/// What `charm doctor` shows of an adapter.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AdapterReport {
    /// The index `--gpu` takes.
    pub id: usize,
    /// As the driver reports it.
    pub name: String,
    pub driver: String,
    pub driver_info: String,
    pub backend: String,
    pub device_type: String,
    /// 64-bit integers in shaders (the soft-float steps need them).
    pub shader_int64: bool,
    /// Largest buffer the device takes, and its free memory as the driver reports it, bytes.
    pub max_buffer_bytes: u64,
    pub free_bytes: Option<u64>,
    /// The self-check's verdict: `"exact"`, or why the device is not used.
    pub verdict: String,
}

fn instance() -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle();
    desc.backends = wgpu::Backends::VULKAN | wgpu::Backends::METAL;
    desc.flags = wgpu::InstanceFlags::empty();
    wgpu::Instance::new(desc)
}

/// The adapters this machine has, in the order `--gpu` counts them.
fn adapters() -> Vec<wgpu::Adapter> {
    pollster::block_on(
        instance().enumerate_adapters(wgpu::Backends::VULKAN | wgpu::Backends::METAL),
    )
}

/// Every adapter and what opening it gives (the self-check included).
pub fn report() -> Vec<AdapterReport> {
    adapters()
        .into_iter()
        .enumerate()
        .map(|(id, a)| {
            let info = a.get_info();
            let verdict = match Gpu::from_adapter(a.clone(), true) {
                Ok(_) => "exact".to_string(),
                Err(e) => e.to_string(),
            };
            AdapterReport {
                id,
                name: info.name,
                driver: info.driver,
                driver_info: info.driver_info,
                backend: format!("{:?}", info.backend),
                device_type: format!("{:?}", info.device_type),
                shader_int64: a.features().contains(wgpu::Features::SHADER_INT64),
                max_buffer_bytes: a.limits().max_buffer_size,
                free_bytes: memory::free_bytes(&a),
                verdict,
            }
        })
        .collect()
}

/// An open device with the expert kernels built, checked against the CPU.
pub struct Gpu {
    device: wgpu::Device,
    queue: wgpu::Queue,
    layout: wgpu::BindGroupLayout,
    quantize: wgpu::ComputePipeline,
    matvec: wgpu::ComputePipeline,
    swiglu: wgpu::ComputePipeline,
    /// Largest storage binding: the most one submission's arena may hold.
    max_binding: u64,
    /// The adapter as its driver names it, and the driver.
    pub name: String,
    pub driver: String,
    /// Free device memory when it opened, bytes, where the driver says ([`memory`]).
    pub free_bytes: Option<u64>,
    /// Buffers reused between submissions (one submission at a time).
    scratch: Mutex<Scratch>,
    /// The first error the device reported since the last submission.
    error: std::sync::Arc<Mutex<Option<String>>>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({}, {})", self.name, self.driver)
    }
}

#[derive(Default)]
struct Scratch {
    arena: Option<wgpu::Buffer>,
    params: Option<wgpu::Buffer>,
    staging: Option<wgpu::Buffer>,
}

/// An expert's weights in VRAM.
#[derive(Debug)]
pub struct GpuExpert {
    buffer: wgpu::Buffer,
    words: ExpertLayout,
}

/// [`ExpertWords`] without its bytes (they are on the device).
#[derive(Debug, Clone)]
struct ExpertLayout {
    gate: MatrixWords,
    up: MatrixWords,
    down: MatrixWords,
}

impl GpuExpert {
    /// Bytes of VRAM held.
    pub fn bytes(&self) -> u64 {
        self.buffer.size()
    }
    fn hidden(&self) -> usize {
        self.words.gate.cols
    }
}

/// One expert's rows in a submission: `x` is `[rows, hidden]`.
#[derive(Debug, Clone, Copy)]
pub struct Job<'a> {
    pub expert: &'a GpuExpert,
    pub x: &'a [f32],
    pub rows: usize,
}

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

/// Whether to build the kernels as shipped or with the deliberately wrong combine (tests of the
/// self-check only: `CHARM_GPU_TEST_PERTURB=1`).
fn shader_source() -> std::borrow::Cow<'static, str> {
    if std::env::var("CHARM_GPU_TEST_PERTURB").as_deref() == Ok("1") {
        perturbed_shader().into()
    } else {
        EXPERT_SHADER.into()
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
    /// Opens adapter `id` (`None`: the first that opens and passes its self-check, discrete
    /// GPUs first), builds the kernels and checks them against the CPU.
    pub fn open(id: Option<usize>) -> Result<Self, GpuError> {
        let all = adapters();
        if let Some(id) = id {
            let count = all.len();
            let a = all
                .into_iter()
                .nth(id)
                .ok_or(GpuError::NoSuchAdapter { id, count })?;
            return Self::from_adapter(a, true);
        }
        let mut all: Vec<_> = all.into_iter().collect();
        all.sort_by_key(|a| match a.get_info().device_type {
            wgpu::DeviceType::DiscreteGpu => 0,
            wgpu::DeviceType::IntegratedGpu => 1,
            wgpu::DeviceType::VirtualGpu => 2,
            wgpu::DeviceType::Other => 3,
            wgpu::DeviceType::Cpu => 4,
        });
        let mut first_err = None;
        for a in all {
            match Self::from_adapter(a, true) {
                Ok(g) => return Ok(g),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        Err(first_err.unwrap_or(GpuError::NoAdapter))
    }

    fn from_adapter(a: wgpu::Adapter, check: bool) -> Result<Self, GpuError> {
        let info = a.get_info();
        let (name, driver) = (
            info.name.clone(),
            format!("{} {}", info.driver, info.driver_info)
                .trim()
                .to_string(),
        );
        let unsupported = |what: &str| GpuError::Unsupported {
            adapter: name.clone(),
            driver: driver.clone(),
            what: what.into(),
        };
        if !a.features().contains(wgpu::Features::SHADER_INT64) {
            return Err(unsupported("64-bit integers in shaders (shaderInt64)"));
        }
        let limits = a.limits();
        let required_limits = wgpu::Limits {
            max_storage_buffer_binding_size: limits.max_storage_buffer_binding_size,
            max_buffer_size: limits.max_buffer_size,
            ..wgpu::Limits::default()
        };
        let (device, queue) = pollster::block_on(a.request_device(&wgpu::DeviceDescriptor {
            label: Some("charm"),
            required_features: wgpu::Features::SHADER_INT64,
            required_limits,
            ..Default::default()
        }))
        .map_err(|e| unsupported(&format!("a device as charm asks for it ({e})")))?;
        let error = std::sync::Arc::new(Mutex::new(None::<String>));
        {
            let error = error.clone();
            device.on_uncaptured_error(std::sync::Arc::new(move |e: wgpu::Error| {
                error
                    .lock()
                    .expect("gpu error slot")
                    .get_or_insert(e.to_string());
            }));
        }
        let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
        let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
            label: Some("charm experts"),
            source: wgpu::ShaderSource::Wgsl(shader_source()),
        });
        let storage = |binding, read_only| wgpu::BindGroupLayoutEntry {
            binding,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Storage { read_only },
                has_dynamic_offset: false,
                min_binding_size: None,
            },
            count: None,
        };
        let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
            label: Some("charm experts"),
            entries: &[
                storage(0, true),
                storage(1, false),
                wgpu::BindGroupLayoutEntry {
                    binding: 2,
                    visibility: wgpu::ShaderStages::COMPUTE,
                    ty: wgpu::BindingType::Buffer {
                        ty: wgpu::BufferBindingType::Uniform,
                        has_dynamic_offset: true,
                        min_binding_size: wgpu::BufferSize::new(PARAMS_BYTES as u64),
                    },
                    count: None,
                },
            ],
        });
        let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
            label: Some("charm experts"),
            bind_group_layouts: &[Some(&layout)],
            immediate_size: 0,
        });
        let pipeline = |entry: &str| {
            device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: Some(&pipeline_layout),
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
        };
        let (quantize, matvec, swiglu) =
            (pipeline("quantize"), pipeline("matvec"), pipeline("swiglu"));
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(unsupported(&format!("the expert kernels ({e})")));
        }
        let gpu = Self {
            device,
            queue,
            layout,
            quantize,
            matvec,
            swiglu,
            max_binding: limits
                .max_storage_buffer_binding_size
                .min(limits.max_buffer_size)
                .min(1 << 30),
            name,
            driver,
            free_bytes: memory::free_bytes(&a),
            scratch: Mutex::new(Scratch::default()),
            error,
        };
        if check {
            gpu.self_check()?;
        }
        Ok(gpu)
    }

    /// The fixed expert of the self-check against the CPU, bit for bit.
    fn self_check(&self) -> Result<(), GpuError> {
        for (e, x, rows) in selfcheck::cases() {
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

    /// Copies an expert's weights to VRAM.
    pub fn upload(&self, e: &SwiGlu) -> Result<GpuExpert, GpuError> {
        let w = ExpertWords::new(e).map_err(GpuError::Format)?;
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
                gate: w.gate,
                up: w.up,
                down: w.down,
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
    fn wait(&self) -> Result<(), GpuError> {
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
        self.queue.submit([enc.finish()]);
        let slice = staging.slice(..staging_bytes);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| GpuError::Device(e.to_string()))?;
        let mapped = rx
            .recv()
            .map_err(|_| GpuError::Device("the read-back was dropped".into()))?;
        if let Some(e) = self.error.lock().expect("gpu error slot").take() {
            return Err(GpuError::Device(e));
        }
        mapped.map_err(|e| GpuError::Device(format!("read-back: {e}")))?;
        let data = slice
            .get_mapped_range()
            .map_err(|e| GpuError::Device(format!("read-back: {e}")))?;
        let mut outs = Vec::with_capacity(pieces.len());
        let mut o = 0usize;
        for &(i, _, n) in pieces {
            let len = n * jobs[i].expert.words.down.rows * 4;
            outs.push(
                data[o..o + len]
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            );
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
            let bytes: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.queue.write_buffer(&arena, a.x as u64 * 4, &bytes);
            let quant = |cols: usize, m: &MatrixWords, src: u32, dst: [u32; 3]| KernelParams {
                rows: 0,
                cols: cols as u32,
                group: m.group as u32,
                int4: m.int4 as u32,
                n: n as u32,
                nb: nibble_block(m.group) as u32,
                in0: src,
                out0: dst[0],
                out1: dst[1],
                out2: dst[2],
                tok: ALL_ROWS,
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
                tok: ALL_ROWS,
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
                    tok: ALL_ROWS,
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
        let each = || pieces.iter().zip(&arenas).enumerate();
        for (k, (&(i, _, n), a)) in (0..reps).flat_map(|_| each()) {
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
            let _ = a;
        }
        Ok(Recorded { enc, arena, arenas })
    }
}

/// Whether two results are the same float: the same bits, or both NaN (CPUs disagree among
/// themselves on a NaN's sign and payload: x86 makes `0xffc00000` where ARM makes `0x7fc00000`,
/// and the soft-float steps make the latter).
pub fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

/// `slot`'s buffer, replaced by a larger one when it holds fewer than `bytes`.
fn grown(
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

/// The self-check's experts and inputs: int4 in groups of 64 and int8 in groups of 32 (both
/// nibble blocks and both code widths), rows of typical values, a zero row, tiny and huge
/// values, so the soft-float steps meet subnormal products and large exponents.
pub mod selfcheck {
    use charm_shared::kernels::Matrix;
    use charm_shared::linear::{Linear, SwiGlu};
    use charm_shared::quant::{Activations, QMatrix, QuantKind};

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
}
