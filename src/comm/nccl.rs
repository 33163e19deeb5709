//! NCCL groups for GPU ranks (feature `cuda`, `--comm nccl`): one rank per
//! GPU, thread ranks of one process or processes under `mpirun`. A host
//! group (the thread ranks' local group, or MPI) carries what is small or
//! on the host (flags, losses, paths, the barrier) and hands out NCCL's
//! unique id; the gradients, shards and gathers that live on the GPU go
//! through NCCL by device address (`comm::device`), with no staging copy.
//! Each collective runs on a stream of its own after the backend's queue
//! has finished, and is complete when it returns.
//!
//! No rank waits on NCCL for ever: a collective's stream is polled, not
//! synchronised, and when a thread rank of the launch fails (the host
//! group's mark) or `--comm-timeout` passes first, the rank aborts its
//! communicator and returns an error naming the collective. Under mpirun
//! the rank's error then ends the job (MPI_Abort). Not polled: the
//! communicator's creation (`ncclCommInitRank`, blocking), where a rank
//! that fails inside it leaves the others waiting.
//!
//! Unverified here: no machine this is developed on has a GPU. It builds
//! and lints in CI; `scripts/gpu_check.sh` runs it where GPUs exist.

use super::device::DeviceCollectives;
use super::{record, Buf, BufMut, Comm, CommStats, Kind};
use crate::error::{Error, Result};
use cudarc::driver::{sys as sys_driver, CudaContext, CudaEvent, CudaStream, DriverError};
use cudarc::nccl::result::{self as nccl, NcclError, NcclStatus};
use cudarc::nccl::sys;
use std::ffi::{c_int, c_void, CStr};
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn nccl_error(what: &str) -> impl Fn(NcclError) -> Error + '_ {
    move |e| {
        // SAFETY: NCCL returns a static string for every result code.
        let text = unsafe { CStr::from_ptr(sys::ncclGetErrorString(e.0)) };
        Error::Comm(format!("NCCL {what} failed: {}", text.to_string_lossy()))
    }
}

fn driver_error(what: &str) -> impl Fn(DriverError) -> Error + '_ {
    move |e| Error::Device(format!("CUDA {what} failed (for NCCL): {e}"))
}

/// The NCCL communicator, destroyed on drop unless aborted; calls on it
/// are serialised.
struct RawComm {
    comm: sys::ncclComm_t,
    aborted: bool,
}

// SAFETY: the communicator is only used under `NcclComm::raw`'s mutex.
unsafe impl Send for RawComm {}

