//! The matmul libraries the CPU backend can run its products on, and which
//! one runs each: the `gemm` crate (built in), and OpenBLAS, BLIS and MKL
//! where the machine has them, opened at run time (a build never needs
//! them; `libopenblas0`, `libblis4`, PyPI's `mkl` through LD_LIBRARY_PATH).
//!
//! A library runs single-threaded inside rayon tasks, in the pool of the
//! rank that calls it (each thread rank installs its own, with its share
//! of the cores): no library's threads fighting rayon's for them. Which
//! library runs a product is chosen per [`Class`] by timing each candidate
//! ([`measure`]); the choice is kept beside the MFU peak (`metrics::peak`)
//! and set with [`set_choice`].
//! `DISTGPT_MATMUL=gemm|openblas|blis|mkl` pins one for every class.
//!
//! `--precision bf16`'s products (operands rounded to bfloat16) run in
//! bf16 arithmetic when the CPU has AVX512-BF16 and the measurement finds
//! a bf16 product faster than the fp32 library: distgpt's own kernel
//! (`dpbf16`, `vdpbf16ps`; the built-in's bf16 product), MKL's
//! `cblas_gemm_bf16bf16f32` or OpenBLAS's `cblas_sbgemm` where it was built
//! with one (a library runs AMX itself where the CPU has that too);
//! elsewhere they run in fp32, on the rounded values. All sum exact
//! products of bf16 values in fp32, so they differ in rounding order only.
//! `DISTGPT_MATMUL_BF16=gemm|mkl|openblas|fp32` pins it (`gemm`: the
//! built-in kernel).

use super::attention::{BLOCK, KEYS, ROWS};
use super::math::{Dims, Mat, Views};
use super::{dpbf16::Onto, Element};
use crate::error::{Error, Result};
use libloading::Library;
use serde::{Deserialize, Serialize};
use std::ffi::c_int;
use std::ops::Range;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

crate::named_enum! {
    /// A matmul implementation.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
    #[serde(rename_all = "lowercase")]
    pub enum MatmulLib {
        Gemm = "gemm crate",
        OpenBlas = "OpenBLAS",
        Blis = "BLIS",
        Mkl = "MKL",
    }
    /// As a user reads it.
    fn name
}

impl MatmulLib {
    /// As `DISTGPT_MATMUL` spells it.
    pub fn key(self) -> &'static str {
        match self {
            MatmulLib::Gemm => "gemm",
            MatmulLib::OpenBlas => "openblas",
            MatmulLib::Blis => "blis",
            MatmulLib::Mkl => "mkl",
        }
    }

    /// Its place in [`MatmulLib::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The library at `i` in [`MatmulLib::ALL`] (the built-in past the end).
    pub fn from_index(i: usize) -> MatmulLib {
        MatmulLib::ALL.get(i).copied().unwrap_or(MatmulLib::Gemm)
    }

    /// The shared objects tried, in order, and how to install one.
    fn sonames(self) -> (&'static [&'static str], &'static str) {
        match self {
            MatmulLib::Gemm => (&[], ""),
            MatmulLib::OpenBlas => (
                &["libopenblas.so.0", "libopenblas.so"],
                "Debian's libopenblas0",
            ),
            MatmulLib::Blis => (&["libblis.so.4", "libblis.so"], "Debian's libblis4"),
            MatmulLib::Mkl => (
                &["libmkl_rt.so.2", "libmkl_rt.so.3", "libmkl_rt.so"],
                "PyPI's mkl, its lib folder on LD_LIBRARY_PATH",
            ),
        }
    }

    /// Whether this library can run here (the `gemm` crate always can).
    pub fn available(self) -> bool {
        self == MatmulLib::Gemm || loaded(self).is_ok()
    }

    /// Whether this library is here and has a bf16 product: the built-in
    /// one (distgpt's own kernel, [`MatmulLib::bf16_name`]) where the CPU
    /// has AVX512-BF16.
    pub fn has_bf16(self) -> bool {
        match self {
            MatmulLib::Gemm => native_bf16(),
            _ => loaded(self).is_ok_and(|l| l.gemm_bf16.is_some()),
        }
    }

    /// What runs its bf16 product, as a user reads it.
    pub fn bf16_name(self) -> &'static str {
        match self {
            MatmulLib::Gemm => "distgpt's AVX512-BF16 kernel",
            lib => lib.name(),
        }
    }

    /// What runs its attention blocks where that is not the library
    /// itself: distgpt's tile kernel for the built-in, where the CPU has one.
    pub fn small_kernel(self) -> Option<String> {
        match self {
            MatmulLib::Gemm => super::tile::Kernel::available()
                .first()
                .map(|k| format!("distgpt's {} tile kernel", k.name())),
            _ => None,
        }
    }

    /// The file the library was opened from, where it is one.
    pub fn path(self) -> Option<&'static str> {
        loaded(self).ok().map(|l| l.path.as_str())
    }
}

/// Which products a choice covers: `Large` are the layers' matmuls (every
/// dimension 128 or more: split across the pool), `Small` the rest
/// (attention's per-head blocks, a narrow vocabulary's head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Large,
    Small,
}

impl Class {
    pub fn of(m: usize, n: usize, k: usize) -> Class {
        if m.min(n).min(k) >= 128 {
            Class::Large
        } else {
            Class::Small
        }
    }
}

/// The library each class runs on, and the one that runs `--precision
/// bf16`'s products in bf16 arithmetic (None: in fp32, on the class's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MatmulChoice {
    pub large: MatmulLib,
    pub small: MatmulLib,
    /// Left out when None, so files that record a choice (a checkpoint's
    /// index, the peak cache) read as older versions wrote them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bf16: Option<MatmulLib>,
}

impl MatmulChoice {
    pub const BUILT_IN: MatmulChoice = MatmulChoice {
        large: MatmulLib::Gemm,
        small: MatmulLib::Gemm,
        bf16: None,
    };

    /// "OpenBLAS" when one library runs both classes, else both named;
    /// then the bf16 products' library, where one runs them.
    pub fn describe(&self) -> String {
        let classes = if self.large == self.small {
            self.large.name().to_string()
        } else {
            format!(
                "{} (layers), {} (attention blocks)",
                self.large.name(),
                self.small.name()
            )
        };
        match self.bf16 {
            Some(lib) => format!("{classes}, {} in bf16 (--precision bf16)", lib.bf16_name()),
            None => classes,
        }
    }
}

/// Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16's
/// `vdpbf16ps`; every x86 CPU with AMX-BF16 has it too): where distgpt's
/// own kernel runs.
pub fn native_bf16() -> bool {
    super::dpbf16::available()
}

