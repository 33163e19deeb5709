//! Token + position embedding, forward and backward, as kernels
//! (`kernels/encoder.cu` on a GPU).

use super::{need, Checked, Extent, Host, Kernel, Lower, Operands, Queued};
use crate::backend::cpu::math::SendPtr;
use crate::backend::gpu::{groups, u32_arg, u32s, Arg, Queue, Raw, Runtime};
use rayon::prelude::*;

operation! {
    /// `out (rows, C) = wte[tokens] + wpe[row % t]`; rows is `tokens.len()`.
    pub struct EncoderForward<O> {
        output out: f32,
        input tokens: u32,
        input wte: f32,
        input wpe: f32,
        value t: usize,
        value c: usize,
    }
}

operation! {
    /// `dwte[tokens] += dout; dwpe[row % t] += dout`. `host_tokens` is the host's
    /// copy of `tokens`, from which a device plans a deterministic scatter.
    pub struct EncoderBackward<'h, O> {
        output dwte: f32,
        output dwpe: f32,
        input dout: f32,
        input tokens: u32,
        value host_tokens: &'h [u32],
        value t: usize,
        value c: usize,
    }
}

/// The positions a sequence of `t` needs, at least one.
fn check_t(t: usize) -> Result<(), String> {
    match t {
        0 => Err("sequence length t must be positive".into()),
        _ => Ok(()),
    }
}

impl<O: Operands> Kernel<O> for EncoderForward<O> {
    const NAME: &'static str = "encoder_forward";

    fn check(&self) -> Result<(), String> {
        let (rows, t, c) = (self.tokens.extent(), self.t, self.c);
        check_t(t)?;
        need("out", &self.out, rows * c)?;
        need("wpe", &self.wpe, t.min(rows) * c)
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        forward(self.lower(host))
    }

    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let op = self.lower(raw);
        let rows = op.tokens.len;
        let args = [
            Arg::View(op.out),
            Arg::View(op.tokens),
            Arg::View(op.wte),
            Arg::View(op.wpe),
            u32s("rows", rows)?,
            u32s("t", op.t)?,
            u32s("c", op.c)?,
        ];
        q.launch("encoder_forward", groups(rows * op.c), &args)
    }
}

impl<O: Operands> Kernel<O> for EncoderBackward<'_, O> {
    const NAME: &'static str = "encoder_backward";

    fn check(&self) -> Result<(), String> {
        let (rows, t, c) = (self.host_tokens.len(), self.t, self.c);
        check_t(t)?;
        need("tokens", &self.tokens, rows)?;
        need("dout", &self.dout, rows * c)?;
        need("dwpe", &self.dwpe, t.min(rows) * c)?;
        let most = self.host_tokens.iter().max();
        most.map_or(Ok(()), |&tok| {
            need("dwte", &self.dwte, (tok as usize + 1) * c)
        })
    }

    fn cpu<'a>(self, host: &impl Lower<O, Host<'a>>) {
        backward(self.lower(host))
    }

    /// In a fixed order: rows are grouped by token here on the host.
    fn gpu<R: Runtime>(self, q: &Queue<R>, raw: &impl Lower<O, Raw>, _: Checked) -> Queued {
        let EncoderBackward {
            dwte,
            dwpe,
            dout,
            host_tokens: tokens,
            t,
            c,
            ..
        } = self.lower(raw);
        let rows = tokens.len();
        if rows == 0 || c == 0 {
            return Ok(());
        }
        // CSR of rows by token: order (rows), starts (n_tok + 1), toks (n_tok).
        let mut order: Vec<u32> = (0..u32_arg("rows", rows)?).collect();
        order.sort_by_key(|&r| tokens[r as usize]); // stable: rows ascend within a token
        let (mut starts, mut toks) = (Vec::new(), Vec::new());
        for (s, &r) in order.iter().enumerate() {
            let tok = tokens[r as usize];
            if toks.last() != Some(&tok) {
                toks.push(tok);
                starts.push(s as u32);
            }
        }
        starts.push(rows as u32);
        let n_tok = toks.len();
        let mut csr = order;
        csr.extend_from_slice(&starts);
        csr.extend_from_slice(&toks);
        // In the queue's scratch (4-byte words, as u32s), asked at its
        // longest (every row a token of its own), so no step allocates.
        q.with_scratch([3 * rows + 1], |[mem]| {
            q.write(mem.part(0..csr.len()), &csr)?;
            let args = [
                Arg::View(dwte),
                Arg::View(dout),
                Arg::View(mem.part(0..rows)),
                Arg::View(mem.part(rows..rows + n_tok + 1)),
                Arg::View(mem.part(rows + n_tok + 1..csr.len())),
                u32s("distinct tokens", n_tok)?,
                u32s("c", c)?,
            ];
            q.launch("encoder_backward_wte", groups(n_tok * c), &args)
        })?;
        // With rows < t, positions past the last row get nothing: only
        // min(t, rows) positions are touched, each by its one row.
        let positions = t.min(rows);
        let args = [
            Arg::View(dwpe),
            Arg::View(dout),
            u32s("rows", rows)?,
            u32s("t", positions)?,
            u32s("c", c)?,
        ];
        q.launch("encoder_backward_wpe", groups(positions * c), &args)
    }
}