impl Drop for RawComm {
    fn drop(&mut self) {
        // SAFETY: created by `comm_init_rank`, destroyed once (an aborted
        // one is freed by its abort).
        if !self.aborted {
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }
}

/// A group whose device collectives are NCCL's and the rest the host group's.
pub struct NcclComm {
    host: Box<dyn Comm>,
    raw: Mutex<RawComm>,
    stream: Arc<CudaStream>,
    /// Recorded after each collective, polled until it completes.
    done: CudaEvent,
    gpu: usize,
    /// How long a collective may wait for the other ranks (`--comm-timeout`).
    timeout: Duration,
    stats: Mutex<CommStats>,
}

impl NcclComm {
    /// Joins every rank of `host` into one NCCL communicator on GPU `gpu`
    /// (each rank its own GPU): rank 0's unique id goes to the others over
    /// `host`; a collective waits at most `timeout`. Collective: every rank
    /// of `host` must call it.
    pub fn new(host: Box<dyn Comm>, gpu: usize, timeout: Duration) -> Result<NcclComm> {
        crate::backend::cuda::check_nccl().map_err(|e| Error::Device(e.0))?;
        let ctx = CudaContext::new(gpu).map_err(driver_error("cuDevicePrimaryCtxRetain"))?;
        let mut id = [0u8; 128];
        if host.rank() == 0 {
            let uid = nccl::get_uniqueid().map_err(nccl_error("ncclGetUniqueId"))?;
            for (b, c) in id.iter_mut().zip(uid.internal) {
                *b = c as u8;
            }
        }
        host.broadcast(&mut id, 0)?;
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        for (c, b) in uid.internal.iter_mut().zip(id) {
            *c = b as std::ffi::c_char;
        }
        let int = |what: &str, n: usize| {
            c_int::try_from(n).map_err(|_| Error::Comm(format!("NCCL: {what} {n} exceeds an int")))
        };
        let (size, rank) = (int("group size", host.size())?, int("rank", host.rank())?);
        ctx.bind_to_thread()
            .map_err(driver_error("cuCtxSetCurrent"))?;
        let mut comm = MaybeUninit::uninit();
        // SAFETY: `comm` is written by NCCL before it is read; every rank
        // passes the same id and size and its own rank.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), size, uid, rank)
                .map_err(nccl_error("ncclCommInitRank"))?;
            comm.assume_init()
        };
        let raw = RawComm {
            comm,
            aborted: false,
        };
        let stream = ctx.new_stream().map_err(driver_error("cuStreamCreate"))?;
        let done = ctx
            .new_event(Some(sys_driver::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(driver_error("cuEventCreate"))?;
        Ok(NcclComm {
            host,
            raw: Mutex::new(raw),
            stream,
            done,
            gpu,
            timeout,
            stats: Mutex::default(),
        })
    }

    /// Runs one NCCL call on the group's stream and waits for it, polling:
    /// a failed rank or the timeout aborts the communicator.
    fn run(
        &self,
        what: &str,
        kind: Kind,
        full_bytes: usize,
        call: impl FnOnce(
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<NcclStatus, NcclError>,
    ) -> Result<()> {
        let started = Instant::now();
        let mut raw = self.raw.lock().unwrap_or_else(|e| e.into_inner());
        if raw.aborted {
            return Err(Error::Comm(format!(
                "{what}: this rank's NCCL group was aborted by an earlier failure"
            )));
        }
        self.stream
            .context()
            .bind_to_thread()
            .map_err(driver_error("cuCtxSetCurrent"))?;
        call(raw.comm, self.stream.cu_stream() as sys::cudaStream_t).map_err(nccl_error(what))?;
        let finished = || {
            self.done
                .try_is_complete()
                .map_err(driver_error("cuEventQuery"))
        };
        let waited = self
            .done
            .record(&self.stream)
            .map_err(driver_error("cuEventRecord"))
            .and_then(|()| super::wait_until(what, self.timeout, finished, || self.failure()));
        if let Err(e) = waited {
            // SAFETY: the communicator is ours and is not used again
            // (`aborted`); the abort stops its kernels still waiting.
            let _ = unsafe { nccl::comm_abort(raw.comm) };
            raw.aborted = true;
            return Err(e);
        }
        record(&self.stats, kind, self.size(), full_bytes, started);
        Ok(())
    }
}

impl DeviceCollectives for NcclComm {
    unsafe fn all_reduce_f32(&self, buf: u64, n: usize) -> Result<()> {
        let p = buf as *mut c_void;
        self.run("ncclAllReduce", Kind::AllReduce, n * 4, |c, s| {
            // SAFETY: `buf` holds n floats on this rank's GPU (comm::device's views).
            unsafe {
                nccl::all_reduce(
                    p,
                    p,
                    n,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    c,
                    s,
                )
            }
        })
    }

    unsafe fn reduce_scatter_f32(&self, input: u64, out: u64, n_out: usize) -> Result<()> {
        let full = n_out * self.size();
        self.run(
            "ncclReduceScatter",
            Kind::ReduceScatter,
            full * 4,
            |c, s| {
                // SAFETY: `input` holds n_out * size floats and `out` n_out, on this GPU.
                unsafe {
                    nccl::reduce_scatter(
                        input as *const c_void,
                        out as *mut c_void,
                        n_out,
                        sys::ncclDataType_t::ncclFloat32,
                        sys::ncclRedOp_t::ncclSum,
                        c,
                        s,
                    )
                }
            },
        )
    }

    unsafe fn all_gather_f32(&self, input: u64, out: u64, n_in: usize) -> Result<()> {
        let full = n_in * self.size();
        self.run("ncclAllGather", Kind::AllGather, full * 4, |c, s| {
            // SAFETY: `input` holds n_in floats and `out` n_in * size, on this GPU.
            unsafe {
                nccl::all_gather(
                    input as *const c_void,
                    out as *mut c_void,
                    n_in,
                    sys::ncclDataType_t::ncclFloat32,
                    c,
                    s,
                )
            }
        })
    }
}

impl Comm for NcclComm {
    fn rank(&self) -> usize {
        self.host.rank()
    }
    fn size(&self) -> usize {
        self.host.size()
    }
    fn all_reduce_buf(&self, buf: BufMut<'_>) -> Result<()> {
        self.host.all_reduce_buf(buf)
    }
    fn reduce_scatter_buf(&self, input: Buf<'_>, out: BufMut<'_>) -> Result<()> {
        self.host.reduce_scatter_buf(input, out)
    }
    fn all_gather_buf(&self, input: Buf<'_>, out: BufMut<'_>) -> Result<()> {
        self.host.all_gather_buf(input, out)
    }
    fn broadcast_buf(&self, buf: BufMut<'_>, root: usize) -> Result<()> {
        self.host.broadcast_buf(buf, root)
    }
    fn send_buf(&self, buf: Buf<'_>, to: usize) -> Result<()> {
        self.host.send_buf(buf, to)
    }
    fn recv_buf(&self, buf: BufMut<'_>, from: usize) -> Result<()> {
        self.host.recv_buf(buf, from)
    }
    fn send_recv_buf(&self, send: Buf<'_>, to: usize, recv: BufMut<'_>, from: usize) -> Result<()> {
        self.host.send_recv_buf(send, to, recv, from)
    }
    fn barrier(&self) -> Result<()> {
        self.host.barrier()
    }
    fn barrier_after_io(&self) -> Result<()> {
        self.host.barrier_after_io()
    }
    /// The host group split, with an NCCL communicator of its own.
    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Comm>> {
        Ok(Box::new(NcclComm::new(
            self.host.split(color, key)?,
            self.gpu,
            self.timeout,
        )?))
    }
    fn stats(&self) -> CommStats {
        let mut s = self.host.stats();
        s.add(&self.stats.lock().unwrap_or_else(|e| e.into_inner()));
        s
    }
    fn shared_threads(&self) -> Option<usize> {
        self.host.shared_threads()
    }
    fn failure(&self) -> Option<String> {
        self.host.failure()
    }
    fn device_native(&self) -> Option<&dyn DeviceCollectives> {
        Some(self)
    }
}
