//! Byte accounting by category: distgpt's `max_memory_allocated`.
//!
//! Every buffer a backend hands out is tagged with a [`Category`]; the stats
//! track current and peak bytes per category and the peak of the total.
//! Buffers live on the backend's device; kernels see them through views.

use super::{Device, Elem};
use crate::error::Result;
use serde::Serialize;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut, Range};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

crate::named_enum! {
    /// What a buffer holds, for the per-category memory report.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Category {
        Params = "params",
        Grads = "grads",
        Optimizer = "optimizer",
        Activations = "activations",
        Other = "other",
    }
    /// As the memory report names it.
    fn name
}

/// Live counters shared by a backend and every buffer it allocated.
#[derive(Default, Debug)]
pub struct MemoryStats {
    current_bytes: [AtomicU64; 5],
    peak_bytes: [AtomicU64; 5],
    total_bytes: AtomicU64,
    peak_total_bytes: AtomicU64,
}

/// A snapshot of [`MemoryStats`], in bytes.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct MemoryReport {
    pub current_bytes: CategoryBytes,
    pub peak_bytes: CategoryBytes,
    pub peak_total_bytes: u64,
    /// The driver's free and total bytes of the device, where it says (CUDA).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free_total: Option<(u64, u64)>,
    /// Under offload, what the rank holds in host memory, by category.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<Box<MemoryReport>>,
}

/// Bytes per category.
#[derive(Clone, Debug, Default, Serialize, serde::Deserialize)]
pub struct CategoryBytes {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub other: u64,
}

/// A rank's peak bytes, by category and in all (the peaks need not have
/// come at one moment: `total` is the peak of the sum). Written as the
/// array `[params, grads, optimizer, activations, other, total]` in JSON
/// and between ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(from = "[u64; 6]", into = "[u64; 6]")]
pub struct PeakRow {
    pub params: u64,
    pub grads: u64,
    pub optimizer: u64,
    pub activations: u64,
    pub other: u64,
    pub total: u64,
}

impl From<[u64; 6]> for PeakRow {
    fn from([params, grads, optimizer, activations, other, total]: [u64; 6]) -> Self {
        PeakRow {
            params,
            grads,
            optimizer,
            activations,
            other,
            total,
        }
    }
}

impl PeakRow {
    /// Its columns in a CSV report, and their [`PeakRow::csv`] values.
    pub const CSV_HEADER: &str = "peak_params_bytes,peak_grads_bytes,peak_optimizer_bytes,peak_activations_bytes,peak_other_bytes,peak_total_bytes";

    pub fn csv(&self) -> String {
        <[u64; 6]>::from(*self).map(|b| b.to_string()).join(",")
    }
}

impl From<PeakRow> for [u64; 6] {
    fn from(p: PeakRow) -> Self {
        [
            p.params,
            p.grads,
            p.optimizer,
            p.activations,
            p.other,
            p.total,
        ]
    }
}

impl PeakRow {
    /// Elements a row takes between ranks.
    pub const LEN: usize = 6;

    /// Rows from what an all-gather of [`PeakRow::LEN`] elements a rank gave.
    pub fn rows(gathered: &[u64]) -> Vec<PeakRow> {
        gathered
            .chunks_exact(Self::LEN)
            .map(|c| <[u64; 6]>::try_from(c).expect("six elements").into())
            .collect()
    }

    /// The row with the largest total (zeros for none): the job's
    /// busiest rank.
    pub fn largest(rows: &[PeakRow]) -> PeakRow {
        rows.iter()
            .copied()
            .max_by_key(|p| p.total)
            .unwrap_or_default()
    }
}

impl MemoryReport {
    /// This report's peaks.
    pub fn peak_row(&self) -> PeakRow {
        let p = &self.peak_bytes;
        PeakRow {
            params: p.params,
            grads: p.grads,
            optimizer: p.optimizer,
            activations: p.activations,
            other: p.other,
            total: self.peak_total_bytes,
        }
    }
}

impl CategoryBytes {
    fn from_counters(c: &[AtomicU64; 5]) -> Self {
        let g = |i: usize| c[i].load(Ordering::Relaxed);
        CategoryBytes {
            params: g(0),
            grads: g(1),
            optimizer: g(2),
            activations: g(3),
            other: g(4),
        }
    }

    pub fn total(&self) -> u64 {
        self.params + self.grads + self.optimizer + self.activations + self.other
    }
}

impl MemoryStats {
    fn add(&self, cat: Category, bytes: u64) {
        let i = cat as usize;
        let now = self.current_bytes[i].fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_bytes[i].fetch_max(now, Ordering::Relaxed);
        let total = self.total_bytes.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak_total_bytes.fetch_max(total, Ordering::Relaxed);
    }

