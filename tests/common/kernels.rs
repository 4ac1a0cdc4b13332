//! Kernels for the GPU tests, written in PTX so that no compiler is needed at run time
//! (`tests/gpu_device.rs`, `tests/gpu_ipc_peer.rs` include this file).
#![allow(dead_code)]

use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaStream};

/// Two kernels, written in PTX so that no compiler is needed at run time: `spin` runs for
/// `ns` nanoseconds of the GPU's global timer; `copy_bytes` copies `n` bytes, one thread a
/// byte.
pub(crate) const KERNELS: &str = r#"
.version 7.0
.target sm_70
.address_size 64

.visible .entry spin(.param .u64 ns)
{
    .reg .pred %p;
    .reg .u64 %t<4>;
    ld.param.u64 %t0, [ns];
    mov.u64 %t1, %globaltimer;
LOOP:
    mov.u64 %t2, %globaltimer;
    sub.u64 %t3, %t2, %t1;
    setp.lt.u64 %p, %t3, %t0;
    @%p bra LOOP;
    ret;
}

.visible .entry copy_bytes(.param .u64 dst, .param .u64 src, .param .u64 n)
{
    .reg .pred %p;
    .reg .u32 %r<4>;
    .reg .u64 %rd<8>;
    .reg .u16 %rs<2>;
    ld.param.u64 %rd1, [dst];
    ld.param.u64 %rd2, [src];
    ld.param.u64 %rd3, [n];
    mov.u32 %r1, %ctaid.x;
    mov.u32 %r2, %ntid.x;
    mov.u32 %r3, %tid.x;
    mul.wide.u32 %rd4, %r1, %r2;
    cvt.u64.u32 %rd5, %r3;
    add.u64 %rd4, %rd4, %rd5;
    setp.ge.u64 %p, %rd4, %rd3;
    @%p bra DONE;
    cvta.to.global.u64 %rd6, %rd2;
    add.u64 %rd6, %rd6, %rd4;
    ld.global.u8 %rs1, [%rd6];
    cvta.to.global.u64 %rd7, %rd1;
    add.u64 %rd7, %rd7, %rd4;
    st.global.u8 [%rd7], %rs1;
DONE:
    ret;
}
"#;

/// The two kernels, loaded into the stream's context.
pub(crate) struct Kernels {
    spin: sys::CUfunction,
    copy: sys::CUfunction,
}

impl Kernels {
    pub(crate) fn load(stream: &Arc<CudaStream>) -> Self {
        stream.context().bind_to_thread().unwrap();
        let ptx = CString::new(KERNELS).unwrap();
        // SAFETY: `ptx` is a NUL-terminated PTX text; the module stays loaded for the
        // process (tests are short).
        unsafe {
            let module = result::module::load_data(ptx.as_ptr() as *const c_void).unwrap();
            Self {
                spin: result::module::get_function(module, CString::new("spin").unwrap()).unwrap(),
                copy: result::module::get_function(module, CString::new("copy_bytes").unwrap())
                    .unwrap(),
            }
        }
    }

    /// Keeps `stream` busy for `ms` milliseconds of GPU time.
    pub(crate) fn spin(&self, stream: &Arc<CudaStream>, ms: u64) {
        let mut ns = ms * 1_000_000;
        let mut params = [&mut ns as *mut u64 as *mut c_void];
        stream.context().bind_to_thread().unwrap();
        // SAFETY: `spin` takes one u64 parameter; the stream is alive.
        unsafe {
            result::launch_kernel(
                self.spin,
                (1, 1, 1),
                (1, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }
        .unwrap();
    }

    /// Copies `n` bytes from `src` to `dst` (device addresses) with a kernel on `stream`.
    pub(crate) fn copy(&self, stream: &Arc<CudaStream>, mut dst: u64, mut src: u64, mut n: u64) {
        let mut params = [
            &mut dst as *mut u64 as *mut c_void,
            &mut src as *mut u64 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
        ];
        let blocks = n.div_ceil(256) as u32;
        stream.context().bind_to_thread().unwrap();
        // SAFETY: `copy_bytes` takes three u64 parameters; the caller passes `n` bytes of
        // live device memory at each address.
        unsafe {
            result::launch_kernel(
                self.copy,
                (blocks, 1, 1),
                (256, 1, 1),
                0,
                stream.cu_stream(),
                &mut params,
            )
        }
        .unwrap();
    }
}
