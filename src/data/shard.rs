//! llm.c's token-shard format: a header of 256 little-endian i32 (magic
//! 20240520, version 1, token count), then the tokens as u16.

use crate::error::{Error, Result};
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};

pub const MAGIC: i32 = 20240520;
/// llm.c's shards of LLaMA 3's u32 tokens (version 7).
const LLAMA3_MAGIC: i32 = 20240801;
pub const VERSION: i32 = 1;
const HEADER_BYTES: usize = 256 * 4;

/// Writes tokens as one shard, atomically (temporary file, fsync, rename).
pub fn write_shard(path: &Path, tokens: &[u32]) -> Result<()> {
    if let Some(&bad) = tokens.iter().find(|&&t| t > u16::MAX as u32) {
        return Err(Error::Input(format!(
            "token id {bad} does not fit the shard format's u16"
        )));
    }
    let mut header = [0i32; 256];
    header[0] = MAGIC;
    header[1] = VERSION;
    header[2] = i32::try_from(tokens.len()).map_err(|_| {
        Error::Input(format!(
            "{} tokens exceed one shard's i32 count",
            tokens.len()
        ))
    })?;
    crate::store::write_atomic_with(path, |f| {
        header
            .iter()
            .try_for_each(|h| f.write_all(&h.to_le_bytes()))?;
        tokens
            .iter()
            .try_for_each(|&t| f.write_all(&(t as u16).to_le_bytes()))
    })
}

/// A memory-mapped, validated shard.
pub struct Shard {
    pub path: PathBuf,
    map: Mmap,
    len: usize,
}

impl Shard {
    pub fn open(path: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Shard {
            path: path.to_path_buf(),
            reason,
        };
        crate::store::regular_file(path)?;
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; a shard changed underneath a run is the
        // user's to avoid, as with any memory-mapped input.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        if map.len() < HEADER_BYTES {
            return Err(bad(format!(
                "{} bytes is shorter than the 1024-byte header",
                map.len()
            )));
        }
        let word =
            |i: usize| i32::from_le_bytes(map[4 * i..4 * i + 4].try_into().expect("4 bytes"));
        if word(0) != MAGIC {
            let llama = match word(0) {
                LLAMA3_MAGIC => {
                    ": llm.c's LLaMA 3 shards of u32 tokens, which distgpt does not read"
                }
                _ => "",
            };
            return Err(bad(format!(
                "magic number {} (expected {MAGIC}, llm.c's GPT-2 shards){llama}",
                word(0)
            )));
        }
        if word(1) != VERSION {
            return Err(bad(format!("version {} (expected {VERSION})", word(1))));
        }
        let len = usize::try_from(word(2))
            .map_err(|_| bad(format!("negative token count {}", word(2))))?;
        let expected = HEADER_BYTES + 2 * len;
        if map.len() != expected {
            return Err(bad(format!(
                "header says {len} tokens ({expected} bytes) but the file has {} bytes",
                map.len()
            )));
        }
        Ok(Shard {
            path: path.to_path_buf(),
            map,
            len,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The tokens' bytes (little-endian u16).
    pub fn token_bytes(&self) -> &[u8] {
        &self.map[HEADER_BYTES..]
    }

    /// The first token at or above `vocab`, as (position, token): one pass
    /// over every token of the shard.
    pub fn first_outside(&self, vocab: u32) -> Option<(usize, u32)> {
        let max = self
            .token_bytes()
            .chunks_exact(2)
            .fold(0u16, |m, c| m.max(u16::from_le_bytes([c[0], c[1]])));
        if (max as u32) < vocab {
            return None;
        }
        (0..self.len)
            .map(|i| (i, self.get(i)))
            .find(|&(_, t)| t >= vocab)
    }

    /// Token i.
    pub fn get(&self, i: usize) -> u32 {
        let at = HEADER_BYTES + 2 * i;
        u16::from_le_bytes([self.map[at], self.map[at + 1]]) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testdir::TestDir;

    /// A shard as llm.c's own writer lays it out (scripts/make_reference_runs.py
    /// --only llmc): ours of the same tokens is the same bytes, and ours reads it.
    #[test]
    fn shards_are_the_bytes_llm_c_writes() {
        let golden: &[u8] = include_bytes!("../../tests/fixtures/llmc/golden_val_000000.bin");
        let mut tokens: Vec<u32> = (0..300).map(|i| (i * 7919) % 50257).collect();
        tokens.extend([0, 50256, 65535]);
        let dir = TestDir::new("shard-golden");
        let ours = dir.path().join("ours.bin");
        write_shard(&ours, &tokens).unwrap();
        assert_eq!(std::fs::read(&ours).unwrap(), golden);
        let theirs = dir.path().join("theirs.bin");
        std::fs::write(&theirs, golden).unwrap();
        let s = Shard::open(&theirs).unwrap();
        assert_eq!((0..s.len()).map(|i| s.get(i)).collect::<Vec<_>>(), tokens);
    }

    #[test]
    fn shard_round_trips_and_bad_headers_are_named() {
        let dir = TestDir::new("shard-rt");
        let d = dir.path();
        let p = d.join("a.bin");
        write_shard(&p, &[1, 2, 65535, 7]).unwrap();
        let s = Shard::open(&p).unwrap();
        assert_eq!(
            (0..s.len()).map(|i| s.get(i)).collect::<Vec<_>>(),
            vec![1, 2, 65535, 7]
        );

        let mut bytes = std::fs::read(&p).unwrap();
        bytes[0] ^= 1;
        std::fs::write(&p, &bytes).unwrap();
        let err = Shard::open(&p).err().unwrap().to_string();
        assert!(err.contains("magic") && err.contains("a.bin"), "{err}");
        // llm.c's other format is named as what it is
        let mut llama = bytes.clone();
        llama[..8].copy_from_slice(&[20240801i32.to_le_bytes(), 7i32.to_le_bytes()].concat());
        std::fs::write(&p, &llama).unwrap();
        let err = Shard::open(&p).err().unwrap().to_string();
        assert!(err.contains("20240801") && err.contains("LLaMA 3"), "{err}");

        bytes[0] ^= 1;
        bytes.pop();
        std::fs::write(&p, &bytes).unwrap();
        let err = Shard::open(&p).err().unwrap().to_string();
        assert!(err.contains("header says 4 tokens"), "{err}");

        let err = Shard::open(&d.join("missing.bin"))
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains("missing.bin"), "{err}");
        assert!(write_shard(&p, &[70000]).is_err());
    }
}