    fn sub(&self, cat: Category, bytes: u64) {
        self.current_bytes[cat as usize].fetch_sub(bytes, Ordering::Relaxed);
        self.total_bytes.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub fn report(&self) -> MemoryReport {
        MemoryReport {
            current_bytes: CategoryBytes::from_counters(&self.current_bytes),
            peak_bytes: CategoryBytes::from_counters(&self.peak_bytes),
            peak_total_bytes: self.peak_total_bytes.load(Ordering::Relaxed),
            device_free_total: None,
            host: None,
        }
    }
}

/// A buffer of `len` elements on a backend's device, counted in a
/// [`MemoryStats`] while it lives. The kernels read it through [`Src`] views
/// and write it through [`Dst`] views; the host reads and writes it only
/// through the backend's explicit transfers.
pub struct Buf<B: Device, T: Elem = f32> {
    mem: B::Mem<T>,
    len: usize,
    category: Category,
    stats: Arc<MemoryStats>,
}

impl<B: Device, T: Elem> Buf<B, T> {
    /// Wraps storage a backend allocated (zero-filled) and counts its bytes.
    /// Crate-only: views trust `len` to be the storage's length.
    pub(crate) fn new(
        mem: B::Mem<T>,
        len: usize,
        category: Category,
        stats: Arc<MemoryStats>,
    ) -> Self {
        stats.add(category, (len * std::mem::size_of::<T>()) as u64);
        Buf {
            mem,
            len,
            category,
            stats,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// All of the buffer, read-only.
    pub fn s(&self) -> Src<'_, B, T> {
        self.slice(0..self.len)
    }

    /// Elements `r`, read-only.
    pub fn slice(&self, r: Range<usize>) -> Src<'_, B, T> {
        let handle = B::handle(&self.mem);
        Src::at(RawView::whole(handle, self.len).sub(r))
    }

    /// All of the buffer, writable.
    pub fn d(&mut self) -> Dst<'_, B, T> {
        self.slice_mut(0..self.len)
    }

    /// Elements `r`, writable.
    pub fn slice_mut(&mut self, r: Range<usize>) -> Dst<'_, B, T> {
        let handle = B::handle_mut(&mut self.mem);
        Dst::at(RawView::whole(handle, self.len).sub(r))
    }
}

impl<B: Device, T: Elem> Drop for Buf<B, T> {
    fn drop(&mut self) {
        self.stats
            .sub(self.category, (self.len * std::mem::size_of::<T>()) as u64);
    }
}

/// Where a view points: the backend's handle of the whole buffer (a host
/// pointer, a `cl_mem`, a device pointer) and an element range in it.
#[derive(Clone, Copy, Debug)]
pub struct RawView {
    pub handle: usize,
    pub off: usize,
    pub len: usize,
}

impl RawView {
    /// All `len` elements of the buffer behind `handle`.
    fn whole(handle: usize, len: usize) -> RawView {
        RawView {
            handle,
            off: 0,
            len,
        }
    }

    /// Elements `r` of this view; a range outside it panics.
    fn sub(self, r: Range<usize>) -> RawView {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "view {}..{} outside a buffer of {}",
            r.start,
            r.end,
            self.len
        );
        RawView {
            handle: self.handle,
            off: self.off + r.start,
            len: r.len(),
        }
    }
}

/// What [`Src`] and [`Dst`] both offer: their length, the raw view, and
/// views of their parts.
macro_rules! view_methods {
    ($view:ident) => {
        impl<'a, B, T> $view<'a, B, T> {
            fn at(raw: RawView) -> Self {
                $view {
                    raw,
                    _borrow: PhantomData,
                }
            }

            pub fn len(&self) -> usize {
                self.raw.len
            }

            pub fn is_empty(&self) -> bool {
                self.raw.len == 0
            }

            pub fn raw(&self) -> RawView {
                self.raw
            }

            /// Elements `r` of this view.
            pub fn slice(self, r: Range<usize>) -> Self {
                Self::at(self.raw.sub(r))
            }

            /// The first `n` elements.
            pub fn first(self, n: usize) -> Self {
                self.slice(0..n)
            }

            /// Piece `i` of this view cut in pieces of `n`.
            pub fn part(self, i: usize, n: usize) -> Self {
                self.slice(i * n..(i + 1) * n)
            }
        }
    };
}

/// What a [`Src`] holds on to: a shared borrow of `T`s of backend `B`.
type Shared<'a, B, T> = (&'a [T], fn() -> B);
/// What a [`Dst`] holds on to: an exclusive borrow.
type Exclusive<'a, B, T> = (&'a mut [T], fn() -> B);

