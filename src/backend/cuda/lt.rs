//! A GEMM with a bias, the bias added in cuBLASLt's epilogue
//! (`CUBLASLT_EPILOGUE_BIAS`): d = op(a) op(b) + beta c + bias in one pass
//! over d, where the bias pass before it read and wrote d once more (llm.c's
//! `matmul_cublaslt`). c is d, or another matrix of its layout (a residual
//! the products go onto, where a copy into d took a pass). Each shape's plan (descriptor, layouts, the
//! heuristic's algorithm) is made once and kept; one workspace serves all.
//! `DISTGPT_CUBLASLT=0` leaves the bias to the pass (`Runtime::adds_bias`).
//! c and the bias are fp32, or both bf16 (a bf16 output's epilogue takes
//! its bias in bf16: the runtime rounds it first). A GEMM whose plan has
//! no algorithm takes the bias pass too ([`Lt::takes`]).

use super::{GpuError, Mem, Result};
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    cublasComputeType_t, cublasLtEpilogue_t, cublasLtHandle_t, cublasLtMatmulAlgo_t,
    cublasLtMatmulDescAttributes_t as Desc, cublasLtMatmulDesc_t,
    cublasLtMatmulPreferenceAttributes_t as Pref, cublasLtMatmulPreference_t,
    cublasLtMatrixLayout_t, cudaDataType, cudaStream_t,
};
use std::collections::HashMap;
use std::ffi::c_void;

/// Workspace bytes: what cuBLASLt asks for on Hopper (llm.c, PyTorch).
pub(super) const WORKSPACE_BYTES: usize = 32 << 20;

/// Whether GEMMs with a bias go to cuBLASLt: yes unless `DISTGPT_CUBLASLT=0`.
pub(super) fn wanted() -> Result<bool> {
    super::switch(
        "DISTGPT_CUBLASLT",
        ["1", "0"],
        "1 (the default) adds a GEMM's bias in cuBLASLt's epilogue, 0 in a pass before the GEMM",
    )
}

/// Everything a plan depends on: a GEMM without its addresses, but with
/// how far they are aligned (the heuristic picks only kernels that can
/// take them).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub(super) struct PlanKey {
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub transpose: [bool; 2],
    /// Leading dimensions of a, b and c.
    pub ld: [i64; 3],
    /// a and b stored in bf16 (else fp32).
    pub bf16: bool,
    /// c and the bias stored in bf16 (else fp32; the bias takes c's type).
    pub c_bf16: bool,
    /// Bytes a, b, c and d are aligned to, at most 256.
    pub align: [u32; 4],
}

/// The alignment cuBLASLt's preferences take for `addr`: its largest power
/// of two, at most 256.
pub(super) fn alignment(addr: u64) -> u32 {
    1 << addr.trailing_zeros().min(8)
}

impl PlanKey {
    /// (rows, cols, ld) of the stored a, b and c, column-major: op(a) is
    /// m x k, op(b) k x n, c m x n; a transposed operand is stored the other
    /// way round.
    pub(super) fn layouts(&self) -> [(u64, u64, i64); 3] {
        let stored = |rows, cols, t: bool| if t { (cols, rows) } else { (rows, cols) };
        let (ar, ac) = stored(self.m, self.k, self.transpose[0]);
        let (br, bc) = stored(self.k, self.n, self.transpose[1]);
        [
            (ar, ac, self.ld[0]),
            (br, bc, self.ld[1]),
            (self.m, self.n, self.ld[2]),
        ]
    }
}