/// out (B*T, C) = `wte[tokens]` + `wpe[position]`; tokens are (B*T), t is the sequence length.
fn forward(op: EncoderForward<Host<'_>>) {
    let EncoderForward {
        out,
        tokens,
        wte,
        wpe,
        t,
        c,
    } = op;
    out[..tokens.len() * c]
        .par_chunks_mut(c)
        .zip(tokens.par_iter())
        .enumerate()
        .for_each(|(i, (o, &tok))| {
            let e = &wte[tok as usize * c..(tok as usize + 1) * c];
            let p = &wpe[(i % t) * c..(i % t + 1) * c];
            o.iter_mut()
                .zip(e.iter().zip(p))
                .for_each(|(o, (&e, &p))| *o = e + p);
        });
}

/// `dwte[tokens]` += dout; `dwpe[position]` += dout. Threads own column ranges,
/// so repeated tokens never race.
fn backward(op: EncoderBackward<'_, Host<'_>>) {
    let EncoderBackward {
        dwte,
        dwpe,
        dout,
        tokens,
        t,
        c,
        ..
    } = op;
    const COLS: usize = 32;
    let ncol_blocks = c.div_ceil(COLS);
    let wte_ptr = SendPtr(dwte.as_mut_ptr());
    let wpe_ptr = SendPtr(dwpe.as_mut_ptr());
    let (wte_len, wpe_len) = (dwte.len(), dwpe.len());
    (0..ncol_blocks).into_par_iter().for_each(|blk| {
        let c0 = blk * COLS;
        let c1 = (c0 + COLS).min(c);
        for (i, &tok) in tokens.iter().enumerate() {
            let d = &dout[i * c + c0..i * c + c1];
            let (te, pe) = (tok as usize * c + c0, (i % t) * c + c0);
            assert!(te + d.len() <= wte_len && pe + d.len() <= wpe_len);
            // SAFETY: in bounds (checked above); column block blk is written
            // by this task alone.
            unsafe {
                let e = std::slice::from_raw_parts_mut(wte_ptr.get().add(te), d.len());
                let p = std::slice::from_raw_parts_mut(wpe_ptr.get().add(pe), d.len());
                for j in 0..d.len() {
                    e[j] += d[j];
                    p[j] += d[j];
                }
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::check::*;
    use crate::rng::Rng;

    fn reference(wte: &[f64], wpe: &[f64], tokens: &[u32], t: usize, c: usize) -> Vec<f64> {
        let mut out = vec![0.0; tokens.len() * c];
        for (i, &tok) in tokens.iter().enumerate() {
            for j in 0..c {
                out[i * c + j] = wte[tok as usize * c + j] + wpe[(i % t) * c + j];
            }
        }
        out
    }

    #[test]
    fn encoder_backward_matches_finite_differences_with_repeated_tokens() {
        let (v, t, c) = (5, 4, 40);
        let tokens = [1u32, 3, 1, 1, 0, 4, 3, 3];
        let mut rng = Rng::new(7);
        let wte = randn(&mut rng, v * c, 1.0);
        let wpe = randn(&mut rng, t * c, 1.0);
        let probe = randn(&mut rng, tokens.len() * c, 1.0);
        let mut out = vec![0.0; tokens.len() * c];
        forward(EncoderForward {
            out: &mut out,
            tokens: &tokens,
            wte: &wte,
            wpe: &wpe,
            t,
            c,
        });
        assert_close(
            "out",
            &out,
            &reference(&to64(&wte), &to64(&wpe), &tokens, t, c),
            1e-6,
        );
        let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
        backward(EncoderBackward {
            dwte: &mut dwte,
            dwpe: &mut dwpe,
            dout: &probe,
            tokens: &tokens,
            host_tokens: &tokens,
            t,
            c,
        });
        let wpe64 = to64(&wpe);
        let wte64 = to64(&wte);
        let fd_e = finite_diff(&wte, |x| {
            probe_dot(&reference(x, &wpe64, &tokens, t, c), &probe)
        });
        assert_close("dwte", &dwte, &fd_e, 1e-5);
        let fd_p = finite_diff(&wpe, |x| {
            probe_dot(&reference(&wte64, x, &tokens, t, c), &probe)
        });
        assert_close("dwpe", &dwpe, &fd_p, 1e-5);
    }
}