/// A read-only view of part of a [`Buf`], borrowed from it for `'a`.
pub struct Src<'a, B, T = f32> {
    raw: RawView,
    _borrow: PhantomData<Shared<'a, B, T>>,
}

impl<B, T> Clone for Src<'_, B, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B, T> Copy for Src<'_, B, T> {}

view_methods!(Src);

impl<'a, B, T> Src<'a, B, T> {
    /// Elements from `at` on.
    pub fn from(self, at: usize) -> Src<'a, B, T> {
        self.slice(at..self.raw.len)
    }
}

/// A writable view of part of a [`Buf`], borrowed from it for `'a`; split
/// it to write disjoint parts at once.
pub struct Dst<'a, B, T = f32> {
    raw: RawView,
    _borrow: PhantomData<Exclusive<'a, B, T>>,
}

view_methods!(Dst);

impl<'a, B, T> Dst<'a, B, T> {
    /// Two disjoint views: `..mid` and `mid..`.
    pub fn split_at(self, mid: usize) -> (Dst<'a, B, T>, Dst<'a, B, T>) {
        let raw = self.raw;
        (Dst::at(raw.sub(0..mid)), Dst::at(raw.sub(mid..raw.len)))
    }

    /// Two disjoint views at ranges `a` and `b`, in either order.
    pub fn split2(self, a: Range<usize>, b: Range<usize>) -> (Dst<'a, B, T>, Dst<'a, B, T>) {
        if b.end <= a.start {
            let (b, a) = self.split2(b, a);
            return (a, b);
        }
        assert!(a.end <= b.start, "split2 needs disjoint ranges");
        let (lo, hi) = self.split_at(b.start);
        (lo.slice(a), hi.slice(0..b.len()))
    }

    /// A shorter-lived view of the same elements, leaving this one usable after.
    pub fn rb(&mut self) -> Dst<'_, B, T> {
        Dst::at(self.raw)
    }

    /// The same elements, read-only, for as long as this view is borrowed.
    pub fn src(&self) -> Src<'_, B, T> {
        Src::at(self.raw)
    }

    /// This view turned read-only for the rest of its lifetime.
    pub fn into_src(self) -> Src<'a, B, T> {
        Src::at(self.raw)
    }
}

/// A host vector counted in a [`MemoryStats`] while it lives: a backend's
/// own host-side storage (the CPU's buffers, its packed decode weights).
pub struct HostBuf<T> {
    data: Vec<T>,
    category: Category,
    stats: Arc<MemoryStats>,
}

impl<T: Copy + Default> HostBuf<T> {
    pub fn zeros(len: usize, category: Category, stats: Arc<MemoryStats>) -> Self {
        stats.add(category, (len * std::mem::size_of::<T>()) as u64);
        HostBuf {
            data: host_zeros(len),
            category,
            stats,
        }
    }
}

/// Transparent huge pages: 2 MiB on x86-64.
pub const HUGE_PAGE: usize = 2 << 20;

/// A zeroed host vector. One that spans a whole huge page asks Linux to
/// back it with transparent huge pages (`madvise(MADV_HUGEPAGE)`) before
/// anything touches it: a fresh zeroed allocation is untouched memory, so
/// its pages fault in huge where the system leaves the choice to the
/// program (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the
/// usual default) and has free 2 MiB pages to give; memory the allocator
/// reuses was touched already and keeps its 4 KiB pages. A training step streams through hundreds of MiB of
/// activations and the update through every parameter and moment: on
/// 4 KiB pages the translation misses cost a step 0.6% (a 10M-parameter
/// model) to 3.5% (GPT-2 124M; BENCHMARKS.md).
pub fn host_zeros<T: Copy + Default>(len: usize) -> Vec<T> {
    let v = vec![T::default(); len];
    advise_huge_pages(&v);
    v
}

/// Asks for huge pages on the whole huge pages inside `data`; advice only,
/// so it is a no-op where the kernel declines it or is not Linux.
fn advise_huge_pages<T>(data: &[T]) {
    #[cfg(target_os = "linux")]
    {
        let start = data.as_ptr() as usize;
        let end = start + std::mem::size_of_val(data);
        let (lo, hi) = (
            start.next_multiple_of(HUGE_PAGE),
            end / HUGE_PAGE * HUGE_PAGE,
        );
        if lo < hi {
            // SAFETY: [lo, hi) lies inside `data`'s allocation; the advice
            // changes how its pages are backed, never their contents.
            unsafe {
                libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE);
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = data;
}

impl<T> Deref for HostBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T> DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.data
    }
}

impl<T> Drop for HostBuf<T> {
    fn drop(&mut self) {
        self.stats
            .sub(self.category, std::mem::size_of_val(&*self.data) as u64);
    }
}