const ROW_MAJOR: c_int = 101;
const NO_TRANS: c_int = 111;
const TRANS: c_int = 112;

/// A CBLAS product of `T` operands into an fp32 C: `cblas_sgemm` (f32),
/// MKL's `cblas_gemm_bf16bf16f32` and OpenBLAS's `cblas_sbgemm` (u16, the
/// bfloat16's bits) take the same arguments.
type Gemm<T> = unsafe extern "C" fn(
    order: c_int,
    trans_a: c_int,
    trans_b: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    alpha: f32,
    a: *const T,
    lda: c_int,
    b: *const T,
    ldb: c_int,
    beta: f32,
    c: *mut f32,
    ldc: c_int,
);

/// The names a library's bf16 product goes by.
const BF16_GEMMS: [&[u8]; 2] = [b"cblas_gemm_bf16bf16f32\0", b"cblas_sbgemm\0"];

/// An opened library's `cblas_sgemm`, and its bf16 product if it has one.
struct Loaded {
    sgemm: Gemm<f32>,
    gemm_bf16: Option<Gemm<u16>>,
    path: String,
    // Keeps `sgemm` valid for the process's life (never dropped: static).
    _lib: Library,
}

/// Opens `lib` once per process and asks it to run on the calling thread
/// only (the pool splits the work instead).
fn loaded(lib: MatmulLib) -> std::result::Result<&'static Loaded, &'static str> {
    static LIBS: [OnceLock<std::result::Result<Loaded, String>>; 4] =
        [const { OnceLock::new() }; 4];
    LIBS[lib.index()]
        .get_or_init(|| open(lib))
        .as_ref()
        .map_err(String::as_str)
}

fn open(lib: MatmulLib) -> std::result::Result<Loaded, String> {
    let (names, install) = lib.sonames();
    if names.is_empty() {
        return Err("built in".into());
    }
    let mut last = String::new();
    for &name in names {
        // SAFETY: opening a BLAS runs only its initialisers (thread and
        // memory setup), nothing of ours.
        let handle = match unsafe { Library::new(name) } {
            Ok(h) => h,
            Err(e) => {
                last = e.to_string();
                continue;
            }
        };
        // SAFETY: `cblas_sgemm` has the C signature `Gemm<f32>` (cblas.h).
        let sgemm = match unsafe { handle.get::<Gemm<f32>>(b"cblas_sgemm\0") } {
            Ok(f) => *f,
            Err(e) => return Err(format!("{name} has no cblas_sgemm: {e}")),
        };
        // SAFETY: each has the C signature `Gemm<u16>` (mkl_cblas.h, cblas.h)
        let gemm_bf16 = BF16_GEMMS
            .iter()
            .find_map(|&sym| unsafe { handle.get::<Gemm<u16>>(sym) }.ok().map(|f| *f));
        // SAFETY: each setter has the C signature named beside it (the
        // libraries' headers); a missing one leaves the library's default.
        unsafe {
            match lib {
                MatmulLib::OpenBlas => {
                    if let Ok(f) =
                        handle.get::<unsafe extern "C" fn(c_int)>(b"openblas_set_num_threads\0")
                    {
                        f(1)
                    }
                }
                MatmulLib::Blis => {
                    if let Ok(f) =
                        handle.get::<unsafe extern "C" fn(i64)>(b"bli_thread_set_num_threads\0")
                    {
                        f(1)
                    }
                }
                MatmulLib::Mkl => {
                    // MKL_THREADING_SEQUENTIAL: no OpenMP runtime needed
                    if let Ok(f) = handle
                        .get::<unsafe extern "C" fn(c_int) -> c_int>(b"MKL_Set_Threading_Layer\0")
                    {
                        f(1);
                    }
                }
                MatmulLib::Gemm => {}
            }
        }
        return Ok(Loaded {
            sgemm,
            gemm_bf16,
            path: name.to_string(),
            _lib: handle,
        });
    }
    Err(format!("not found ({last}): install {install}"))
}

/// 0: not decided yet; otherwise, per class, 1 + the library's index, and
/// for bf16 products ([`BF16_SLOT`]) 1 for fp32 or 2 + the library's index.
static CHOICE: [AtomicU8; 3] = [AtomicU8::new(0), AtomicU8::new(0), AtomicU8::new(0)];
const BF16_SLOT: usize = 2;

/// What the environment pins: `DISTGPT_MATMUL` the classes' library (`LIB`
/// for both, or `LARGE,SMALL`), `DISTGPT_MATMUL_BF16` the bf16 products'
/// (`fp32`: none).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Pins {
    classes: Option<(MatmulLib, MatmulLib)>,
    bf16: Option<Option<MatmulLib>>,
}

impl Pins {
    /// `choice` with what is pinned put in its place.
    fn over(self, choice: MatmulChoice) -> MatmulChoice {
        let (large, small) = self.classes.unwrap_or((choice.large, choice.small));
        MatmulChoice {
            large,
            small,
            bf16: self.bf16.unwrap_or(choice.bf16),
        }
    }
}

/// The environment's pins; a library named that cannot run here (or has
/// no bf16 product, for `DISTGPT_MATMUL_BF16`) is an error.
pub fn pinned() -> Result<Pins> {
    pins(env)
}

/// The variable `name`, lowercased, where it is set and not empty.
fn env(name: &str) -> Option<String> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(|v| v.to_string_lossy().to_lowercase())
}

/// What each variable that parses pins, apart: a bad one pins nothing
/// (the CLI reports it before anything runs) and leaves the other's pin.
fn pins_apart(var: impl Fn(&str) -> Option<String>) -> Pins {
    let only = |name: &str| pins(|v| (v == name).then(|| var(v)).flatten()).unwrap_or_default();
    Pins {
        classes: only("DISTGPT_MATMUL").classes,
        bf16: only("DISTGPT_MATMUL_BF16").bf16,
    }
}

