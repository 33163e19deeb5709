//! TensorBoard event files, written (tests/support/tfevents.rs reads them
//! back): the TFRecord framing
//! (length, masked CRC-32C of the length, the record, masked CRC-32C of the
//! record) around `Event` protocol buffers, encoded by hand for the few
//! fields used: wall time, step, the file version, scalar summaries
//! (`simple_value`), text summaries (a string tensor with the `text`
//! plugin's metadata) and a session start, which tells TensorBoard to drop
//! the events past the step a run resumed from.

use crate::error::{Error, Result};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli), bit-reflected, as TFRecord frames use it.
fn crc32c(data: &[u8]) -> u32 {
    static TABLE: std::sync::OnceLock<[u32; 256]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let mut t = [0u32; 256];
        for (i, e) in t.iter_mut().enumerate() {
            let mut c = i as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
            }
            *e = c;
        }
        t
    });
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

/// TFRecord's masked CRC: rotated and offset, so a CRC of data holding CRCs
/// stays well distributed.
fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    (c.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// Protocol-buffer encoding of the fields an event file needs.
mod pb {
    pub fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    pub fn key(out: &mut Vec<u8>, field: u32, wire: u32) {
        varint(out, (field << 3 | wire) as u64);
    }
    pub fn bytes(out: &mut Vec<u8>, field: u32, data: &[u8]) {
        key(out, field, 2);
        varint(out, data.len() as u64);
        out.extend_from_slice(data);
    }
    pub fn double(out: &mut Vec<u8>, field: u32, v: f64) {
        key(out, field, 1);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn float(out: &mut Vec<u8>, field: u32, v: f32) {
        key(out, field, 5);
        out.extend_from_slice(&v.to_le_bytes());
    }
    pub fn int(out: &mut Vec<u8>, field: u32, v: u64) {
        key(out, field, 0);
        varint(out, v);
    }
}

/// Event fields (tensorflow/core/util/event.proto).
const EV_WALL_TIME: u32 = 1;
const EV_STEP: u32 = 2;
const EV_FILE_VERSION: u32 = 3;
const EV_SUMMARY: u32 = 5;
const EV_SESSION_LOG: u32 = 7;
/// Summary.value, and Summary.Value's fields (summary.proto).
const SUMMARY_VALUE: u32 = 1;
const VALUE_TAG: u32 = 1;
const VALUE_SIMPLE: u32 = 2;
const VALUE_TENSOR: u32 = 8;
const VALUE_METADATA: u32 = 9;
/// TensorProto: dtype (DT_STRING = 7) and string_val (tensor.proto).
const TENSOR_DTYPE: u32 = 1;
const DT_STRING: u64 = 7;
const TENSOR_STRING_VAL: u32 = 8;
/// SummaryMetadata.plugin_data and PluginData.plugin_name.
const META_PLUGIN: u32 = 1;
const PLUGIN_NAME: u32 = 1;
const SESSION_START: u64 = 1;

/// Writes `events.out.tfevents.<seconds>.<host>` in a directory.
pub struct EventWriter {
    out: BufWriter<File>,
    path: PathBuf,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The bytes of the events the writer writes, at wall time `wall`, with
/// their fields in field-number order (as protobuf's own serializers
/// write them, so the bytes equal TensorBoard's writer's).
mod event {
    use super::*;

    fn at(wall: f64, step: Option<usize>, body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut ev = Vec::new();
        pb::double(&mut ev, EV_WALL_TIME, wall);
        if let Some(step) = step {
            pb::int(&mut ev, EV_STEP, step as u64);
        }
        body(&mut ev);
        ev
    }

    /// The file version record TensorBoard reads first.
    pub fn file_version(wall: f64) -> Vec<u8> {
        at(wall, None, |ev| {
            pb::bytes(ev, EV_FILE_VERSION, b"brain.Event:2")
        })
    }

    pub fn scalars(wall: f64, step: usize, values: &[(&str, f64)]) -> Vec<u8> {
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            pb::bytes(&mut value, VALUE_TAG, tag.as_bytes());
            pb::float(&mut value, VALUE_SIMPLE, *v as f32);
            pb::bytes(&mut summary, SUMMARY_VALUE, &value);
        }
        at(wall, Some(step), |ev| pb::bytes(ev, EV_SUMMARY, &summary))
    }

    pub fn text(wall: f64, step: usize, tag: &str, text: &str) -> Vec<u8> {
        let mut tensor = Vec::new();
        pb::int(&mut tensor, TENSOR_DTYPE, DT_STRING);
        pb::bytes(&mut tensor, TENSOR_STRING_VAL, text.as_bytes());
        let mut plugin = Vec::new();
        pb::bytes(&mut plugin, PLUGIN_NAME, b"text");
        let mut meta = Vec::new();
        pb::bytes(&mut meta, META_PLUGIN, &plugin);
        let mut value = Vec::new();
        pb::bytes(&mut value, VALUE_TAG, tag.as_bytes());
        pb::bytes(&mut value, VALUE_TENSOR, &tensor);
        pb::bytes(&mut value, VALUE_METADATA, &meta);
        let mut summary = Vec::new();
        pb::bytes(&mut summary, SUMMARY_VALUE, &value);
        at(wall, Some(step), |ev| pb::bytes(ev, EV_SUMMARY, &summary))
    }

    pub fn session_start(wall: f64, step: usize) -> Vec<u8> {
        let mut log = Vec::new();
        pb::int(&mut log, 1, SESSION_START);
        at(wall, Some(step), |ev| pb::bytes(ev, EV_SESSION_LOG, &log))
    }
}

/// A TFRecord frame around `data`.
fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut frame = Vec::with_capacity(data.len() + 16);
    frame.extend_from_slice(&len);
    frame.extend_from_slice(&masked_crc(&len).to_le_bytes());
    frame.extend_from_slice(data);
    frame.extend_from_slice(&masked_crc(data).to_le_bytes());
    frame
}

impl EventWriter {
    /// A new event file in `dir` (made if missing), opened with the file
    /// version record TensorBoard reads first.
    pub fn create(dir: &Path) -> Result<EventWriter> {
        Self::check_dir(dir)?;
        std::fs::create_dir_all(dir).map_err(|e| {
            Error::Input(format!(
                "--tensorboard {}: cannot make the directory ({e})",
                dir.display()
            ))
        })?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let secs = now() as u64;
        // a second writer in the same second (a quick resume) gets its own file
        let path = (0..)
            .map(|n| {
                let suffix = if n == 0 {
                    String::new()
                } else {
                    format!(".{n}")
                };
                dir.join(format!("events.out.tfevents.{secs}.{host}{suffix}"))
            })
            .find(|p| !p.exists())
            .expect("an unused name");
        let f = File::create(&path).map_err(|e| Error::io(&path, e))?;
        let mut w = EventWriter {
            out: BufWriter::new(f),
            path,
        };
        w.record(&event::file_version(now()))?;
        Ok(w)
    }

    /// Refuses `dir` as the folder of event files where it is a file, or
    /// it (or the nearest folder above it that exists, where it is to be
    /// made) takes no file: asked before a run changes anything, so a
    /// mistyped `--tensorboard` costs nothing. Makes nothing.
    pub fn check_dir(dir: &Path) -> Result<()> {
        if dir.exists() && !dir.is_dir() {
            return Err(Error::Input(format!(
                "--tensorboard {} is a file: TensorBoard's event files go into a directory",
                dir.display()
            )));
        }
        let here = Path::new(".");
        let above = (dir.ancestors())
            .map(|a| if a.as_os_str().is_empty() { here } else { a })
            .find(|a| a.exists())
            .unwrap_or(here);
        let probe = above.join(format!(".distgpt-probe-{}", std::process::id()));
        let written = match above.is_dir() {
            true => File::create(&probe).map(drop),
            false => Err(std::io::Error::other(format!(
                "{} is a file",
                above.display()
            ))),
        };
        let _ = std::fs::remove_file(&probe);
        written.map_err(|e| {
            Error::Input(format!(
                "--tensorboard {}: cannot make the directory or write in it ({e})",
                dir.display()
            ))
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        self.out
            .write_all(&frame(data))
            .map_err(|e| Error::io(&self.path, e))
    }

    /// Scalars at `step`, one event.
    pub fn scalars(&mut self, step: usize, values: &[(&str, f64)]) -> Result<()> {
        self.record(&event::scalars(now(), step, values))
    }

    /// Text (Markdown) under `tag` at `step`.
    pub fn text(&mut self, step: usize, tag: &str, text: &str) -> Result<()> {
        self.record(&event::text(now(), step, tag, text))
    }

    /// A session start at `step`: TensorBoard drops the events of earlier
    /// files at `step` and after (those of a checkpoint's abandoned future).
    pub fn session_start(&mut self, step: usize) -> Result<()> {
        self.record(&event::session_start(now(), step))
    }

    /// Writes what is buffered, so a viewer sees it now.
    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().map_err(|e| Error::io(&self.path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl EventWriter {
        /// A writer onto an existing file (a test's `/dev/full`).
        pub(crate) fn onto(path: &Path) -> Result<EventWriter> {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| Error::io(path, e))?;
            Ok(EventWriter {
                out: BufWriter::new(f),
                path: path.into(),
            })
        }
    }

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        // the CRC-32C of "123456789" (RFC 3720's catalogue value)
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    /// Longer than 127 bytes, as the golden file's step is past 127: their
    /// varints take more than one byte.
    const SOLILOQUY: &str = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings and arrows of outrageous fortune, Or to take arms against a sea of troubles";

    /// Events written by TensorBoard's own writer (its RecordWriter and
    /// protos; scripts/make_reference_runs.py --only tensorboard): ours, at
    /// the same wall times, are the same bytes, frames and CRCs included
    /// (tests/tensorboard.rs reads theirs).
    #[test]
    fn events_are_the_bytes_tensorboards_own_writer_writes() {
        let golden: &[u8] = include_bytes!("../../tests/fixtures/tensorboard/golden.tfevents");
        let ours = [
            event::file_version(1_700_000_000.25),
            event::scalars(
                1_700_000_001.5,
                3,
                &[("train/loss", 2.5), ("train/lr", 1e-3)],
            ),
            event::text(1_700_000_002.75, 70_000, "sample", SOLILOQUY),
            event::session_start(1_700_000_003.0, 4),
        ]
        .iter()
        .flat_map(|e| frame(e))
        .collect::<Vec<u8>>();
        assert_eq!(ours, golden);
    }
}
