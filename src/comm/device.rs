//! Collectives on device buffers. A device-native group (NCCL) takes the
//! views' device addresses when the backend has them (CUDA); where the
//! backend's memory is host memory (the CPU) the views go to the group as
//! they are; otherwise the data is staged through host vectors.

use super::Comm;
use crate::backend::{Backend, Dst, RawView, Src};
use crate::error::{Error, Result};

/// f32 collectives on device memory given by address, each complete (the
/// data in place) when it returns.
///
/// # Safety
/// Every address is of live device memory of the group's device holding
/// the number of floats the method names; the backend's work on it has
/// finished.
pub trait DeviceCollectives {
    /// `n` floats at `buf` = their sum over ranks.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn all_reduce_f32(&self, buf: u64, n: usize) -> Result<()>;
    /// `n_out` floats at `out` = this rank's slice of the sum of every
    /// rank's `n_out * size` floats at `input`.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn reduce_scatter_f32(&self, input: u64, out: u64, n_out: usize) -> Result<()>;
    /// `n_in * size` floats at `out` = every rank's `n_in` floats at `input`, in rank order.
    ///
    /// # Safety
    /// See the trait.
    unsafe fn all_gather_f32(&self, input: u64, out: u64, n_in: usize) -> Result<()>;
}

/// Errors unless `long` holds `short` once per rank of `g`.
fn check_sizes(g: &dyn Comm, what: &str, long: usize, short: usize) -> Result<()> {
    if long != short * g.size() {
        return Err(Error::Comm(format!(
            "{what}: {long} elements for {short} on each of {} ranks",
            g.size()
        )));
    }
    Ok(())
}

/// The group's device-native collectives and the views' addresses, when
/// both exist; the backend's queued work is finished first, so the
/// collective reads what the kernels wrote.
fn native<'g, B: Backend, const N: usize>(
    g: &'g dyn Comm,
    be: &B,
    views: [RawView; N],
) -> Result<Option<(&'g dyn DeviceCollectives, [u64; N])>> {
    let Some(nc) = g.device_native() else {
        return Ok(None);
    };
    let mut addrs = [0u64; N];
    for (a, v) in addrs.iter_mut().zip(views) {
        match be.device_address(v, size_of::<f32>()) {
            Some(x) => *a = x,
            None => return Ok(None),
        }
    }
    be.synchronize()?;
    Ok(Some((nc, addrs)))
}

/// buf = sum over ranks of buf.
pub fn all_reduce<B: Backend>(g: &dyn Comm, be: &B, mut buf: Dst<'_, B>) -> Result<()> {
    if let Some((nc, [a])) = native(g, be, [buf.raw()])? {
        // SAFETY: `a` addresses `buf`'s floats (a live view), its queue has finished.
        return unsafe { nc.all_reduce_f32(a, buf.len()) };
    }
    if let Some(host) = be.host_mut(buf.rb()) {
        return g.all_reduce(host);
    }
    let mut staged = be.to_host(buf.src())?;
    g.all_reduce(&mut staged)?;
    be.upload(buf, &staged)
}

/// out (len n) = this rank's slice of the sum of every rank's input (len n * size).
pub fn reduce_scatter<B: Backend>(
    g: &dyn Comm,
    be: &B,
    input: Src<'_, B>,
    mut out: Dst<'_, B>,
) -> Result<()> {
    check_sizes(g, "reduce_scatter", input.len(), out.len())?;
    if let Some((nc, [i, o])) = native(g, be, [input.raw(), out.raw()])? {
        // SAFETY: as in `all_reduce`, with the sizes just checked.
        return unsafe { nc.reduce_scatter_f32(i, o, out.len()) };
    }
    if let (Some(i), Some(o)) = (be.host(input), be.host_mut(out.rb())) {
        return g.reduce_scatter(i, o);
    }
    let staged = be.to_host(input)?;
    let mut part = vec![0.0; out.len()];
    g.reduce_scatter(&staged, &mut part)?;
    be.upload(out, &part)
}

/// out (len n * size) = every rank's input (len n), in rank order.
pub fn all_gather<B: Backend>(
    g: &dyn Comm,
    be: &B,
    input: Src<'_, B>,
    mut out: Dst<'_, B>,
) -> Result<()> {
    check_sizes(g, "all_gather", out.len(), input.len())?;
    if let Some((nc, [i, o])) = native(g, be, [input.raw(), out.raw()])? {
        // SAFETY: as in `all_reduce`, with the sizes just checked.
        return unsafe { nc.all_gather_f32(i, o, input.len()) };
    }
    if let (Some(i), Some(o)) = (be.host(input), be.host_mut(out.rb())) {
        return g.all_gather(i, o);
    }
    let staged = be.to_host(input)?;
    let mut all = vec![0.0; out.len()];
    g.all_gather(&staged, &mut all)?;
    be.upload(out, &all)
}