/// One shape's descriptor, layouts (a, b, c; d is c) and algorithm.
struct Plan {
    desc: cublasLtMatmulDesc_t,
    layouts: [cublasLtMatrixLayout_t; 3],
    algo: Option<cublasLtMatmulAlgo_t>,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each handle was created once here (null where creation
        // failed first) and is destroyed once.
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

/// A failed cuBLASLt call, in words, for `map_err`.
fn failed(what: &'static str, key: PlanKey) -> impl Fn(lt::CublasError) -> GpuError {
    move |e| {
        GpuError(format!(
            "{what} failed for the GEMM {key:?}: {e} (DISTGPT_CUBLASLT=0 adds its bias in a pass \
             before the GEMM instead)"
        ))
    }
}

/// # Safety
/// `desc` is a live descriptor; `T` is the attribute's documented type.
unsafe fn set<T>(
    desc: cublasLtMatmulDesc_t,
    attr: Desc,
    value: &T,
) -> std::result::Result<(), lt::CublasError> {
    let (ptr, size) = ((value as *const T).cast::<c_void>(), size_of::<T>());
    // SAFETY: `value` lives across the call, which copies it.
    unsafe { lt::set_matmul_desc_attribute(desc, attr, ptr, size) }
}

impl Plan {
    /// The plan of `key`, the algorithm the heuristic ranks first.
    fn new(handle: cublasLtHandle_t, key: PlanKey) -> Result<Plan> {
        let mut plan = Plan::described(key)?;
        let pref = preference(key)?;
        let [la, lb, lc] = plan.layouts;
        // SAFETY: live handles; the preference is destroyed once, after.
        let found = unsafe {
            let found = lt::get_matmul_algo_heuristic(handle, plan.desc, la, lb, lc, lc, pref);
            let _ = lt::destroy_matmul_pref(pref);
            found
        };
        let found = found.map_err(failed("cublasLtMatmulAlgoGetHeuristic", key))?;
        plan.algo = Some(found.algo);
        Ok(plan)
    }

    /// `key`'s descriptor and layouts, without an algorithm.
    fn described(key: PlanKey) -> Result<Plan> {
        let ty = |bf16| match bf16 {
            true => cudaDataType::CUDA_R_16BF,
            false => cudaDataType::CUDA_R_32F,
        };
        let mut plan = Plan {
            desc: lt::create_matmul_desc(
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cudaDataType::CUDA_R_32F,
            )
            .map_err(failed("cublasLtMatmulDescCreate", key))?,
            layouts: [std::ptr::null_mut(); 3],
            algo: None,
        };
        // cublasOperation_t's values, as the int32 the attributes take
        let [ta, tb] = key.transpose.map(i32::from);
        let epilogue = cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as u32;
        // SAFETY: a live descriptor; each value has its attribute's type.
        unsafe {
            set(plan.desc, Desc::CUBLASLT_MATMUL_DESC_TRANSA, &ta)
                .and_then(|()| set(plan.desc, Desc::CUBLASLT_MATMUL_DESC_TRANSB, &tb))
                .and_then(|()| set(plan.desc, Desc::CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue))
        }
        .map_err(failed("cublasLtMatmulDescSetAttribute", key))?;
        let types = [ty(key.bf16), ty(key.bf16), ty(key.c_bf16)];
        for (i, (rows, cols, ld)) in key.layouts().into_iter().enumerate() {
            plan.layouts[i] = lt::create_matrix_layout(types[i], rows, cols, ld)
                .map_err(failed("cublasLtMatrixLayoutCreate", key))?;
        }
        Ok(plan)
    }
}

/// The heuristic's preferences for `key`: at most the workspace, and the
/// operands' alignments. The caller destroys it.
fn preference(key: PlanKey) -> Result<cublasLtMatmulPreference_t> {
    let pref = lt::create_matmul_pref().map_err(failed("cublasLtMatmulPreferenceCreate", key))?;
    let workspace = WORKSPACE_BYTES as u64;
    let set_pref = |attr, ptr: *const c_void, size| {
        // SAFETY: a live preference; `ptr` holds `size` bytes of the
        // attribute's type, copied by the call.
        unsafe { lt::set_matmul_pref_attribute(pref, attr, ptr, size) }
    };
    let mut r = set_pref(
        Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        (&workspace as *const u64).cast(),
        size_of::<u64>(),
    );
    let aligned = [
        Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
    ];
    for (attr, b) in aligned.into_iter().zip(&key.align) {
        r = r.and_then(|()| set_pref(attr, (b as *const u32).cast(), size_of::<u32>()));
    }
    match r {
        Ok(()) => Ok(pref),
        Err(e) => {
            // SAFETY: created above, destroyed once.
            let _ = unsafe { lt::destroy_matmul_pref(pref) };
            Err(failed("cublasLtMatmulPreferenceSetAttribute", key)(e))
        }
    }
}

/// The cuBLASLt handle, the plans made so far (or why one could not be
/// made: no algorithm for its types and alignments) and the workspace.
pub(super) struct Lt {
    handle: cublasLtHandle_t,
    plans: HashMap<PlanKey, Result<Plan>>,
    pub workspace: Option<Mem<u32>>,
}

// SAFETY: the handle and the plans are only used under the runtime's mutex.
unsafe impl Send for Lt {}

impl Drop for Lt {
    fn drop(&mut self) {
        self.plans.clear();
        // SAFETY: created by `create_handle`, destroyed once, after its plans.
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// A GEMM's device addresses: a, b, c (what the products go onto), d
/// (where they are stored; c's layout) and the bias.
pub(super) struct Addresses {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    pub d: u64,
    pub bias: u64,
}

impl Lt {
    pub(super) fn new() -> Result<Lt> {
        let handle =
            lt::create_handle().map_err(|e| GpuError(format!("cublasLtCreate failed: {e}")))?;
        Ok(Lt {
            handle,
            plans: HashMap::new(),
            workspace: None,
        })
    }

    /// `key`'s plan, made the first time it is asked for and kept, as is
    /// why it could not be made.
    fn plan(&mut self, key: PlanKey) -> std::result::Result<&Plan, &GpuError> {
        let handle = self.handle;
        self.plans
            .entry(key)
            .or_insert_with(|| Plan::new(handle, key))
            .as_ref()
    }

    /// Whether `key`'s GEMMs take cuBLASLt's epilogue: where its plan
    /// cannot be made they take the bias pass, said on stderr the first
    /// time.
    pub(super) fn takes(&mut self, key: PlanKey) -> bool {
        let first = !self.plans.contains_key(&key);
        match self.plan(key) {
            Ok(_) => true,
            Err(e) => {
                if first {
                    eprintln!("distgpt: its bias goes in a pass before the GEMM: {e}");
                }
                false
            }
        }
    }

    /// Queues d = a b + beta c + bias on `stream` per `key`.
    ///
    /// # Safety
    /// The addresses hold the matrices `key` describes (and the bias m
    /// floats), aligned as it says; the workspace is allocated and holds
    /// [`WORKSPACE_BYTES`].
    pub(super) unsafe fn matmul(
        &mut self,
        key: PlanKey,
        at: Addresses,
        beta: f32,
        stream: cudaStream_t,
    ) -> Result<()> {
        let (handle, workspace) = (self.handle, self.workspace.as_ref().map_or(0, |w| w.ptr));
        let plan = self.plan(key).map_err(Clone::clone)?;
        let (alpha, [la, lb, lc]) = (1.0f32, plan.layouts);
        let algo = plan
            .algo
            .as_ref()
            .map_or(std::ptr::null(), |a| a as *const _);
        // SAFETY: the caller's promises; the bias pointer attribute is
        // copied by the call, and read when the GEMM is queued, below,
        // under the same `&mut self`.
        unsafe {
            set(plan.desc, Desc::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &at.bias)
                .map_err(failed("cublasLtMatmulDescSetAttribute", key))?;
            lt::matmul(
                handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                at.a as *const c_void,
                la,
                at.b as *const c_void,
                lb,
                at.c as *const c_void,
                lc,
                at.d as *mut c_void,
                lc,
                algo,
                workspace as *mut c_void,
                WORKSPACE_BYTES,
                stream,
            )
        }
        .map_err(failed("cublasLtMatmul", key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_stores_each_operand_as_its_transpose_says() {
        let key = |transpose, ld| PlanKey {
            m: 2304,
            n: 8192,
            k: 768,
            transpose,
            ld,
            bf16: true,
            c_bf16: false,
            align: [256; 4],
        };
        // op(a) is m x k and op(b) k x n: transposed, a is stored k x m
        // and b n x k
        assert_eq!(
            key([true, false], [768, 768, 2304]).layouts(),
            [(768, 2304, 768), (768, 8192, 768), (2304, 8192, 2304)]
        );
        assert_eq!(
            key([false, true], [2304, 8192, 2304]).layouts(),
            [(2304, 768, 2304), (8192, 768, 8192), (2304, 8192, 2304)]
        );
    }

    #[test]
    fn alignment_is_the_largest_power_of_two_to_256() {
        assert_eq!(alignment(0x7f00_0000_0100), 256);
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0010), 16);
        assert_eq!(alignment(0x7f00_0000_0006), 2);
    }
}
