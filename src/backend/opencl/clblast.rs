//! CLBlast's SGEMM and strided-batched SGEMM, opened at run time
//! (libclblast.so.1), called in the column-major convention so the same
//! call maps onto cuBLAS.

use crate::backend::gpu::{Gemm, GpuError, Operand};
use libloading::Library;
use opencl3::types::{cl_command_queue, cl_event, cl_mem};
use std::ffi::c_int;

const LAYOUT_COL_MAJOR: c_int = 102;
const TRANSPOSE_NO: c_int = 111;
const TRANSPOSE_YES: c_int = 112;

type SgemmFn = unsafe extern "C" fn(
    layout: c_int,
    a_transpose: c_int,
    b_transpose: c_int,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: cl_mem,
    a_offset: usize,
    a_ld: usize,
    b: cl_mem,
    b_offset: usize,
    b_ld: usize,
    beta: f32,
    c: cl_mem,
    c_offset: usize,
    c_ld: usize,
    queue: *mut cl_command_queue,
    event: *mut cl_event,
) -> c_int;

/// `SgemmFn` with a stride after each matrix's leading dimension and the
/// batch count before the queue.
type SgemmStridedBatchedFn = unsafe extern "C" fn(
    layout: c_int,
    a_transpose: c_int,
    b_transpose: c_int,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: cl_mem,
    a_offset: usize,
    a_ld: usize,
    a_stride: usize,
    b: cl_mem,
    b_offset: usize,
    b_ld: usize,
    b_stride: usize,
    beta: f32,
    c: cl_mem,
    c_offset: usize,
    c_ld: usize,
    c_stride: usize,
    batch_count: usize,
    queue: *mut cl_command_queue,
    event: *mut cl_event,
) -> c_int;

/// The loaded library and its SGEMM entry points.
pub struct Clblast {
    sgemm: SgemmFn,
    batched: SgemmStridedBatchedFn,
    // Keeps the entry points valid; dropped last.
    _lib: Library,
}

impl Clblast {
    pub fn load() -> Result<Clblast, GpuError> {
        let mut last = String::new();
        for name in ["libclblast.so.1", "libclblast.so"] {
            // SAFETY: CLBlast's initialisers only set up its caches.
            match unsafe { Library::new(name) } {
                Ok(lib) => {
                    let missing = |e| GpuError(format!("{name} lacks an SGEMM entry point: {e}"));
                    // SAFETY: the symbols have the C signatures `SgemmFn` and
                    // `SgemmStridedBatchedFn` (clblast_c.h, CLBlast 1.5).
                    let (sgemm, batched) = unsafe {
                        let sgemm = lib.get::<SgemmFn>(b"CLBlastSgemm\0").map_err(missing)?;
                        let batched = lib
                            .get::<SgemmStridedBatchedFn>(b"CLBlastSgemmStridedBatched\0")
                            .map_err(missing)?;
                        (*sgemm, *batched)
                    };
                    return Ok(Clblast {
                        sgemm,
                        batched,
                        _lib: lib,
                    });
                }
                Err(e) => last = e.to_string(),
            }
        }
        Err(GpuError(format!(
            "CLBlast not found ({last}): install libclblast1"
        )))
    }

    /// Enqueues `g` on `queue`; operands must be valid for the sizes given
    /// ([`within_int_indices`]).
    pub fn sgemm(&self, queue: cl_command_queue, g: Gemm) -> Result<(), GpuError> {
        within_int_indices(&g)?;
        let t = |op: Operand| {
            if op.transpose {
                TRANSPOSE_YES
            } else {
                TRANSPOSE_NO
            }
        };
        let mut queue = queue;
        let (a, b, c) = (g.a.view.mem, g.b.view.mem, g.c.mem);
        let (a, b, c) = (a as cl_mem, b as cl_mem, c as cl_mem);
        // SAFETY: the buffers are live cl_mem handles of the queue's context;
        // the caller checked that every view holds the matrices it stands for.
        let status = unsafe {
            match g.batch.count {
                1 => (self.sgemm)(
                    LAYOUT_COL_MAJOR,
                    t(g.a),
                    t(g.b),
                    g.m,
                    g.n,
                    g.k,
                    1.0,
                    a,
                    g.a.view.off,
                    g.a.ld,
                    b,
                    g.b.view.off,
                    g.b.ld,
                    g.beta,
                    c,
                    g.c.off,
                    g.ldc,
                    &mut queue,
                    std::ptr::null_mut(),
                ),
                count => (self.batched)(
                    LAYOUT_COL_MAJOR,
                    t(g.a),
                    t(g.b),
                    g.m,
                    g.n,
                    g.k,
                    1.0,
                    a,
                    g.a.view.off,
                    g.a.ld,
                    g.batch.a,
                    b,
                    g.b.view.off,
                    g.b.ld,
                    g.batch.b,
                    g.beta,
                    c,
                    g.c.off,
                    g.ldc,
                    g.batch.c,
                    count,
                    &mut queue,
                    std::ptr::null_mut(),
                ),
            }
        };
        if status != 0 {
            return Err(GpuError(format!(
                "CLBlastSgemm (m={}, n={}, k={}, batch {}) failed with status {status}",
                g.m, g.n, g.k, g.batch.count
            )));
        }
        Ok(())
    }
}

/// Refuses `g` where an operand reaches past element 2^31 - 1 of its
/// buffer: CLBlast takes offsets and leading dimensions, and indexes, in
/// 32-bit ints, and wraps past them (a read of other memory, a write
/// before the buffer).
fn within_int_indices(g: &Gemm) -> Result<(), GpuError> {
    let [a_span, b_span] = g.spans()?;
    // the last element each reads or writes (a span counts from 0)
    let last = [
        ("a", g.a.view.off + a_span - 1),
        ("b", g.b.view.off + b_span - 1),
        ("c", g.c.off + g.c_span() - 1),
    ];
    match last.iter().find(|(_, at)| *at > i32::MAX as usize) {
        None => Ok(()),
        Some((what, at)) => Err(GpuError(format!(
            "CLBlastSgemm (m={}, n={}, k={}, batch {}): its {what} reaches element {at} of \
             its buffer, past CLBlast's 32-bit indices (2^31 - 1): a smaller batch or \
             model, --recompute, or --device cuda",
            g.m, g.n, g.k, g.batch.count
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::gpu::View;

    /// A GEMM that reaches past element 2^31 - 1 of a buffer is refused
    /// before CLBlast sees it (its int offsets and indices would wrap
    /// negative: a read of other memory, a write before the buffer).
    #[test]
    fn a_gemm_past_clblasts_int_indices_is_refused_naming_the_operand() {
        let view = |off| View {
            mem: 0,
            off,
            len: 1 << 40,
        };
        let operand = |off| Operand {
            view: view(off),
            transpose: false,
            ld: 64,
            bf16: false,
        };
        let gemm = |a, c| Gemm::new([64; 3], [operand(a), operand(0)], view(c), 64, false);
        let top = i32::MAX as usize;
        // a's 4,096 elements from 2^31 - 4,094 on, the last at 2^31; then
        // c's; a's last at 2^31 - 1 is CLBlast's to take
        let e = within_int_indices(&gemm(top - 64 * 64 + 2, 0)).unwrap_err();
        assert!(
            e.0.contains("its a reaches element 2147483648 of its buffer"),
            "{e}"
        );
        let e = within_int_indices(&gemm(0, 1 << 31)).unwrap_err();
        assert!(e.0.contains("its c reaches element"), "{e}");
        assert!(within_int_indices(&gemm(top - 64 * 64 + 1, 0)).is_ok());
    }
}
