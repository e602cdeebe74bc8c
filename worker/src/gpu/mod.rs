//! The GPU backend: a wgpu device (Vulkan on Linux and Windows, Metal on macOS) running the
//! expert kernels of [`charm_shared::quant::gpu`], and the VRAM tier built on it ([`tier`]).
//!
//! Exactness: the kernels do every float step in integer arithmetic (see `expert.wgsl`), so an
//! expert computed here has the bits the CPU's int8-activation path gives. Each device is checked
//! when it opens ([`Gpu::open`]): a fixed expert on fixed inputs, compared bit for bit with the
//! CPU (every NaN counts as every other: see [`same_bits`]); a device that differs is refused, naming the adapter, its driver and the first output
//! that differs. Nothing accepts other bits.
//!
//! The rooms: this file opens a device (and reports every adapter for `charm doctor`); `submit`
//! lays out, records and runs a submission of expert work and reads it back; [`selfcheck`] is
//! what a device must reproduce before it is used.

pub mod memory;
pub mod program;
pub mod selfcheck;
mod submit;
pub mod tier;

use std::sync::Mutex;

use charm_shared::quant::gpu::{perturbed_shader, MatrixWords, EXPERT_SHADER, PARAMS_BYTES};

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
    /// The dense kernels gave other bits than the CPU on the model's own check.
    #[error("GPU {adapter} ({driver}) refused: its dense kernels differ from the CPU at logit {index} of the check ({gpu:?} against the CPU's {cpu:?})")]
    DenseCheck {
        adapter: String,
        driver: String,
        index: usize,
        gpu: f32,
        cpu: f32,
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
            let verdict = match Gpu::from_adapter(a.clone(), Matvec::from_env()) {
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

/// Which kernel multiplies a quantized matrix by int8 activations; both give the same bits.
/// A GPU takes `Tiled`, a CPU device (lavapipe) `Lanes`, unless `CHARM_GPU_MATVEC` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Matvec {
    /// `matvec_tiled`: a workgroup copies 64 rows' weights into workgroup memory a tile at a
    /// time, consecutive lanes reading consecutive words, and each lane computes its row from
    /// there. Where each lane reads its own row instead, a warp's load touches as many cache
    /// lines as it has lanes (on NVIDIA, 32 L1 wavefronts for 128 useful bytes).
    Tiled,
    /// `matvec`: each lane reads and computes its own row. On lavapipe, which runs a
    /// workgroup's lanes as loops on the CPU, several times faster than `Tiled` (docs/gpu.md).
    Lanes,
}

impl Matvec {
    /// The kernel's entry point in `expert.wgsl`.
    pub fn entry(self) -> &'static str {
        match self {
            Self::Tiled => "matvec_tiled",
            Self::Lanes => "matvec",
        }
    }

    /// `CHARM_GPU_MATVEC=lanes` or `tiled` (for benchmarks comparing them), else `None`.
    pub fn from_env() -> Option<Self> {
        match std::env::var("CHARM_GPU_MATVEC").as_deref() {
            Ok("lanes") => Some(Self::Lanes),
            Ok("tiled") => Some(Self::Tiled),
            _ => None,
        }
    }

    /// The kernel for a device of type `t`: `Lanes` on a CPU device, else `Tiled`.
    fn for_device(t: wgpu::DeviceType) -> Self {
        match t {
            wgpu::DeviceType::Cpu => Self::Lanes,
            _ => Self::Tiled,
        }
    }
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
    /// The matrix kernel of the int8-activation path, experts' and dense weights' alike.
    pub matvec_kernel: Matvec,
    /// Free device memory when it opened, bytes, where the driver says ([`memory`]).
    pub free_bytes: Option<u64>,
    /// Whether the device has memory of its own (a discrete GPU); an integrated GPU, Apple's
    /// unified memory or a CPU device (lavapipe) keeps its buffers in the host's RAM.
    pub dedicated_memory: bool,
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

/// [`ExpertWords`](charm_shared::quant::gpu::ExpertWords) without its bytes (they are on the
/// device).
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

/// Whether to build the kernels as shipped or with the deliberately wrong combine (tests of the
/// self-check only: `CHARM_GPU_TEST_PERTURB=1`).
fn shader_source() -> std::borrow::Cow<'static, str> {
    if std::env::var("CHARM_GPU_TEST_PERTURB").as_deref() == Ok("1") {
        perturbed_shader().into()
    } else {
        EXPERT_SHADER.into()
    }
}

impl Gpu {
    /// Opens adapter `id` (`None`: the first that opens and passes its self-check, discrete
    /// GPUs first), builds the kernels and checks them against the CPU.
    pub fn open(id: Option<usize>) -> Result<Self, GpuError> {
        Self::open_with(id, Matvec::from_env())
    }

    /// [`Self::open`] with the matrix kernel `matvec` (`None`: the device type's, [`Matvec`]).
    pub fn open_with(id: Option<usize>, matvec: Option<Matvec>) -> Result<Self, GpuError> {
        let all = adapters();
        if let Some(id) = id {
            let count = all.len();
            let a = all
                .into_iter()
                .nth(id)
                .ok_or(GpuError::NoSuchAdapter { id, count })?;
            return Self::from_adapter(a, matvec);
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
            match Self::from_adapter(a, matvec) {
                Ok(g) => return Ok(g),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        Err(first_err.unwrap_or(GpuError::NoAdapter))
    }

    /// Opens `a`, builds the kernels and runs the self-check.
    fn from_adapter(a: wgpu::Adapter, matvec: Option<Matvec>) -> Result<Self, GpuError> {
        let info = a.get_info();
        let matvec_kernel = matvec.unwrap_or(Matvec::for_device(info.device_type));
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
        let (layout, pipeline_layout) =
            kernel_layouts(&device, "charm experts", PARAMS_BYTES as u64, false);
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
        let (quantize, matvec, swiglu) = (
            pipeline("quantize"),
            pipeline(matvec_kernel.entry()),
            pipeline("swiglu"),
        );
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
            matvec_kernel,
            free_bytes: memory::free_bytes(&a),
            dedicated_memory: info.device_type == wgpu::DeviceType::DiscreteGpu,
            scratch: Mutex::new(Scratch::default()),
            error,
        };
        gpu.self_check()?;
        Ok(gpu)
    }
}

/// The bindings every kernel takes, and a pipeline layout of them: 0 a weight (read-only), 1 the
/// arena, 2 a parameter block of `params` bytes at a dynamic offset, and with `kv` 3 a KV cache.
pub(super) fn kernel_layouts(
    device: &wgpu::Device,
    label: &str,
    params: u64,
    kv: bool,
) -> (wgpu::BindGroupLayout, wgpu::PipelineLayout) {
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
    let mut entries = vec![
        storage(0, true),
        storage(1, false),
        wgpu::BindGroupLayoutEntry {
            binding: 2,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: wgpu::BindingType::Buffer {
                ty: wgpu::BufferBindingType::Uniform,
                has_dynamic_offset: true,
                min_binding_size: wgpu::BufferSize::new(params),
            },
            count: None,
        },
    ];
    if kv {
        entries.push(storage(3, false));
    }
    let layout = device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: Some(label),
        entries: &entries,
    });
    let pipeline = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(label),
        bind_group_layouts: &[Some(&layout)],
        immediate_size: 0,
    });
    (layout, pipeline)
}

/// Whether two results are the same float: the same bits, or both NaN (CPUs disagree among
/// themselves on a NaN's sign and payload: x86 makes `0xffc00000` where ARM makes `0x7fc00000`,
/// and the soft-float steps make the latter).
pub fn same_bits(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}