/// The pins the variables `var` reads name.
fn pins(var: impl Fn(&str) -> Option<String>) -> Result<Pins> {
    let lib = |name: &str, v: &str, key: &str| -> Result<MatmulLib> {
        let lib = MatmulLib::ALL
            .into_iter()
            .find(|l| l.key() == key.trim())
            .ok_or_else(|| {
                Error::Config(format!(
                    "{name}={v}: {key:?} is not a matmul library (gemm, openblas, blis, mkl)"
                ))
            })?;
        match loaded(lib) {
            Err(e) if lib != MatmulLib::Gemm => {
                Err(Error::Config(format!("{name}={v}: {} {e}", lib.name())))
            }
            _ => Ok(lib),
        }
    };
    let mut pins = Pins::default();
    if let Some(v) = var("DISTGPT_MATMUL") {
        let (large, small) = v.split_once(',').unwrap_or((&v, &v));
        pins.classes = Some((
            lib("DISTGPT_MATMUL", &v, large)?,
            lib("DISTGPT_MATMUL", &v, small)?,
        ));
    }
    if let Some(v) = var("DISTGPT_MATMUL_BF16") {
        pins.bf16 = Some(match v.trim() {
            "fp32" => None,
            key => {
                let lib = lib("DISTGPT_MATMUL_BF16", &v, key)?;
                if !lib.has_bf16() {
                    let why = match lib {
                        MatmulLib::Gemm => "needs a CPU with AVX512-BF16",
                        _ => {
                            "has no bf16 product here (MKL's cblas_gemm_bf16bf16f32, \
                              OpenBLAS's cblas_sbgemm)"
                        }
                    };
                    return Err(Error::Config(format!(
                        "DISTGPT_MATMUL_BF16={v}: {} {why}; fp32 runs them on the rounded values",
                        lib.bf16_name()
                    )));
                }
                Some(lib)
            }
        });
    }
    Ok(pins)
}

/// Runs each class on `choice` from now on, unless this process has
/// decided already (its first decision holds, so no product of a run, nor
/// of two runs a process compares, switches library midway); a library
/// that cannot be opened here runs on the `gemm` crate instead (bf16
/// products in fp32), and the environment's pins override the choice.
pub fn set_choice(choice: MatmulChoice) {
    decide(choice, false)
}

/// Runs each class on `choice` from now on, decided or not: a resume
/// continues on its checkpoint's library.
pub fn force_choice(choice: MatmulChoice) {
    decide(choice, true)
}

