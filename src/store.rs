//! Files below every model: atomic writes, streaming safetensors, and the
//! checksums that model files, checkpoints and run records carry. Knows no
//! model, no run and no training state.

use crate::error::{Error, Result};
use safetensors::tensor::{Dtype, Metadata, SafeTensors, TensorInfo};
use safetensors::SafeTensorError as Bad;
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Errors unless `path` is a regular file (or a link to one): a pipe
/// where a file belongs blocks its open, a device is read without end.
pub fn regular_file(path: &Path) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    match meta.is_file() {
        true => Ok(()),
        false => Err(Error::Input(format!(
            "{} is {}: a file belongs there",
            path.display(),
            if meta.is_dir() {
                "a folder"
            } else {
                "not a regular file (a pipe or a device)"
            }
        ))),
    }
}

/// The text of the regular file `path` ([`regular_file`]).
pub fn read_text(path: &Path) -> Result<String> {
    regular_file(path)?;
    std::fs::read_to_string(path).map_err(|e| Error::io(path, e))
}

/// Writes `bytes` to `path` atomically: temporary file, fsync, rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, |f| f.write_all(bytes))
}

/// Writes what `fill` writes to `path` atomically (temporary file,
/// buffered, fsync, rename), so a file can be written piece by piece. The
/// temporary file is `path` with `.tmp` added (each file its own), and is
/// removed when the write fails (a full disk leaves no debris).
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    stage(path, fill)?.commit()
}

/// A file written in full beside its `path` (its `.tmp`, fsynced), which
/// becomes `path` on [`Staged::commit`] and is removed if dropped before:
/// files that change together are each staged, where a full disk stops
/// them, before any is renamed.
pub struct Staged {
    tmp: PathBuf,
    path: PathBuf,
}

