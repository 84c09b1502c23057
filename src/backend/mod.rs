//! Compute backends: where a tensor's numbers live and where local math runs.
//!
//! A tensor holds a [`Storage`]; every op matches on it and runs the kernel of that backend. The CPU
//! backend ([`cpu`]) is the reference every other backend is tested against. A GPU backend adds a
//! variant here (its buffers stay on the device; bytes are read back only at the transport boundary or
//! when the user asks), and the compiler then points at every op that must learn about it.

pub mod cpu;
#[cfg(feature = "wgpu")]
pub mod gpu;

#[cfg(target_endian = "big")]
compile_error!(
    "distgrad stores tensors as little-endian f32 and supports little-endian targets only"
);

/// The backend a tensor lives on.
#[derive(Debug, Clone, PartialEq)]
pub enum Device {
    /// Host memory, plain Rust loops. The reference backend.
    Cpu,
    /// A wgpu device running the WGSL kernels of `shaders/`.
    #[cfg(feature = "wgpu")]
    Gpu(gpu::Gpu),
}

impl Device {
    /// Short name used in messages and tables.
    pub fn name(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            #[cfg(feature = "wgpu")]
            Device::Gpu(_) => "wgpu",
        }
    }

    /// One line saying which backend this is (adapter name, backend, device type for a GPU).
    pub fn describe(&self) -> String {
        match self {
            Device::Cpu => "cpu".to_string(),
            #[cfg(feature = "wgpu")]
            Device::Gpu(g) => format!("wgpu: {}", g.describe()),
        }
    }
}

/// Which backend to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Choice {
    /// A GPU when an adapter exists, else the CPU.
    #[default]
    Auto,
    /// The CPU backend.
    Cpu,
    /// A GPU; an error if there is none.
    Gpu,
}

/// Pick the compute backend and say which in one log line on stderr (adapter name, backend and
/// device type, or why there is no GPU).
pub async fn select(choice: Choice) -> crate::error::Result<Device> {
    let device = match choice {
        Choice::Cpu => Device::Cpu,
        #[cfg(feature = "wgpu")]
        Choice::Gpu => Device::Gpu(gpu::Gpu::new().await?),
        #[cfg(feature = "wgpu")]
        Choice::Auto => match gpu::Gpu::new().await {
            Ok(g) => Device::Gpu(g),
            Err(e) => {
                eprintln!("distgrad: compute backend: cpu ({e})");
                return Ok(Device::Cpu);
            }
        },
        #[cfg(not(feature = "wgpu"))]
        Choice::Gpu => {
            return Err(crate::error::Error::Gpu {
                op: "select",
                detail: "this build has no GPU backend (feature `wgpu`)".into(),
            });
        }
        #[cfg(not(feature = "wgpu"))]
        Choice::Auto => Device::Cpu,
    };
    eprintln!("distgrad: compute backend: {}", device.describe());
    Ok(device)
}

/// The numbers of one tensor, contiguous and row-major, on one backend. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub enum Storage {
    /// Host memory: little-endian f32, 4-byte aligned, shared by reference count. Clones,
    /// reshapes, sends to in-process peers and tensors received from them all share it.
    Cpu(bytes::Bytes),
    /// A buffer on a GPU (shared too; read back only at the transport boundary or on request).
    #[cfg(feature = "wgpu")]
    Gpu(gpu::GpuBuf),
}

impl Storage {
    /// The device this storage lives on.
    pub fn device(&self) -> Device {
        match self {
            Storage::Cpu(_) => Device::Cpu,
            #[cfg(feature = "wgpu")]
            Storage::Gpu(b) => Device::Gpu(b.gpu().clone()),
        }
    }
}

/// Elementwise binary operations (with NumPy broadcasting at the tensor level).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BinaryOp {
    /// `a + b`
    Add,
    /// `a - b`
    Sub,
    /// `a * b`
    Mul,
    /// `a / b`
    Div,
    /// `max(a, b)` (NaN-propagating)
    Max,
    /// `min(a, b)` (NaN-propagating)
    Min,
    /// `1.0` where `a == b`, else `0.0`
    Eq,
}

impl BinaryOp {
    /// Every binary op.
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Eq,
    ];

    /// Apply to one pair of numbers. Every backend must agree with this bit for bit.
    #[inline(always)]
    pub fn apply(self, a: f32, b: f32) -> f32 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            // f32::max ignores NaN; a reduction must not silently drop one.
            BinaryOp::Max => {
                if a.is_nan() || b.is_nan() {
                    f32::NAN
                } else if a >= b {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Min => {
                if a.is_nan() || b.is_nan() {
                    f32::NAN
                } else if a <= b {
                    a
                } else {
                    b
                }
            }
            BinaryOp::Eq => {
                if a == b {
                    1.0
                } else {
                    0.0
                }
            }
        }
    }
}

/// Elementwise unary operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum UnaryOp {
    /// `-x`
    Neg,
    /// `c * x`
    Scale(f32),
    /// `max(x, 0)`
    Relu,
    /// `1.0` where `x > 0`, else `0.0` (relu's derivative)
    Step,
    /// `tanh(x)`
    Tanh,
    /// `x * x`
    Square,
}

impl UnaryOp {
    /// Every unary op (the scale with a factor of 1).
    pub const ALL: [UnaryOp; 6] = [
        UnaryOp::Neg,
        UnaryOp::Scale(1.0),
        UnaryOp::Relu,
        UnaryOp::Step,
        UnaryOp::Tanh,
        UnaryOp::Square,
    ];

    /// Apply to one number. Every backend must agree with this bit for bit (tanh within 1 ulp).
    #[inline(always)]
    pub fn apply(self, x: f32) -> f32 {
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Scale(c) => c * x,
            UnaryOp::Relu => {
                if x > 0.0 {
                    x
                } else {
                    0.0
                }
            }
            UnaryOp::Step => {
                if x > 0.0 {
                    1.0
                } else {
                    0.0
                }
            }
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Square => x * x,
        }
    }
}