fn decide(choice: MatmulChoice, force: bool) {
    let choice = pins_apart(env).over(choice);
    let usable = |lib: MatmulLib| match lib.available() {
        true => lib,
        false => MatmulLib::Gemm,
    };
    let bf16 = match choice.bf16.filter(|l| l.has_bf16()) {
        Some(lib) => 2 + lib.index() as u8,
        None => 1,
    };
    let codes = [
        1 + usable(choice.large).index() as u8,
        1 + usable(choice.small).index() as u8,
        bf16,
    ];
    for (slot, v) in CHOICE.iter().zip(codes) {
        if force {
            slot.store(v, Ordering::Relaxed);
        } else {
            let _ = slot.compare_exchange(0, v, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// The libraries products run on now.
pub fn choice() -> MatmulChoice {
    MatmulChoice {
        large: current(Class::Large),
        small: current(Class::Small),
        bf16: current_bf16(),
    }
}

/// The slot's code, deciding first if nothing is: the pins, else the
/// built-in, for the rest of the process (no run adopted a kept choice).
fn code(slot: usize) -> u8 {
    match CHOICE[slot].load(Ordering::Relaxed) {
        0 => {
            set_choice(MatmulChoice::BUILT_IN);
            CHOICE[slot].load(Ordering::Relaxed)
        }
        v => v,
    }
}

pub(super) fn current(class: Class) -> MatmulLib {
    MatmulLib::from_index(code(class as usize) as usize - 1)
}

/// The library that runs bf16 products in bf16 arithmetic, if one does.
pub(super) fn current_bf16() -> Option<MatmulLib> {
    match code(BF16_SLOT) {
        1 => None,
        v => Some(MatmulLib::from_index(v as usize - 2)),
    }
}

/// How `m x n` splits across `tasks` rayon tasks: along whichever of m and
/// n is longer, in multiples of 16 (a micro-kernel's rows).
fn split(m: usize, n: usize, tasks: usize) -> (bool, usize) {
    let (along_m, len) = if m >= n { (true, m) } else { (false, n) };
    let part = len.div_ceil(tasks).next_multiple_of(16).min(len);
    (along_m, part)
}

/// One CBLAS call's arguments, with the matrices' addresses as integers
/// so rayon tasks may share it; `run` does a block of the output.
struct Call<T> {
    gemm: Gemm<T>,
    k: usize,
    a: (c_int, c_int, usize, isize),
    b: (c_int, c_int, usize, isize),
    c: (usize, isize),
    alpha: f32,
    beta: f32,
}

impl<T> Clone for Call<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Call<T> {}

impl<T> Call<T> {
    /// The output's block of `rows` and `cols`.
    ///
    /// # Safety
    /// The block lies inside the product the call was made for.
    unsafe fn run(&self, rows: Range<usize>, cols: Range<usize>) {
        let (ta, lda, a, a_row) = self.a;
        let (tb, ldb, b, b_col) = self.b;
        let (c, c_row) = self.c;
        let (m0, n0) = (rows.start, cols.start);
        let a = (a as *const T).offset(m0 as isize * a_row);
        let b = (b as *const T).offset(n0 as isize * b_col);
        let c = (c as *mut f32).offset(m0 as isize * c_row + n0 as isize);
        (self.gemm)(
            ROW_MAJOR,
            ta,
            tb,
            rows.len() as c_int,
            cols.len() as c_int,
            self.k as c_int,
            self.alpha,
            a,
            lda,
            b,
            ldb,
            self.beta,
            c,
            c_row as c_int,
        )
    }

    /// The whole `m x n` output: one call on this thread when `threads`
    /// is 1, else split into row or column blocks, one rayon task each.
    ///
    /// # Safety
    /// As [`Call::run`] for the whole product.
    unsafe fn split(&self, m: usize, n: usize, threads: usize) {
        if threads <= 1 || m.max(n) < 32 {
            return self.run(0..m, 0..n);
        }
        let (along_m, part) = split(m, n, threads);
        let len = if along_m { m } else { n };
        use rayon::prelude::*;
        (0..len.div_ceil(part)).into_par_iter().for_each(|i| {
            let span = i * part..(i * part + part.min(len - i * part));
            // SAFETY: the blocks tile the output without overlap.
            unsafe {
                if along_m {
                    self.run(span, 0..n)
                } else {
                    self.run(0..m, span)
                }
            }
        });
    }
}

/// A product as CBLAS takes it, row-major: `m`, `n`, and each operand's
/// (transpose flag, leading dimension) with the views they were read from.
struct Operands {
    m: usize,
    n: usize,
    lhs: (Mat<*const f32>, (c_int, c_int)),
    rhs: (Mat<*const f32>, (c_int, c_int)),
    dst: Mat<*mut f32>,
}

impl Operands {
    /// None where an operand has no unit stride or a size overflows a C int.
    fn of(views: Views) -> Option<Operands> {
        // row-major C = A B needs C's rows contiguous
        let Views {
            dst,
            lhs,
            rhs,
            dims,
        } = views.rows_contiguous()?;
        let Dims { m, n, k } = dims;
        let fits = |x: usize| c_int::try_from(x).is_ok();
        let ldc = dst.row_stride;
        if !(fits(m) && fits(n) && fits(k)) || ldc < n.max(1) as isize || !fits(ldc as usize) {
            return None;
        }
        Some(Operands {
            m,
            n,
            lhs: (lhs, operand(lhs, m, k)?),
            rhs: (rhs, operand(rhs, k, n)?),
            dst,
        })
    }

    /// The call on `gemm` with the views' own memory.
    fn call(&self, gemm: Gemm<f32>, k: usize, alpha: f32, beta: f32) -> Call<f32> {
        let ((lhs, (ta, lda)), (rhs, (tb, ldb))) = (self.lhs, self.rhs);
        Call {
            gemm,
            k,
            a: (ta, lda, lhs.ptr as usize, lhs.row_stride),
            b: (tb, ldb, rhs.ptr as usize, rhs.col_stride),
            c: (self.dst.ptr as usize, self.dst.row_stride),
            alpha,
            beta,
        }
    }
}

/// `dst = [dst +] scale * lhs @ rhs` on `lib`: one call on this thread
/// when `threads` is 1, else the output split into row or column blocks,
/// one rayon task each. With `bf16`, on `lib`'s bf16 product (the built-in
/// one: `dpbf16`): the operands rounded to bfloat16 into scratch, the
/// products summed in fp32. Returns false, doing nothing, when the library
/// (or its bf16 product) is not here, the `gemm` crate is asked for fp32,
/// or an operand has no unit stride (the caller runs it on the crate).
///
/// # Safety
/// As `math::gemm`.
#[allow(clippy::too_many_arguments)] // a BLAS call's own arguments
pub(super) unsafe fn gemm(
    lib: MatmulLib,
    bf16: bool,
    dims: Dims,
    dst: Mat<*mut f32>,
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    accumulate: bool,
    scale: f32,
    threads: usize,
) -> bool {
    let Dims { m, n, k } = dims;
    if bf16 && m * n * k == 0 {
        // nothing to multiply: the caller's fp32 route fills or keeps dst
        return false;
    }
    if bf16 && lib == MatmulLib::Gemm {
        // SAFETY: as this function's
        return unsafe { on_dpbf16(dims, dst, lhs, rhs, accumulate.into(), scale, threads) };
    }
    let (Ok(l), Some(ops)) = (loaded(lib), Operands::of(Views::of(dims, dst, lhs, rhs))) else {
        return false;
    };
    let beta = if accumulate { 1.0 } else { 0.0 };
    if !bf16 {
        ops.call(l.sgemm, k, scale, beta)
            .split(ops.m, ops.n, threads);
        return true;
    }
    let Some(gemm) = l.gemm_bf16 else {
        return false;
    };
    request_amx();
    BF16_PRODUCTS.fetch_add(1, Ordering::Relaxed);
    let ((lhs, (ta, _)), (rhs, (tb, _))) = (ops.lhs, ops.rhs);
    super::math::with_scratch(&BF16_OPERANDS, ops.m * k + k * ops.n, |scratch| {
        let (a, b) = scratch.split_at_mut(ops.m * k);
        use crate::backend::Bf16;
        let bits = |v: f32| Bf16::from_f32(v).bits();
        // SAFETY: the caller's views are readable (as math::gemm).
        let ((a_row, a_col), (b_row, b_col)) = unsafe {
            (
                super::math::round_compact(lhs, ops.m, k, a, bits),
                super::math::round_compact(rhs, k, ops.n, b, bits),
            )
        };
        // a compact copy's leading dimension is its longer stride
        let ld = |row: usize, col: usize| row.max(col) as c_int;
        let call = Call {
            gemm,
            k,
            a: (ta, ld(a_row, a_col), a.as_ptr() as usize, a_row as isize),
            b: (tb, ld(b_row, b_col), b.as_ptr() as usize, b_col as isize),
            c: (ops.dst.ptr as usize, ops.dst.row_stride),
            alpha: scale,
            beta,
        };
        // SAFETY: as this function's, on the copies
        unsafe { call.split(ops.m, ops.n, threads) };
    });
    true
}

/// `dst = [dst +] lhs @ rhs` (`onto` says onto what) in bf16 arithmetic
/// with operands and output held as they are, fp32 or bfloat16, on the
/// built-in bf16 product where it is the one bf16 products run on: a
/// bfloat16 operand read with no copy, a bfloat16 output the fp32 one
/// rounded (its bias, rounded to bf16, added first). Returns false, doing
/// nothing, elsewhere (another library chosen, no AVX512-BF16, a view with
/// no unit stride, an empty product, a bfloat16 output to accumulate onto,
/// a bias onto an fp32 one): the caller stages the product in fp32 then.
///
/// # Safety
/// As `math::gemm`.
pub(crate) unsafe fn gemm_stored<D: Element, L: Element, R: Element>(
    (m, n, k): (usize, usize, usize),
    dst: Mat<*mut D>,
    lhs: Mat<*const L>,
    rhs: Mat<*const R>,
    onto: Onto,
    threads: usize,
) -> bool {
    let dims = Dims { m, n, k };
    // SAFETY: as this function's
    stores_bf16() && m * n * k > 0 && unsafe { on_dpbf16(dims, dst, lhs, rhs, onto, 1.0, threads) }
}

/// Whether [`gemm_stored`] runs products on this CPU: it has AVX512-BF16
/// and bf16 products run on the built-in kernel.
pub(crate) fn stores_bf16() -> bool {
    current_bf16() == Some(MatmulLib::Gemm) && super::dpbf16::available()
}

/// Whether attention's tiles take `--precision bf16`'s products on the
/// bf16 units (`vdpbf16ps`): the CPU has them and a bf16 product runs the
/// matmuls (the measurement found one faster than fp32 here, or a pin
/// asked for it); elsewhere fp32 FMAs on the rounded values, as the
/// matmuls then take them (a Xeon without AMX does half as many bf16
/// products a cycle as fp32 FMAs).
pub(crate) fn bf16_units() -> bool {
    bf16_arithmetic() && super::dpbf16::available()
}

/// Whether `--precision bf16`'s matmuls run in bf16 arithmetic (on a bf16
/// product: the measured choice, or a pin); else in fp32, on the rounded
/// values.
pub(crate) fn bf16_arithmetic() -> bool {
    current_bf16().is_some()
}

/// [`super::dpbf16::gemm`], counted in [`bf16_products`] when it runs.
///
/// # Safety
/// As `math::gemm`.
unsafe fn on_dpbf16<D: Element, L: Element, R: Element>(
    dims: Dims,
    dst: Mat<*mut D>,
    lhs: Mat<*const L>,
    rhs: Mat<*const R>,
    onto: Onto,
    scale: f32,
    threads: usize,
) -> bool {
    // SAFETY: as this function's
    let ran = unsafe { super::dpbf16::gemm(dims, dst, lhs, rhs, onto, scale, threads) };
    if ran {
        BF16_PRODUCTS.fetch_add(1, Ordering::Relaxed);
    }
    ran
}

thread_local! {
    /// The bf16 copies of a product's operands.
    static BF16_OPERANDS: super::math::Scratch<u16> = const { super::math::Scratch::new(Vec::new()) };
}

/// Products this process ran on a library's bf16 product.
static BF16_PRODUCTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many products this process has run in bf16 arithmetic.
pub fn bf16_products() -> u64 {
    BF16_PRODUCTS.load(Ordering::Relaxed)
}

/// Asks Linux, once, for the AMX tile state, which a process must hold
/// before its first AMX instruction (else that instruction faults): MKL
/// asks for it itself, an OpenBLAS bf16 kernel may not. Where the CPU or
/// kernel has no AMX the request is refused, and nothing changes.
fn request_amx() {
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    {
        use std::ffi::c_long;
        extern "C" {
            fn syscall(number: c_long, ...) -> c_long;
        }
        const SYS_ARCH_PRCTL: c_long = 158;
        const ARCH_REQ_XCOMP_PERM: c_long = 0x1023;
        const XFEATURE_XTILEDATA: c_long = 18;
        static ONCE: std::sync::Once = std::sync::Once::new();
        // SAFETY: arch_prctl with these arguments only changes which
        // register state the kernel lets this process use.
        ONCE.call_once(|| unsafe {
            syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA);
        });
    }
}

/// Whether `lib`'s bf16 product computes what the `gemm` crate does on
/// bf16 operands, on a small product in each operand layout, split over
/// the pool: a library is timed for bf16 products (and may be chosen) only
/// if it does, so a wrong kernel on a CPU this build was never tested on
/// is dropped, not run.
fn bf16_agrees(lib: MatmulLib) -> bool {
    let (m, n, k) = (37, 29, 45);
    let dims = Dims { m, n, k };
    let mut rng = crate::rng::Rng::new(13);
    let mut draw = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| super::round_to_bf16(rng.normal() as f32))
            .collect()
    };
    let (a, b) = (draw(m * k), draw(k * n));
    let threads = rayon::current_num_threads();
    (0..4).all(|layout| {
        let probe = Probe {
            dims,
            lhs_t: layout & 1 != 0,
            rhs_t: layout & 2 != 0,
        };
        let (mut want, mut got) = (vec![0.0f32; m * n], vec![0.0f32; m * n]);
        product_in(MatmulLib::Gemm, probe, 1, &a, &b, &mut want, false);
        let (_, ran) = product_in(lib, probe, threads, &a, &b, &mut got, true);
        let scale = want.iter().fold(1.0f32, |s, x| s.max(x.abs()));
        ran && want
            .iter()
            .zip(&got)
            .all(|(w, g)| (w - g).abs() <= 1e-5 * scale)
    })
}

/// A BLAS operand for an `rows x cols` matrix: (transpose flag, leading
/// dimension), or None when neither stride is 1.
fn operand(x: Mat<*const f32>, rows: usize, cols: usize) -> Option<(c_int, c_int)> {
    let (flag, ld, least) = if x.col_stride == 1 {
        (NO_TRANS, x.row_stride, cols)
    } else if x.row_stride == 1 {
        (TRANS, x.col_stride, rows)
    } else {
        return None;
    };
    let ld = c_int::try_from(ld).ok()?;
    (ld as usize >= least.max(1)).then_some((flag, ld))
}

/// One library's speed on each class, in FLOP/s.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    pub lib: MatmulLib,
    pub large_flops: f64,
    pub small_flops: f64,
    /// Its bf16 product on the layers' probe, where the CPU multiplies
    /// bf16 ([`native_bf16`]) and the library has one.
    #[serde(default)]
    pub bf16_flops: Option<f64>,
}

