//! Collectives on device buffers. Where the backend's memory is host memory
//! (the CPU) the views go to the group as they are; otherwise the data is
//! staged through host vectors. A device-native group (NCCL) takes the views
//! directly instead.

use super::Comm;
use crate::backend::{Backend, Dst, Src};
use crate::error::Result;

/// buf = sum over ranks of buf.
pub fn all_reduce<B: Backend>(g: &dyn Comm, be: &B, mut buf: Dst<'_, B>) -> Result<()> {
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
    if let (Some(i), Some(o)) = (be.host(input), be.host_mut(out.rb())) {
        return g.all_gather(i, o);
    }
    let staged = be.to_host(input)?;
    let mut all = vec![0.0; out.len()];
    g.all_gather(&staged, &mut all)?;
    be.upload(out, &all)
}