/// What `fill` writes, staged to become `path`.
pub fn stage(
    path: &Path,
    fill: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<Staged> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let staged = Staged {
        tmp: tmp.into(),
        path: path.into(),
    };
    let write = || -> std::io::Result<()> {
        let f = std::fs::File::create(&staged.tmp)?;
        let mut f = std::io::BufWriter::with_capacity(1 << 20, f);
        fill(&mut f)?;
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    write().map_err(|e| Error::io(path, e))?;
    Ok(staged)
}

impl Staged {
    /// Renames the staged file onto its path.
    pub fn commit(mut self) -> Result<()> {
        std::fs::rename(&self.tmp, &self.path).map_err(|e| Error::io(&self.path, e))?;
        self.tmp.clear();
        Ok(())
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `value` to `path` atomically as pretty-printed JSON; returns the text.
pub fn write_json<T: Serialize + ?Sized>(path: &Path, value: &T) -> Result<String> {
    let text = serde_json::to_string_pretty(value).expect("records serialise");
    write_atomic(path, text.as_bytes())?;
    Ok(text)
}

/// A tensor's values for [`write_safetensors`]: f32s, written as
/// little-endian bytes a chunk at a time (never copied whole), or bytes
/// made already (int8 codes).
pub enum Data<'a> {
    F32(&'a [f32]),
    Bytes(Vec<u8>),
}

impl Data<'_> {
    fn len(&self) -> usize {
        match self {
            Data::F32(x) => 4 * x.len(),
            Data::Bytes(b) => b.len(),
        }
    }
}

/// Writes named tensors (name, dtype, shape, values) as a safetensors file
/// at `path`, atomically and synced, streaming: the file's bytes are never
/// all in memory at once (a checkpoint of params and both moments would
/// otherwise cost twice its size at the end of a run). Returns the file's
/// [`checksum`].
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, Dtype, Vec<usize>, Data<'_>)],
) -> Result<String> {
    // the safetensors crate's layout, byte for byte: the metadata
    // `save_pretrained` writes (transformers before 4.48 refuses a file
    // without it: `metadata.get("format")` of None), the tensors by
    // descending dtype, then name; a compact JSON header padded with
    // spaces to 8 bytes
    let mut order: Vec<&(String, Dtype, Vec<usize>, Data<'_>)> = tensors.iter().collect();
    order.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let mut head = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0usize;
    for (name, dtype, shape, data) in &order {
        let elements: usize = shape.iter().product();
        assert_eq!(
            elements * dtype.size(),
            data.len(),
            "{name}: shape and values agree"
        );
        let info = TensorInfo {
            dtype: *dtype,
            shape: shape.clone(),
            data_offsets: (offset, offset + data.len()),
        };
        head.push(',');
        head.push_str(&serde_json::to_string(name).expect("a name serialises"));
        head.push(':');
        head.push_str(&serde_json::to_string(&info).expect("a header serialises"));
        offset += data.len();
    }
    head.push('}');
    while !head.len().is_multiple_of(8) {
        head.push(' ');
    }
    let mut sum = Checksum::new();
    write_atomic_with(path, |f| {
        let mut put = |bytes: &[u8]| {
            sum.update(bytes);
            f.write_all(bytes)
        };
        put(&(head.len() as u64).to_le_bytes())?;
        put(head.as_bytes())?;
        let mut chunk = Vec::with_capacity(1 << 16);
        for (_, _, _, data) in &order {
            match data {
                Data::F32(x) => {
                    for part in x.chunks(1 << 14) {
                        chunk.clear();
                        chunk.extend(part.iter().flat_map(|v| v.to_le_bytes()));
                        put(&chunk)?;
                    }
                }
                Data::Bytes(b) => put(b)?,
            }
        }
        Ok(())
    })?;
    Ok(sum.hex())
}

/// A safetensors file's tensors, or why not in words (the crate's own
/// `Display` is its variant's name, `TensorInvalidInfo`), naming the tensor
/// where the crate or the header tells which.
pub fn read_safetensors(bytes: &[u8]) -> std::result::Result<SafeTensors<'_>, String> {
    SafeTensors::deserialize(bytes).map_err(|e| match e {
        Bad::HeaderTooSmall => "it is shorter than the 8 bytes of its header's length".into(),
        Bad::HeaderTooLarge => "its header's length is over the 100 MB a header may have".into(),
        Bad::InvalidHeaderLength => "its header's length runs past the end of the file".into(),
        Bad::InvalidHeader | Bad::InvalidHeaderStart | Bad::InvalidHeaderDeserialization => {
            "its header is not the JSON object of a safetensors file".into()
        }
        Bad::InvalidOffset(name) => {
            format!("tensor '{name}' has data_offsets that do not start where the tensor before it ends")
        }
        Bad::TensorInvalidInfo | Bad::ValidationOverflow => {
            let name = misfit(bytes).unwrap_or_else(|| "?".into());
            format!("tensor '{name}' has a shape and dtype whose bytes its data_offsets do not span")
        }
        Bad::MetadataIncompleteBuffer => {
            "its tensors do not end where the file does: it is truncated or has bytes past them".into()
        }
        other => other.to_string(), // none that deserialize makes
    })
}

/// The tensor of a safetensors header whose shape and dtype need another
/// number of bytes than its data_offsets give it.
fn misfit(bytes: &[u8]) -> Option<String> {
    let n = u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?) as usize;
    let meta: Metadata = serde_json::from_slice(bytes.get(8..8usize.checked_add(n)?)?).ok()?;
    let fits = |t: &TensorInfo| {
        let need = t
            .shape
            .iter()
            .try_fold(t.dtype.size(), |a, &d| a.checked_mul(d));
        need.is_some() && need == t.data_offsets.1.checked_sub(t.data_offsets.0)
    };
    let misfits = meta.tensors().into_iter().filter(|(_, t)| !fits(t));
    misfits.map(|(name, _)| name).min()
}

/// FNV-1a, 64 bit: enough to catch truncation and flipped bytes.
pub fn checksum(bytes: &[u8]) -> String {
    let mut sum = Checksum::new();
    sum.update(bytes);
    sum.hex()
}

/// [`checksum`] taken a piece at a time (of a file as it is written).
pub struct Checksum(u64);

impl Default for Checksum {
    fn default() -> Self {
        Self::new()
    }
}

impl Checksum {
    pub fn new() -> Self {
        Checksum(0xcbf2_9ce4_8422_2325)
    }

