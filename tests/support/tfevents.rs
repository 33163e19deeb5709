//! TensorBoard event files read back, for the tests: the TFRecord frames
//! (length, masked CRC-32C of the length, the record, masked CRC-32C of the
//! record) each checked, and the few `Event` fields distgpt writes decoded
//! (wall time, step, file version, scalar and text summaries, a session
//! start). A reader of its own, beside the library's writer, so the two
//! check each other.

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

/// A summary value: a scalar, or text.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Scalar(f32),
    Text(String),
}

/// One event as read back.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub wall_time: f64,
    pub step: i64,
    pub file_version: Option<String>,
    /// A session start (status START), as a resumed run writes first.
    pub session_start: bool,
    pub values: Vec<(String, Value)>,
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
/// TensorProto.string_val (tensor.proto).
const TENSOR_STRING_VAL: u32 = 8;
const SESSION_START: u64 = 1;

/// A protocol-buffer message's fields, as (field, wire type, payload).
fn fields(mut data: &[u8]) -> std::result::Result<Vec<(u32, u32, Field<'_>)>, String> {
    fn varint(data: &mut &[u8]) -> std::result::Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = data.split_first().ok_or("a varint runs past the end")?;
            *data = rest;
            v |= ((b & 0x7f) as u64) << shift;
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err("a varint longer than 10 bytes".into())
    }
    let mut out = Vec::new();
    while !data.is_empty() {
        let key = varint(&mut data)?;
        let (field, wire) = ((key >> 3) as u32, (key & 7) as u32);
        fn take<'a>(
            data: &mut &'a [u8],
            n: usize,
            field: u32,
        ) -> std::result::Result<&'a [u8], String> {
            if data.len() < n {
                return Err(format!("field {field} runs past the end"));
            }
            let (a, b) = data.split_at(n);
            *data = b;
            Ok(a)
        }
        let value = match wire {
            0 => Field::Int(varint(&mut data)?),
            1 => Field::Fixed64(take(&mut data, 8, field)?.try_into().expect("8 bytes")),
            2 => {
                let n = varint(&mut data)? as usize;
                Field::Bytes(take(&mut data, n, field)?)
            }
            5 => Field::Fixed32(take(&mut data, 4, field)?.try_into().expect("4 bytes")),
            w => return Err(format!("wire type {w} of field {field}")),
        };
        out.push((field, wire, value));
    }
    Ok(out)
}

enum Field<'a> {
    Int(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(&'a [u8]),
}

fn decode_value(data: &[u8]) -> std::result::Result<(String, Option<Value>), String> {
    let (mut tag, mut value) = (String::new(), None);
    for (f, _, v) in fields(data)? {
        match (f, v) {
            (VALUE_TAG, Field::Bytes(b)) => tag = String::from_utf8_lossy(b).into_owned(),
            (VALUE_SIMPLE, Field::Fixed32(b)) => value = Some(Value::Scalar(f32::from_le_bytes(b))),
            (VALUE_TENSOR, Field::Bytes(b)) => {
                for (tf, _, tv) in fields(b)? {
                    if let (TENSOR_STRING_VAL, Field::Bytes(s)) = (tf, tv) {
                        value = Some(Value::Text(String::from_utf8_lossy(s).into_owned()));
                    }
                }
            }
            _ => {}
        }
    }
    Ok((tag, value))
}

fn decode_event(data: &[u8]) -> std::result::Result<Event, String> {
    let mut ev = Event {
        wall_time: 0.0,
        step: 0,
        file_version: None,
        session_start: false,
        values: Vec::new(),
    };
    for (f, _, v) in fields(data)? {
        match (f, v) {
            (EV_WALL_TIME, Field::Fixed64(b)) => ev.wall_time = f64::from_le_bytes(b),
            (EV_STEP, Field::Int(s)) => ev.step = s as i64,
            (EV_FILE_VERSION, Field::Bytes(b)) => {
                ev.file_version = Some(String::from_utf8_lossy(b).into_owned())
            }
            (EV_SUMMARY, Field::Bytes(b)) => {
                for (sf, _, sv) in fields(b)? {
                    if let (SUMMARY_VALUE, Field::Bytes(vb)) = (sf, sv) {
                        if let (tag, Some(value)) = decode_value(vb)? {
                            ev.values.push((tag, value));
                        }
                    }
                }
            }
            (EV_SESSION_LOG, Field::Bytes(b)) => {
                ev.session_start = fields(b)?
                    .iter()
                    .any(|(f, _, v)| *f == 1 && matches!(v, Field::Int(SESSION_START)));
            }
            _ => {}
        }
    }
    Ok(ev)
}

/// Every event of an event file, its frames' CRCs checked.
pub fn read_events(path: &Path) -> Result<Vec<Event>, String> {
    let data = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let bad = |reason: String| format!("{}: {reason}", path.display());
    let mut rest = &data[..];
    let mut events = Vec::new();
    while !rest.is_empty() {
        if rest.len() < 12 {
            return Err(bad(format!("{} bytes of a cut-off frame", rest.len())));
        }
        let (len, crc) = (
            &rest[..8],
            u32::from_le_bytes(rest[8..12].try_into().unwrap()),
        );
        if masked_crc(len) != crc {
            return Err(bad(format!("record {}: length CRC mismatch", events.len())));
        }
        let n = u64::from_le_bytes(len.try_into().unwrap()) as usize;
        if rest.len() < 12 + n + 4 {
            return Err(bad(format!("record {} is cut off", events.len())));
        }
        let body = &rest[12..12 + n];
        let crc = u32::from_le_bytes(rest[12 + n..16 + n].try_into().unwrap());
        if masked_crc(body) != crc {
            return Err(bad(format!("record {}: data CRC mismatch", events.len())));
        }
        events.push(decode_event(body).map_err(bad)?);
        rest = &rest[16 + n..];
    }
    Ok(events)
}

/// The event files in `dir`, oldest first.
pub fn event_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("events.out.tfevents."))
        })
        .collect();
    files.sort();
    Ok(files)
}