/// Times every library that opens here on both classes with the pool's
/// threads (best of `reps`) and returns the fastest per class with all the
/// timings. The `Large` probe is an MLP layer's three products (forward,
/// input and weight gradients) at two widths: 384 over 4096 rows (the
/// shakespeare-char preset at 16 x 256) and 768 over 1024 (GPT-2 small at
/// 8 x 128); the `Small` probe
/// attention's per-tile products (a block of query rows against a tile of
/// keys, 64 wide: the forward's two and the backward's five), 32 tiles a
/// thread, and a 65-token vocabulary's head. Where the CPU multiplies
/// bf16, each library's bf16 product runs the `Large` probe too.
pub fn measure(reps: usize) -> (MatmulChoice, Vec<Timing>) {
    let native = native_bf16();
    let timings: Vec<Timing> = MatmulLib::ALL
        .into_iter()
        .filter(|l| l.available())
        .map(|lib| Timing {
            lib,
            large_flops: best(reps, || probe_large(lib, false)),
            small_flops: best(reps, || probe_small(lib)),
            bf16_flops: (native && lib.has_bf16() && bf16_checked(lib))
                .then(|| best(reps, || probe_large(lib, true))),
        })
        .collect();
    let large = fastest(&timings, |t| t.large_flops);
    let choice = MatmulChoice {
        large,
        small: fastest(&timings, |t| t.small_flops),
        bf16: fastest_bf16(&timings, large),
    };
    (choice, timings)
}

/// [`bf16_agrees`], said on stderr when it does not.
fn bf16_checked(lib: MatmulLib) -> bool {
    let agrees = bf16_agrees(lib);
    if !agrees {
        crate::errln!(
            "{}'s bf16 product disagrees with the gemm crate on this CPU: bf16 products stay in fp32",
            lib.name()
        );
    }
    agrees
}

/// The library whose bf16 product is fastest, if it beats the fp32
/// library chosen for the layers (`large`) by more than 5%: else bf16
/// products run in fp32 on that library.
fn fastest_bf16(timings: &[Timing], large: MatmulLib) -> Option<MatmulLib> {
    let fp32 = timings
        .iter()
        .find(|t| t.lib == large)
        .map_or(0.0, |t| t.large_flops);
    timings
        .iter()
        .filter_map(|t| Some((t.lib, t.bf16_flops?)))
        .filter(|&(_, f)| f > 1.05 * fp32)
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(lib, _)| lib)
}