    pub fn update(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

/// [`checksum`] of a record's JSON value, whose keys are sorted: the sum
/// does not depend on the order the fields are written in.
pub fn json_checksum<T: Serialize>(record: &T) -> String {
    let value = serde_json::to_value(record).expect("records serialise");
    checksum(
        serde_json::to_string_pretty(&value)
            .expect("json")
            .as_bytes(),
    )
}

/// The checksum a stored record should carry, and the one it records in
/// its `checksum` field: [`json_checksum`] of the file's own JSON value
/// with that field empty. Summing what was read, not the struct it parses
/// into, keeps an old file's sum when a later distgpt adds a field that
/// reads with a default (and would otherwise be serialized into the sum).
pub fn stored_checksum(text: &str) -> std::result::Result<(String, String), String> {
    let mut value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let field = value.get_mut("checksum").ok_or("no checksum is recorded")?;
    let recorded = field
        .as_str()
        .ok_or("the recorded checksum is not a string")?
        .to_string();
    *field = serde_json::Value::String(String::new());
    Ok((json_checksum(&value), recorded))
}

/// Floating-point tensor data of `dtype` (F32, or BF16 and F16: a model
/// saved in half precision, widened exactly) into `out`; false for any
/// other dtype.
pub fn widen_into(dtype: Dtype, data: &[u8], out: &mut [f32]) -> bool {
    let halves = |widen: fn(u16) -> f32, out: &mut [f32]| {
        for (d, h) in out.iter_mut().zip(data.chunks_exact(2)) {
            *d = widen(u16::from_le_bytes([h[0], h[1]]));
        }
    };
    match dtype {
        Dtype::F32 => {
            for (d, chunk) in out.iter_mut().zip(data.chunks_exact(4)) {
                *d = f32::from_le_bytes(chunk.try_into().expect("4 bytes"));
            }
        }
        Dtype::BF16 => halves(|h| half::bf16::from_bits(h).to_f32(), out),
        Dtype::F16 => halves(|h| half::f16::from_bits(h).to_f32(), out),
        _ => return false,
    }
    true
}

/// For tests of readers that must refuse a pipe where a file belongs.
#[cfg(test)]
pub(crate) mod pipes {
    use std::path::Path;

    /// `path` made a named pipe (a FIFO) no one writes: opening it to read
    /// blocks for ever.
    pub(crate) fn make_fifo(path: &Path) {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path and a mode
        assert_eq!(
            unsafe { libc::mkfifo(c.as_ptr(), 0o600) },
            0,
            "mkfifo {}",
            path.display()
        );
    }

    /// `read` on a thread of its own, waited for 20 s: a read that blocks on a
    /// pipe fails the test instead of hanging it.
    pub(crate) fn within_20_s<T: Send + 'static>(read: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || tx.send(read()));
        (rx.recv_timeout(std::time::Duration::from_secs(20))).expect("the read hung on a pipe")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// A record as an older distgpt wrote it.
    #[derive(Serialize)]
    struct Before {
        step: usize,
        checksum: String,
    }

    /// The same record after a field was added that reads with a default.
    #[derive(Clone, Serialize, Deserialize)]
    struct After {
        step: usize,
        checksum: String,
        #[serde(default)]
        added: Option<u32>,
    }

    /// A write that fails part-way leaves neither the file nor its
    /// temporary beside it; one that succeeds leaves only the file, and
    /// two files of one stem (model.json, model.safetensors) have
    /// temporaries of their own.
    #[test]
    fn a_failed_write_leaves_no_temporary_file() {
        let dir = crate::testdir::TestDir::new("store-tmp");
        let path = dir.path().join("model.json");
        let err = write_atomic_with(&path, |w| {
            w.write_all(&[0; 3 << 20])?;
            Err(std::io::Error::other("no space left"))
        })
        .unwrap_err();
        assert!(err.to_string().contains("no space left"), "{err}");
        let left = |d: &Path| -> Vec<String> {
            let mut n: Vec<String> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            n.sort();
            n
        };
        assert!(left(dir.path()).is_empty(), "{:?}", left(dir.path()));
        write_atomic_with(&path, |w| {
            write_atomic(&dir.path().join("model.safetensors"), b"{}").unwrap();
            w.write_all(b"{}")
        })
        .unwrap();
        assert_eq!(left(dir.path()), ["model.json", "model.safetensors"]);
    }

    /// A written file is the safetensors crate's own serialisation of the
    /// same tensors with `save_pretrained`'s metadata, byte for byte: older
    /// transformers refuse a file without `{"format": "pt"}`.
    #[test]
    fn a_written_file_is_the_safetensors_crates_with_transformers_metadata() {
        use safetensors::tensor::TensorView;
        let dir = crate::testdir::TestDir::new("store-metadata");
        let path = dir.path().join("model.safetensors");
        let (a, b) = ([1.5f32, -2.0, 0.25], [7u16, 9]);
        let a_bytes: Vec<u8> = a.iter().flat_map(|x| x.to_le_bytes()).collect();
        let b_bytes: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
        let tensors = [
            ("wte.weight".to_string(), Dtype::F32, vec![3], Data::F32(&a)),
            (
                "h.0.attn.bias".to_string(),
                Dtype::BF16,
                vec![2, 1],
                Data::Bytes(b_bytes.clone()),
            ),
        ];
        write_safetensors(&path, &tensors).unwrap();
        let views = [
            (
                "wte.weight",
                TensorView::new(Dtype::F32, vec![3], &a_bytes).unwrap(),
            ),
            (
                "h.0.attn.bias",
                TensorView::new(Dtype::BF16, vec![2, 1], &b_bytes).unwrap(),
            ),
        ];
        let metadata = Some(std::collections::HashMap::from([(
            "format".to_string(),
            "pt".to_string(),
        )]));
        let theirs = safetensors::serialize(views, &metadata).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), theirs);
    }

