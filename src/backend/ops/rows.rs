//! Rows of one matrix copied into, or added onto, rows of another at other
//! strides, in one pass (`kernels/rows.cu` on a GPU): BERT's classifier
//! reads each sequence's first row and sends its gradient back there, one
//! launch where a copy a sequence was one each.

use super::{need, Checked, Host, Kernel, Lower, Operands, Queued};
use crate::backend::gpu::{groups, u32s, Arg, Queue, Raw, Runtime};

operation! {
    /// dst row i (`w` elements from i x `dst_stride`) = src row i (from
    /// i x `src_stride`), for i < `rows`; with `add`, dst row i += it.
    pub struct CopyRows<O> {
        output dst: f32,
        input src: f32,
        value rows: usize,
        value w: usize,
        value dst_stride: usize,
        value src_stride: usize,
        value add: bool,
    }
}

impl<O: Operands> Kernel<O> for CopyRows<O> {
    const NAME: &'static str = "copy_rows";

    fn check(&self) -> Result<(), String> {
        let (rows, w) = (self.rows, self.w);
        if rows == 0 {
            return Ok(());
        }
        if rows > 1 && w > self.dst_stride {
            return Err(format!(
                "rows of {w} written {} apart overlap",
                self.dst_stride
            ));
        }
        let extent = |stride: usize| (rows - 1) * stride + w;
        need("dst", &self.dst, extent(self.dst_stride))?;
        need("src", &self.src, extent(self.src_stride))
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        let CopyRows {
            dst,
            src,
            rows,
            w,
            dst_stride,
            src_stride,
            add,
        } = self.lower(host);
        for i in 0..rows {
            let d = &mut dst[i * dst_stride..i * dst_stride + w];
            let s = &src[i * src_stride..i * src_stride + w];
            match add {
                true => d.iter_mut().zip(s).for_each(|(d, s)| *d += s),
                false => d.copy_from_slice(s),
            }
        }
    }

    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let args = [
            Arg::View(op.dst),
            Arg::View(op.src),
            u32s("rows", op.rows)?,
            u32s("w", op.w)?,
            u32s("dst_stride", op.dst_stride)?,
            u32s("src_stride", op.src_stride)?,
            Arg::U32(u32::from(op.add)),
        ];
        q.launch("rows_copy", groups(op.rows * op.w), &args)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::Cpu;
    use crate::backend::{Category, Device, Dst, Kernels};

    #[test]
    fn rows_land_at_their_strides_and_overlap_is_refused() {
        let be = Cpu::new();
        // src: 3 rows of 2 every 3; dst: rows every 4
        let src: Vec<f32> = (1..=8).map(|x| x as f32).collect();
        let (mut dst, mut s) = (
            be.alloc(11, Category::Other).unwrap(),
            be.alloc(8, Category::Other).unwrap(),
        );
        be.upload(dst.d(), &[0.5; 11]).unwrap();
        be.upload(s.d(), &src).unwrap();
        let run = |dst: Dst<'_, Cpu>, dst_stride, add| {
            be.run(CopyRows {
                dst,
                src: s.slice(0..8),
                rows: 3,
                w: 2,
                dst_stride,
                src_stride: 3,
                add,
            })
        };
        run(dst.slice_mut(1..11), 4, false).unwrap();
        let once = [0.5, 1., 2., 0.5, 0.5, 4., 5., 0.5, 0.5, 7., 8.];
        assert_eq!(be.to_host(dst.slice(0..11)).unwrap(), once);
        run(dst.slice_mut(1..11), 4, true).unwrap();
        let twice: Vec<f32> = once
            .iter()
            .map(|&x| if x == 0.5 { x } else { 2.0 * x })
            .collect();
        assert_eq!(be.to_host(dst.slice(0..11)).unwrap(), twice);
        // one element short of the last row, and rows written over each other
        let e = run(dst.slice_mut(2..11), 4, false).unwrap_err();
        assert!(
            e.to_string().contains("dst: view of 9 elements, need 10"),
            "{e}"
        );
        let e = run(dst.slice_mut(0..11), 1, false).unwrap_err();
        assert!(
            e.to_string().contains("rows of 2 written 1 apart overlap"),
            "{e}"
        );
        // one row overlaps nothing, whatever its stride
        let one = CopyRows {
            dst: dst.slice_mut(0..2),
            src: s.slice(0..2),
            rows: 1,
            w: 2,
            dst_stride: 1,
            src_stride: 1,
            add: false,
        };
        be.run(one).unwrap();
        assert_eq!(be.to_host(dst.slice(0..2)).unwrap(), [1.0, 2.0]);
    }
}