/// The fastest library by `speed`; the `gemm` crate unless another is more
/// than 5% faster (closer is within a quiet machine's noise, and the crate
/// needs nothing installed).
fn fastest(timings: &[Timing], speed: fn(&Timing) -> f64) -> MatmulLib {
    let own = timings
        .iter()
        .find(|t| t.lib == MatmulLib::Gemm)
        .map_or(0.0, speed);
    timings
        .iter()
        .filter(|t| speed(t) > 1.05 * own)
        .max_by(|a, b| speed(a).total_cmp(&speed(b)))
        .map_or(MatmulLib::Gemm, |t| t.lib)
}

/// The best FLOP/s of `probe` (which returns its FLOPs and seconds) over
/// `reps` runs after one to warm up.
fn best(reps: usize, probe: impl Fn() -> (f64, f64)) -> f64 {
    probe();
    (0..reps.max(1))
        .map(|_| {
            let (flops, s) = probe();
            flops / s
        })
        .fold(0.0, f64::max)
}

/// A product the probes time: its sizes, and whether each operand is
/// stored transposed (`lhs_t`: `k x m`, `rhs_t`: `n x k`).
#[derive(Clone, Copy)]
struct Probe {
    dims: Dims,
    lhs_t: bool,
    rhs_t: bool,
}

impl Probe {
    /// `m x k @ k x n`, both operands stored as they are read.
    fn of(m: usize, n: usize, k: usize) -> Probe {
        Probe {
            dims: Dims { m, n, k },
            lhs_t: false,
            rhs_t: false,
        }
    }

    /// The same product on the left operand stored transposed.
    fn lhs_t(self) -> Probe {
        Probe {
            lhs_t: true,
            ..self
        }
    }

    /// The same product on the right operand stored transposed.
    fn rhs_t(self) -> Probe {
        Probe {
            rhs_t: true,
            ..self
        }
    }
}

/// Runs `probe` on `lib` (its bf16 product if `bf16`) on fresh buffers
/// and `threads` threads; returns FLOPs and seconds.
fn product(lib: MatmulLib, probe: Probe, threads: usize, bf16: bool) -> (f64, f64) {
    let Dims { m, n, k } = probe.dims;
    let a = vec![0.5f32; m * k];
    let b = vec![0.25f32; k * n];
    let mut c = vec![0.0f32; m * n];
    let t0 = Instant::now();
    let (flops, _) = product_in(lib, probe, threads, &a, &b, &mut c, bf16);
    (flops, t0.elapsed().as_secs_f64())
}

/// [`product`] on the given buffers (at least m x k, k x n and m x n
/// floats), untimed; returns its FLOPs and whether the bf16 product ran.
fn product_in(
    lib: MatmulLib,
    probe: Probe,
    threads: usize,
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    bf16: bool,
) -> (f64, bool) {
    let Probe { dims, lhs_t, rhs_t } = probe;
    let Dims { m, n, k } = dims;
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let lhs = if lhs_t {
        Mat::new(a.as_ptr(), 1, m)
    } else {
        Mat::new(a.as_ptr(), k, 1)
    };
    let rhs = if rhs_t {
        Mat::new(b.as_ptr(), 1, k)
    } else {
        Mat::new(b.as_ptr(), n, 1)
    };
    let dst = Mat::new(c.as_mut_ptr(), n, 1);
    // SAFETY: each buffer holds the elements its view addresses (asserted).
    let ran = bf16 && unsafe { gemm(lib, true, dims, dst, lhs, rhs, false, 1.0, threads) };
    if !ran {
        // SAFETY: as above.
        unsafe { super::math::gemm_on(lib, dims, dst, lhs, rhs, false, 1.0, threads) }
    }
    std::hint::black_box(&c);
    (2.0 * (m * n * k) as f64, ran)
}

fn probe_large(lib: MatmulLib, bf16: bool) -> (f64, f64) {
    let threads = rayon::current_num_threads();
    [(4096, 384), (1024, 768)]
        .into_iter()
        .flat_map(|(rows, c)| {
            let h = 4 * c;
            [
                product(lib, Probe::of(rows, h, c), threads, bf16), // forward
                product(lib, Probe::of(rows, c, h).rhs_t(), threads, bf16), // input gradient
                product(lib, Probe::of(c, h, rows).lhs_t(), threads, bf16), // weight gradient
            ]
        })
        .fold((0.0, 0.0), |(f, s), (g, t)| (f + g, s + t))
}