/// A device-to-host copy under way ([`Device::download_start`]): its
/// elements have landed once [`Pending::wait`] returns; dropping it waits
/// too, so the host memory it writes is never freed under it.
pub struct Pending {
    wait: Option<Box<dyn FnOnce() -> Result<()> + Send>>,
}

impl Pending {
    /// A copy that has already landed.
    pub fn landed() -> Self {
        Pending { wait: None }
    }

    /// A copy that has landed once `wait` returns.
    pub fn new(wait: impl FnOnce() -> Result<()> + Send + 'static) -> Self {
        Pending {
            wait: Some(Box::new(wait)),
        }
    }

    /// Waits until the copy has landed; its error, if it failed.
    pub fn wait(mut self) -> Result<()> {
        self.wait.take().map_or(Ok(()), |w| w())
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        // an error has no one to go to here; a dropped copy is one whose
        // destination is being given up
        if let Some(w) = self.wait.take() {
            let _ = w();
        }
    }
}

/// Host memory made a target of copies that do not block the host
/// ([`Device::pin`]: page-locked on CUDA); released again on drop.
pub struct Pinned {
    _release: Option<Box<dyn Send + Sync>>,
}

impl Pinned {
    /// Memory the device needs no pinning for.
    pub fn unneeded() -> Self {
        Pinned { _release: None }
    }

    /// Pinned memory that `release`, when dropped, releases.
    pub fn new(release: impl Send + Sync + 'static) -> Self {
        Pinned {
            _release: Some(Box::new(release)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_row_is_the_one_with_the_largest_total() {
        let row = |params, total| PeakRow {
            params,
            total,
            ..PeakRow::default()
        };
        let rows = [row(9, 5), row(1, 9), row(7, 7)];
        assert_eq!(PeakRow::largest(&rows), row(1, 9));
        assert_eq!(PeakRow::largest(&[]), PeakRow::default());
    }

    /// The value of `field` (`AnonHugePages`, `VmFlags`) for the mapping
    /// in `/proc/self/smaps` that holds `addr`.
    #[cfg(target_os = "linux")]
    fn smaps_field_at(addr: usize, field: &str) -> String {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let range = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = range.split_once('-') {
                if let (Ok(lo), Ok(hi)) =
                    (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
                {
                    inside = (lo..hi).contains(&addr);
                    continue;
                }
            }
            let value = line.strip_prefix(field).and_then(|l| l.strip_prefix(':'));
            if let Some(value) = value.filter(|_| inside) {
                return value.trim().to_string();
            }
        }
        panic!("no mapping holds {addr:#x}")
    }

    /// The advice is what the code controls: the mapping that holds a large
    /// buffer's middle carries `hg` (`MADV_HUGEPAGE`). Whether the kernel
    /// then finds free 2 MiB pages depends on the machine's fragmentation
    /// (CI once got none), so the pages themselves are reported, not
    /// asserted.
    #[cfg(target_os = "linux")]
    #[test]
    fn large_host_buffers_ask_for_huge_pages() {
        let mut v: Vec<f32> = host_zeros(4 * HUGE_PAGE / 4);
        v.iter_mut().for_each(|x| *x = 1.0);
        let middle = v.as_ptr() as usize + std::mem::size_of_val(&v[..]) / 2;
        let flags = smaps_field_at(middle, "VmFlags");
        assert!(
            flags.split_whitespace().any(|f| f == "hg"),
            "an 8 MiB buffer's mapping was not advised huge (VmFlags: {flags})"
        );
        eprintln!(
            "an 8 MiB buffer holds {} of huge pages",
            smaps_field_at(middle, "AnonHugePages")
        );
    }

    #[test]
    fn peak_survives_free_and_categories_are_separate() {
        let stats = Arc::new(MemoryStats::default());
        let a = HostBuf::<f32>::zeros(100, Category::Params, stats.clone());
        {
            let _b = HostBuf::<f32>::zeros(50, Category::Activations, stats.clone());
            assert_eq!(stats.report().current_bytes.total(), 600);
        }
        let r = stats.report();
        assert_eq!(r.current_bytes.params, 400);
        assert_eq!(r.current_bytes.activations, 0);
        assert_eq!(r.peak_bytes.activations, 200);
        assert_eq!(r.peak_total_bytes, 600);
        drop(a);
        assert_eq!(stats.report().current_bytes.total(), 0);
        let half = HostBuf::<u16>::zeros(10, Category::Params, stats.clone());
        assert_eq!(stats.report().current_bytes.params, 20);
        drop(half);
        assert_eq!(stats.report().current_bytes.total(), 0);
    }
}
