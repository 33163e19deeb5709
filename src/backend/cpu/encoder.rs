//! Token + position embedding, forward and backward.

use crate::backend::ops::{EncoderBackward, EncoderForward, Host};
use rayon::prelude::*;

/// out (B*T, C) = `wte[tokens]` + `wpe[position]`; tokens are (B*T), t is the sequence length.
pub fn encoder_forward(op: EncoderForward<Host<'_>>) {
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
pub fn encoder_backward(op: EncoderBackward<'_, Host<'_>>) {
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
    let wte_ptr = super::math::SendPtr(dwte.as_mut_ptr());
    let wpe_ptr = super::math::SendPtr(dwpe.as_mut_ptr());
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
    use super::super::check::*;
    use super::*;
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
        encoder_forward(EncoderForward {
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
        encoder_backward(EncoderBackward {
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