fn probe_small(lib: MatmulLib) -> (f64, f64) {
    use rayon::prelude::*;
    let threads = rayon::current_num_threads();
    // as attention runs them: per query block and key tile, the forward's
    // scores (Q K^T) and P V; per key tile and run of the query rows that
    // see it (here 128 rows, the middle of a causal 256-token sequence's
    // runs of 256 down to 64), the backward's scores again, dV = P^T dO,
    // dP = dO V^T, dQ = dS K and dK = dS^T Q
    let (rows, keys, hd) = (BLOCK, KEYS, 64);
    let run = ROWS / 2;
    let tile = [
        Probe::of(rows, keys, hd).rhs_t(),
        Probe::of(rows, hd, keys),
        Probe::of(run, keys, hd).rhs_t(),
        Probe::of(keys, hd, run).lhs_t(),
        Probe::of(run, keys, hd).rhs_t(),
        Probe::of(run, hd, keys),
        Probe::of(keys, hd, run).lhs_t(),
    ];
    let size = rows.max(run).max(keys).max(hd).pow(2);
    let t0 = Instant::now();
    let flops: f64 = (0..threads)
        .into_par_iter()
        .map(|_| {
            let (a, b, mut c) = (vec![0.5f32; size], vec![0.25f32; size], vec![0.0f32; size]);
            (0..32)
                .flat_map(|_| tile)
                .map(|probe| product_in(lib, probe, 1, &a, &b, &mut c, false).0)
                .sum::<f64>()
        })
        .sum();
    let s = t0.elapsed().as_secs_f64();
    let (f3, s3) = product(lib, Probe::of(2048, 65, 384).rhs_t(), threads, false); // a char head
    (flops + f3, s + s3)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Every product shape the kernels use, in each operand layout (each
    /// with a leading dimension past its rows), with and without
    /// accumulation, on one thread and split across two. With
    /// `bf16`, `lib`'s bf16 product on the operands as drawn against the
    /// crate's fp32 product on them rounded to bfloat16: the same exact
    /// products, summed in another order.
    fn products_match_the_crate(lib: MatmulLib, bf16: bool) {
        let mut rng = Rng::new(7);
        let shapes = [
            (5, 7, 9),
            (300, 200, 150),
            (64, 256, 64),
            (1000, 65, 384),
            (70, 90, 777),
            (200, 40, 1001),
        ];
        for (m, n, k) in shapes {
            for layout in 0..8 {
                let (lhs_t, rhs_t, dst_t) = (layout & 1 != 0, layout & 2 != 0, layout & 4 != 0);
                let mut draw =
                    |len: usize| -> Vec<f32> { (0..len).map(|_| rng.normal() as f32).collect() };
                // operands with 3 NaN past each row of their storage: a
                // product that read past the view would turn NaN
                const PAD: usize = 3;
                let mut padded = |rows: usize, cols: usize| -> Vec<f32> {
                    let mut x = draw(rows * (cols + PAD));
                    for row in x.chunks_mut(cols + PAD) {
                        row[cols..].fill(f32::NAN);
                    }
                    x
                };
                let a = match lhs_t {
                    true => padded(k, m),
                    false => padded(m, k),
                };
                let b = match rhs_t {
                    true => padded(n, k),
                    false => padded(k, n),
                };
                let c0 = draw(m * n);
                let rounded = |x: &[f32]| -> Vec<f32> {
                    let round = |v: f32| {
                        if bf16 {
                            super::super::round_to_bf16(v)
                        } else {
                            v
                        }
                    };
                    x.iter().map(|&v| round(v)).collect()
                };
                let (a_r, b_r) = (rounded(&a), rounded(&b));
                let view = |a: &[f32], b: &[f32]| {
                    let lhs = match lhs_t {
                        true => Mat::new(a.as_ptr(), 1, m + PAD),
                        false => Mat::new(a.as_ptr(), k + PAD, 1),
                    };
                    let rhs = match rhs_t {
                        true => Mat::new(b.as_ptr(), 1, k + PAD),
                        false => Mat::new(b.as_ptr(), n + PAD, 1),
                    };
                    (lhs, rhs)
                };
                for (accumulate, threads) in
                    [(false, 1), (true, 1), (false, 2), (true, 2), (true, 5)]
                {
                    let run = |on: MatmulLib, (lhs, rhs), bf16: bool| {
                        let mut c = c0.clone();
                        let dst = match dst_t {
                            true => Mat::new(c.as_mut_ptr(), 1, m),
                            false => Mat::new(c.as_mut_ptr(), n, 1),
                        };
                        let dims = Dims { m, n, k };
                        // SAFETY: each buffer holds what its view addresses.
                        unsafe {
                            if bf16 {
                                let ran =
                                    gemm(on, true, dims, dst, lhs, rhs, accumulate, 0.5, threads);
                                assert!(ran, "{} took no bf16 product", on.name());
                            } else {
                                super::super::math::gemm_on(
                                    on, dims, dst, lhs, rhs, accumulate, 0.5, threads,
                                )
                            }
                        };
                        c
                    };
                    let want = run(MatmulLib::Gemm, view(&a_r, &b_r), false);
                    let got = run(lib, view(&a, &b), bf16);
                    let scale = want.iter().fold(1.0f32, |s, x| s.max(x.abs()));
                    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                        assert!(
                            (w - g).abs() <= 1e-5 * scale,
                            "{} {m}x{n}x{k} layout {layout} accumulate {accumulate} threads {threads} bf16 {bf16}: [{i}] {g} vs the crate's {w}",
                            lib.name()
                        );
                    }
                }
            }
        }
    }

    /// The libraries here that `has`, whose installed ones must be those
    /// CI names in `expect` (the built-in one is here by the CPU, not by
    /// what CI installed), and a pool of two threads to run on.
    fn here(has: fn(MatmulLib) -> bool, expect: &str) -> (Vec<MatmulLib>, rayon::ThreadPool) {
        let here: Vec<MatmulLib> = MatmulLib::ALL.into_iter().filter(|&l| has(l)).collect();
        if let Ok(want) = std::env::var(expect) {
            let installed = |key: &&str| *key != MatmulLib::Gemm.key();
            let names: Vec<&str> = here.iter().map(|l| l.key()).filter(installed).collect();
            let want: Vec<&str> = want.split(',').filter(installed).collect();
            assert_eq!(names, want, "the libraries here ({expect})");
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        (here, pool)
    }

    /// The matmul peak `bench` states MFU against is the probe's FLOPs over
    /// its time: an MLP layer's forward, input and weight gradients (2 x
    /// rows x C x 4C each) at 384 wide over 4,096 rows and 768 over 1,024,
    /// counted here by hand.
    #[test]
    fn the_large_probe_counts_an_mlp_layers_three_products() {
        let mlp = |rows: f64, c: f64| 3.0 * 2.0 * rows * c * 4.0 * c;
        let want = mlp(4096.0, 384.0) + mlp(1024.0, 768.0);
        assert_eq!(want, 28_991_029_248.0);
        assert_eq!(probe_large(MatmulLib::Gemm, false).0, want);
    }

    #[test]
    fn every_library_here_computes_what_the_gemm_crate_does() {
        let (here, pool) = here(MatmulLib::available, "DISTGPT_EXPECT_MATMUL");
        for lib in here.into_iter().filter(|&l| l != MatmulLib::Gemm) {
            pool.install(|| products_match_the_crate(lib, false));
        }
    }

    /// Each bf16 product here, the built-in kernel where the CPU has
    /// AVX512-BF16 (said on stderr: which ran is the CPU's to decide).
    #[test]
    fn every_bf16_product_here_sums_what_the_crate_does_on_rounded_operands() {
        let (here, pool) = here(MatmulLib::has_bf16, "DISTGPT_EXPECT_BF16");
        #[cfg(target_arch = "x86_64")]
        assert_eq!(
            MatmulLib::Gemm.has_bf16(),
            is_x86_feature_detected!("avx512bf16"),
            "the built-in bf16 kernel runs exactly where the CPU has AVX512-BF16"
        );
        for lib in here {
            eprintln!("bf16 products on {}", lib.bf16_name());
            pool.install(|| products_match_the_crate(lib, true));
            assert!(pool.install(|| bf16_agrees(lib)), "{}'s check", lib.name());
        }
    }

    #[test]
    fn a_choice_without_a_bf16_product_serializes_as_before_it_had_one() {
        // a choice without one is written as before it existed (indexes
        // and the peak cache), and one with it reads back
        let old = r#"{"large":"openblas","small":"gemm"}"#;
        let read: MatmulChoice = serde_json::from_str(old).unwrap();
        assert_eq!(read.bf16, None);
        assert_eq!(serde_json::to_string(&read).unwrap(), old);
        let with = MatmulChoice {
            bf16: Some(MatmulLib::Mkl),
            ..read
        };
        let text = serde_json::to_string(&with).unwrap();
        assert_eq!(serde_json::from_str::<MatmulChoice>(&text).unwrap(), with);
    }

    #[test]
    fn a_bf16_product_is_chosen_only_where_it_beats_the_fp32_library_by_5_percent() {
        let t = |lib, large_flops, bf16_flops| Timing {
            lib,
            large_flops,
            small_flops: 0.0,
            bf16_flops,
        };
        // a CPU without bf16 arithmetic times none
        let none = [
            t(MatmulLib::Gemm, 100.0, None),
            t(MatmulLib::Mkl, 90.0, None),
        ];
        assert_eq!(fastest_bf16(&none, MatmulLib::Gemm), None);
        // emulated (this AVX2 machine: 60 against 75 GFLOP/s) or close: fp32
        let slow = [
            t(MatmulLib::OpenBlas, 100.0, None),
            t(MatmulLib::Mkl, 90.0, Some(104.0)),
        ];
        assert_eq!(fastest_bf16(&slow, MatmulLib::OpenBlas), None);
        // against the fp32 library chosen for the layers, not the slowest
        let fast = [
            t(MatmulLib::Gemm, 80.0, None),
            t(MatmulLib::OpenBlas, 100.0, Some(150.0)),
            t(MatmulLib::Mkl, 90.0, Some(200.0)),
        ];
        assert_eq!(
            fastest_bf16(&fast, MatmulLib::OpenBlas),
            Some(MatmulLib::Mkl)
        );
        assert_eq!(
            fastest_bf16(&fast[..2], MatmulLib::OpenBlas),
            Some(MatmulLib::OpenBlas)
        );
        assert_eq!(
            fastest_bf16(&fast[1..], MatmulLib::Mkl),
            Some(MatmulLib::Mkl)
        );
    }

    #[test]
    fn the_environment_pins_the_classes_and_the_bf16_products_apart() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(k, _)| *k == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        let p = pins(env(&[("DISTGPT_MATMUL", "gemm")])).unwrap();
        let chosen = MatmulChoice {
            large: MatmulLib::OpenBlas,
            small: MatmulLib::Blis,
            bf16: Some(MatmulLib::Mkl),
        };
        assert_eq!(
            p.over(chosen),
            MatmulChoice {
                bf16: Some(MatmulLib::Mkl),
                ..MatmulChoice::BUILT_IN
            }
        );
        let p = pins(env(&[("DISTGPT_MATMUL_BF16", "fp32")])).unwrap();
        assert_eq!(
            p.over(chosen),
            MatmulChoice {
                bf16: None,
                ..chosen
            }
        );
        // the built-in kernel: where the CPU has AVX512-BF16 only
        match pins(env(&[("DISTGPT_MATMUL_BF16", "gemm")])) {
            Ok(p) => {
                assert!(native_bf16());
                assert_eq!(p.over(chosen).bf16, Some(MatmulLib::Gemm));
            }
            Err(e) => {
                assert!(!native_bf16(), "{e}");
                assert!(
                    e.to_string().contains("needs a CPU with AVX512-BF16"),
                    "{e}"
                );
            }
        }
        let e = pins(env(&[("DISTGPT_MATMUL_BF16", "cublas")])).unwrap_err();
        assert!(e.to_string().contains("not a matmul library"), "{e}");
        // a bad variable drops its own pin only
        let both = env(&[
            ("DISTGPT_MATMUL", "gemm"),
            ("DISTGPT_MATMUL_BF16", "cublas"),
        ]);
        assert!(pins(both).is_err());
        assert_eq!(
            pins_apart(both).over(chosen),
            MatmulChoice {
                bf16: Some(MatmulLib::Mkl),
                ..MatmulChoice::BUILT_IN
            }
        );
    }

    #[test]
    fn a_library_that_is_not_here_runs_on_the_crate() {
        let absent = MatmulLib::ALL.into_iter().find(|l| !l.available());
        let Some(lib) = absent else {
            eprintln!("every library is here: nothing to fall back from");
            return;
        };
        assert!(loaded(lib).err().is_some_and(|e| e.contains("install")));
        let (choice, timings) = (
            MatmulChoice {
                large: lib,
                small: lib,
                bf16: None,
            },
            [Timing {
                lib: MatmulLib::Gemm,
                large_flops: 1.0,
                small_flops: 1.0,
                bf16_flops: None,
            }],
        );
        assert_eq!(fastest(&timings, |t| t.large_flops), MatmulLib::Gemm);
        let mut x = [0.0f32; 4];
        let one = [1.0f32; 4];
        // SAFETY: 2 x 2 products on 4-element buffers.
        unsafe {
            super::super::math::gemm_on(
                choice.large,
                Dims { m: 2, n: 2, k: 2 },
                Mat::new(x.as_mut_ptr(), 2, 1),
                Mat::new(one.as_ptr(), 2, 1),
                Mat::new(one.as_ptr(), 2, 1),
                false,
                1.0,
                1,
            )
        };
        assert_eq!(x, [2.0; 4], "{} absent: the crate ran it", lib.name());
    }

    #[test]
    fn the_crate_keeps_a_class_unless_a_library_beats_it_by_5_percent() {
        let t = |lib, large_flops| Timing {
            lib,
            large_flops,
            small_flops: 0.0,
            bf16_flops: None,
        };
        let close = [t(MatmulLib::Gemm, 100.0), t(MatmulLib::OpenBlas, 104.0)];
        assert_eq!(fastest(&close, |t| t.large_flops), MatmulLib::Gemm);
        let clear = [
            t(MatmulLib::Gemm, 100.0),
            t(MatmulLib::OpenBlas, 120.0),
            t(MatmulLib::Blis, 110.0),
        ];
        assert_eq!(fastest(&clear, |t| t.large_flops), MatmulLib::OpenBlas);
    }

    #[test]
    fn a_product_splits_along_its_longer_side_in_whole_micro_panels() {
        assert_eq!(split(4096, 384, 2), (true, 2048));
        assert_eq!(split(65, 4096, 2), (false, 2048));
        assert_eq!(split(100, 10, 3), (true, 48));
        assert_eq!(split(20, 10, 4), (true, 16));
    }

    #[test]
    fn an_operand_needs_a_unit_stride_and_a_leading_dimension_that_covers_it() {
        let p = std::ptr::null::<f32>();
        assert_eq!(operand(Mat::new(p, 8, 1), 4, 8), Some((NO_TRANS, 8)));
        assert_eq!(operand(Mat::new(p, 1, 4), 4, 8), Some((TRANS, 4)));
        assert_eq!(operand(Mat::new(p, 4, 1), 4, 8), None, "ld below the row");
        assert_eq!(operand(Mat::new(p, 8, 2), 4, 8), None, "no unit stride");
    }

    #[test]
    fn a_layer_matmul_is_large_and_an_attention_block_small() {
        assert_eq!(Class::of(4096, 1152, 384), Class::Large);
        assert_eq!(Class::of(64, 256, 64), Class::Small);
        assert_eq!(Class::of(4096, 65, 384), Class::Small);
    }
}
