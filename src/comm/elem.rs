//! The element types collectives move. A buffer reaches a `Comm` tagged with
//! its type (as NCCL's `ncclDataType_t` or an MPI datatype tags a pointer),
//! so the trait stays object-safe and counts, flags and paths travel exactly.

use std::fmt;

crate::named_enum! {
    /// Which element type a buffer holds.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum DType {
        F32 = "f32",
        F64 = "f64",
        U32 = "u32",
        U64 = "u64",
        I64 = "i64",
        U8 = "u8",
    }
    /// Its Rust name.
    fn name
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A buffer a collective reads.
#[derive(Clone, Copy)]
pub enum Buf<'a> {
    F32(&'a [f32]),
    F64(&'a [f64]),
    U32(&'a [u32]),
    U64(&'a [u64]),
    I64(&'a [i64]),
    U8(&'a [u8]),
}

/// A buffer a collective writes.
pub enum BufMut<'a> {
    F32(&'a mut [f32]),
    F64(&'a mut [f64]),
    U32(&'a mut [u32]),
    U64(&'a mut [u64]),
    I64(&'a mut [i64]),
    U8(&'a mut [u8]),
}

/// The one place a [`Buf`]'s or [`BufMut`]'s tag meets its type, so generic
/// code sees `[T]`:
/// - `typed!(Kind, buf, s => body)`: `body` with `s` bound to the typed
///   slice inside `buf`, a [`Buf`] or [`BufMut`] (`Kind`), once per type;
/// - `typed!(pair "what", input, out, i, o => body)`: the same for an input
///   [`Buf`] and an output [`BufMut`] that must hold the same type (a
///   mismatch is an error naming `what`);
/// - `typed!(comm_methods)`: a [`Comm`](super::Comm)'s six typed-buffer
///   methods (`all_reduce_buf`, `reduce_scatter_buf`, `all_gather_buf`,
///   `broadcast_buf`, `send_buf`, `recv_buf`), each handing its slices to
///   the implementation's generic `*_typed` method of the same name.
macro_rules! typed {
    (comm_methods) => {
        fn all_reduce_buf(&self, buf: $crate::comm::BufMut<'_>) -> $crate::error::Result<()> {
            $crate::comm::elem::typed!(BufMut, buf, b => self.all_reduce_typed(b))
        }

        fn reduce_scatter_buf(
            &self,
            input: $crate::comm::Buf<'_>,
            out: $crate::comm::BufMut<'_>,
        ) -> $crate::error::Result<()> {
            $crate::comm::elem::typed!(pair "reduce_scatter", input, out, i, o => self.reduce_scatter_typed(i, o))
        }

        fn all_gather_buf(
            &self,
            input: $crate::comm::Buf<'_>,
            out: $crate::comm::BufMut<'_>,
        ) -> $crate::error::Result<()> {
            $crate::comm::elem::typed!(pair "all_gather", input, out, i, o => self.all_gather_typed(i, o))
        }

        fn broadcast_buf(&self, buf: $crate::comm::BufMut<'_>, root: usize) -> $crate::error::Result<()> {
            $crate::comm::elem::typed!(BufMut, buf, b => self.broadcast_typed(b, root))
        }

        fn send_buf(&self, buf: $crate::comm::Buf<'_>, to: usize) -> $crate::error::Result<()> {
            $crate::comm::elem::typed!(Buf, buf, b => self.send_typed(b, to))
        }

        fn recv_buf(&self, buf: $crate::comm::BufMut<'_>, from: usize) -> $crate::error::Result<()> {
            $crate::comm::elem::typed!(BufMut, buf, b => self.recv_typed(b, from))
        }
    };
    (pair $what:literal, $input:expr, $out:expr, $i:ident, $o:ident => $body:expr) => {
        match ($input, $out) {
            ($crate::comm::Buf::F32($i), $crate::comm::BufMut::F32($o)) => $body,
            ($crate::comm::Buf::F64($i), $crate::comm::BufMut::F64($o)) => $body,
            ($crate::comm::Buf::U32($i), $crate::comm::BufMut::U32($o)) => $body,
            ($crate::comm::Buf::U64($i), $crate::comm::BufMut::U64($o)) => $body,
            ($crate::comm::Buf::I64($i), $crate::comm::BufMut::I64($o)) => $body,
            ($crate::comm::Buf::U8($i), $crate::comm::BufMut::U8($o)) => $body,
            (i, o) => Err($crate::error::Error::Comm(format!(
                "{}: input holds {} but output holds {}",
                $what,
                i.dtype(),
                o.dtype()
            ))),
        }
    };
    ($kind:ident, $buf:expr, $s:ident => $body:expr) => {
        match $buf {
            $crate::comm::$kind::F32($s) => $body,
            $crate::comm::$kind::F64($s) => $body,
            $crate::comm::$kind::U32($s) => $body,
            $crate::comm::$kind::U64($s) => $body,
            $crate::comm::$kind::I64($s) => $body,
            $crate::comm::$kind::U8($s) => $body,
        }
    };
}

pub(crate) use typed;

impl Buf<'_> {
    pub fn dtype(&self) -> DType {
        typed!(Buf, self, s => elem_dtype(s))
    }
}

impl BufMut<'_> {
    pub fn dtype(&self) -> DType {
        typed!(BufMut, self, s => elem_dtype(s))
    }
}

fn elem_dtype<T: CommElem>(_: &[T]) -> DType {
    T::DTYPE
}

mod sealed {
    pub trait Sealed {}
}

/// An element type collectives can move: f32, f64, u32, u64, i64 or u8.
/// Sealed: each has a [`DType`], a wire format and a sum every backend
/// implements.
pub trait CommElem:
    sealed::Sealed + Copy + Default + PartialEq + fmt::Debug + Send + Sync + 'static
{
    const DTYPE: DType;
    fn buf(s: &[Self]) -> Buf<'_>;
    fn buf_mut(s: &mut [Self]) -> BufMut<'_>;
    /// The sum all-reduce and reduce-scatter take: IEEE addition for floats
    /// (applied in rank order, so every rank gets the same bits), wrapping
    /// addition for integers (u8 sums wrap past 255: use u32 for counts).
    fn add(self, x: Self) -> Self;
}

macro_rules! elem {
    ($t:ty, $v:ident, |$a:ident, $b:ident| $add:expr) => {
        impl sealed::Sealed for $t {}
        impl CommElem for $t {
            const DTYPE: DType = DType::$v;
            fn buf(s: &[Self]) -> Buf<'_> {
                Buf::$v(s)
            }
            fn buf_mut(s: &mut [Self]) -> BufMut<'_> {
                BufMut::$v(s)
            }
            fn add(self, $b: Self) -> Self {
                let $a = self;
                $add
            }
        }
    };
}

elem!(f32, F32, |a, b| a + b);
elem!(f64, F64, |a, b| a + b);
elem!(u32, U32, |a, b| a.wrapping_add(b));
elem!(u64, U64, |a, b| a.wrapping_add(b));
elem!(i64, I64, |a, b| a.wrapping_add(b));
elem!(u8, U8, |a, b| a.wrapping_add(b));