    /// Each dtype's bits widen to the values IEEE 754 gives them, worked
    /// by hand (no conversion code of the crate's or the `half` crate's).
    #[test]
    fn tensor_data_widens_to_the_values_its_bits_hold() {
        let widen = |dtype, bytes: &[u8], n| {
            let mut out = vec![7.0; n];
            widen_into(dtype, bytes, &mut out).then_some(out)
        };
        let f32s: Vec<u8> = [1.5f32, -0.0, 3e38]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(widen(Dtype::F32, &f32s, 3).unwrap(), [1.5, -0.0, 3e38]);
        // bf16: the top half of an f32 (sign, 8 exponent bits, 7 of mantissa)
        let bf16 = [0x3F80u16, 0xC0A0, 0x0001, 0x7F7F];
        let bytes: Vec<u8> = bf16.iter().flat_map(|h| h.to_le_bytes()).collect();
        let want = [1.0, -5.0, f32::from_bits(0x0001_0000), 3.3895314e38];
        assert_eq!(widen(Dtype::BF16, &bytes, 4).unwrap(), want);
        // f16: sign, 5 exponent bits (bias 15), 10 of mantissa; subnormals
        // are mantissa x 2^-24
        let f16 = [0x3C00u16, 0xC000, 0x0001, 0x7BFF, 0x3555];
        let bytes: Vec<u8> = f16.iter().flat_map(|h| h.to_le_bytes()).collect();
        let want = [1.0, -2.0, 2f32.powi(-24), 65504.0, 0.33325195];
        assert_eq!(widen(Dtype::F16, &bytes, 5).unwrap(), want);
        assert!(widen(Dtype::I8, &[1, 2], 2).is_none());
        assert!(widen(Dtype::F64, &[0; 8], 1).is_none());
    }

    #[test]
    fn a_file_written_before_a_field_was_added_keeps_its_checksum() {
        let mut old = Before {
            step: 7,
            checksum: String::new(),
        };
        old.checksum = json_checksum(&old);
        let text = serde_json::to_string_pretty(&old).unwrap();
        let (sum, recorded) = stored_checksum(&text).unwrap();
        assert_eq!(sum, recorded, "the old file's own sum");
        // Summing the struct it now parses into (how indexes were checked
        // until 2026-11-27) counts the new field's null and refuses it.
        let now: After = serde_json::from_str(&text).unwrap();
        let resummed = json_checksum(&After {
            checksum: String::new(),
            ..now
        });
        assert_ne!(resummed, recorded);

        // What the new struct writes checks too, and an edit is caught.
        let mut new = After {
            step: 7,
            checksum: String::new(),
            added: Some(3),
        };
        new.checksum = json_checksum(&new);
        let text = serde_json::to_string_pretty(&new).unwrap();
        let (sum, recorded) = stored_checksum(&text).unwrap();
        assert_eq!(sum, recorded);
        let (sum, recorded) = stored_checksum(&text.replace("\"step\": 7", "\"step\": 8")).unwrap();
        assert_ne!(sum, recorded);
        let (sum, recorded) =
            stored_checksum(&text.replace("\"added\": 3", "\"added\": 4")).unwrap();
        assert_ne!(sum, recorded);
    }

    #[test]
    fn a_record_without_a_checksum_is_named() {
        assert_eq!(
            stored_checksum("{\"step\": 7}").unwrap_err(),
            "no checksum is recorded"
        );
        assert_eq!(
            stored_checksum("{\"step\": 7, \"checksum\": 3}").unwrap_err(),
            "the recorded checksum is not a string"
        );
        assert!(stored_checksum("{\"step\": ")
            .unwrap_err()
            .starts_with("invalid JSON"));
    }
}
