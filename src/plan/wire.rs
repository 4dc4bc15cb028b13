//! The step plan's byte format (version [`FORMAT_VERSION`]), for shipping a plan to workers in
//! other processes. Specified, with an example, in `docs/step-format.md`:
//!
//! | field | type | encoding | meaning |
//! |---|---|---|---|
//! | magic | 4 bytes | `KVOS` | a kvoffload step plan |
//! | version | u16 | little-endian | [`FORMAT_VERSION`]; a decoder reads only its own |
//! | block_size_factor | u32 | varint | GPU blocks per host slot |
//! | n_jobs | count | varint | jobs that follow |
//! | job.id | u64 | varint | job id |
//! | job.kind | u32 | varint | 0 load, 1 store ([`Direction`]) |
//! | job.request_id | u64 | varint | the job's request |
//! | job.block_index | u32 | varint | logical index of the first GPU block copied |
//! | job.n_src, job.src | count, u32 each | varints | source block ids |
//! | job.n_dst, job.dst | count, u32 each | varints | destination block ids |
//! | n_flush, flush | count, u64 each | varints | the flush set, ascending |
//! | crc | u32 | little-endian | CRC-32 (IEEE) of every byte before it |
//!
//! A varint is unsigned LEB128: 7 bits per byte, least significant group first, the high bit
//! set on every byte but the last. The decoder accepts only canonical varints (no final `0x00`
//! group after the first byte) of at most 10 bytes whose value fits 64 bits (a 10th byte is `0x01`
//! at most) and the field's type; a count may not exceed the bytes left; nothing may follow the
//! CRC. Any other byte string is [`Error::CorruptData`]. A change of the format bumps the version.

use super::{Direction, Step};
use crate::error::{Error, Result};

impl Step {
    /// Encodes the plan (format above). `out` is cleared first.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.clear();
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        put(out, self.block_size_factor as u64);
        put(out, self.jobs.len() as u64);
        for j in &self.jobs {
            put(out, j.id);
            put(out, j.kind as u64);
            put(out, j.request_id);
            put(out, j.block_index as u64);
            for ids in [self.src(j), self.dst(j)] {
                put(out, ids.len() as u64);
                for &b in ids {
                    put(out, b as u64);
                }
            }
        }
        put(out, self.flush.len() as u64);
        for &f in &self.flush {
            put(out, f);
        }
        let crc = crc32fast::hash(out);
        out.extend_from_slice(&crc.to_le_bytes());
    }

    /// Decodes bytes made by [`Step::encode`] into `self`. Fails with [`Error::CorruptData`] on
    /// truncated or corrupt bytes, another magic or another format version; `self` is then
    /// unchanged.
    pub fn decode(&mut self, bytes: &[u8]) -> Result<()> {
        let corrupt = |what: &str| Error::CorruptData(format!("step bytes: {what}"));
        if bytes.len() < MAGIC.len() + 2 + 4 || &bytes[..4] != MAGIC {
            return Err(corrupt(
                "not a kvoffload step plan (bad magic or too short)",
            ));
        }
        let version = u16::from_le_bytes([bytes[4], bytes[5]]);
        if version != FORMAT_VERSION {
            return Err(corrupt(&format!(
                "format version {version}, this library reads {FORMAT_VERSION}"
            )));
        }
        let (body, crc) = bytes.split_at(bytes.len() - 4);
        if crc32fast::hash(body) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
            return Err(corrupt("checksum mismatch (truncated or corrupt)"));
        }
        let mut r = Reader { bytes: body, at: 6 };
        let mut step = Step {
            block_size_factor: r.u32()?,
            ..Step::default()
        };
        let n_jobs = r.len()?;
        let mut src = Vec::new();
        let mut dst = Vec::new();
        for _ in 0..n_jobs {
            let id = r.get()?;
            let k = r.u32()?;
            let kind = Direction::from_u32(k).ok_or_else(|| corrupt(&format!("job kind {k}")))?;
            let request_id = r.get()?;
            let block_index = r.u32()?;
            for ids in [&mut src, &mut dst] {
                ids.clear();
                for _ in 0..r.len()? {
                    ids.push(r.u32()?);
                }
            }
            step.push_job(id, kind, request_id, block_index, &src, &dst);
        }
        for _ in 0..r.len()? {
            step.flush.push(r.get()?);
        }
        if r.at != body.len() {
            return Err(corrupt("trailing bytes"));
        }
        *self = step;
        Ok(())
    }
}

const MAGIC: &[u8; 4] = b"KVOS";
/// Version of the step encoding; bumped on any change of the format.
pub const FORMAT_VERSION: u16 = 1;

fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    /// A canonical varint of at most 10 bytes whose value fits 64 bits.
    fn get(&mut self) -> Result<u64> {
        let corrupt =
            |what: &str| Error::CorruptData(format!("step bytes: {what} at byte {}", self.at));
        let mut v = 0u64;
        for i in 0..10 {
            let Some(&b) = self.bytes.get(self.at + i) else {
                return Err(corrupt("truncated varint"));
            };
            if i == 9 && b > 1 {
                return Err(corrupt(
                    "varint beyond 64 bits (over 10 bytes, or a 10th byte above 1)",
                ));
            }
            v |= ((b & 0x7f) as u64) << (7 * i);
            if b & 0x80 == 0 {
                if b == 0 && i > 0 {
                    return Err(corrupt("non-canonical varint (a redundant zero group)"));
                }
                self.at += i + 1;
                return Ok(v);
            }
        }
        unreachable!("a 10th byte ends the varint or refuses it")
    }

    fn u32(&mut self) -> Result<u32> {
        let v = self.get()?;
        u32::try_from(v)
            .map_err(|_| Error::CorruptData(format!("step bytes: {v} does not fit 32 bits")))
    }

    /// A count, bounded by the bytes left (each element takes at least one byte).
    fn len(&mut self) -> Result<usize> {
        let v = self.get()?;
        if v > (self.bytes.len() - self.at) as u64 {
            return Err(Error::CorruptData(format!(
                "step bytes: count {v} exceeds the bytes left"
            )));
        }
        Ok(v as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Step {
        let mut s = Step::new();
        s.clear(3);
        s.push_job(
            7,
            Direction::Load,
            42,
            4,
            &[9, 10],
            &[100, 101, 102, 103, 104],
        );
        s.push_job(8, Direction::Store, 1 << 40, 0, &[5, 6, 7], &[300_000]);
        s.set_flush([3, 1, 3]);
        s
    }

    #[test]
    fn encode_decode_round_trip() {
        let s = sample();
        let mut bytes = Vec::new();
        s.encode(&mut bytes);
        let mut d = Step::new();
        d.decode(&bytes).unwrap();
        assert_eq!(d, s);
        assert_eq!(d.flush(), &[1, 3]);
        let j = d.jobs()[0];
        assert_eq!(
            (j.num_gpu_blocks, d.src(&j), d.dst(&j)),
            (5, &[9, 10][..], &[100, 101, 102, 103, 104][..])
        );
        assert_eq!(d.jobs()[1].num_gpu_blocks, 3);
    }

    /// `sample()` encoded with the varint at body offset `at` (the block_size_factor, 3) replaced
    /// by `varint`, the CRC recomputed.
    fn with_factor_varint(varint: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::new();
        sample().encode(&mut bytes);
        let mut b = bytes[..6].to_vec();
        b.extend_from_slice(varint);
        b.extend_from_slice(&bytes[7..bytes.len() - 4]);
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        b
    }

    fn corrupt(bytes: &[u8]) -> String {
        match Step::new().decode(bytes) {
            Err(Error::CorruptData(m)) => m,
            other => panic!("decode of {bytes:02x?}: {other:?}"),
        }
    }

    #[test]
    fn decode_reads_only_canonical_varints() {
        let mut d = Step::new();
        d.decode(&with_factor_varint(&[3])).unwrap();
        assert_eq!(d, sample());
        // 3 as two or three bytes (redundant zero groups): refused.
        assert!(corrupt(&with_factor_varint(&[0x83, 0x00])).contains("non-canonical"));
        assert!(corrupt(&with_factor_varint(&[0x83, 0x80, 0x00])).contains("non-canonical"));
        // A 10th byte carrying bits beyond 64, and an 11-byte varint: refused.
        let mut over = [0xff; 10];
        over[9] = 0x02;
        assert!(corrupt(&with_factor_varint(&over)).contains("beyond 64 bits"));
        let mut long = [0x80; 11];
        long[10] = 0x01;
        assert!(corrupt(&with_factor_varint(&long)).contains("beyond 64 bits"));
        // u64::MAX as a factor: a canonical varint, but not a u32.
        let mut max = [0xff; 10];
        max[9] = 0x01;
        assert!(corrupt(&with_factor_varint(&max)).contains("32 bits"));
    }

    #[test]
    fn decode_rejects_trailing_bytes_and_unknown_kinds() {
        let mut bytes = Vec::new();
        sample().encode(&mut bytes);
        // A byte after the body, the CRC recomputed over it.
        let mut b = bytes[..bytes.len() - 4].to_vec();
        b.push(0);
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        assert!(corrupt(&b).contains("trailing bytes"));
        // A byte after the CRC.
        let mut b = bytes.clone();
        b.push(0);
        assert!(corrupt(&b).contains("checksum"));
        // Job kind 2 (the first job's kind is body byte 9: magic 4, version 2, factor, n_jobs,
        // id).
        let mut b = bytes[..bytes.len() - 4].to_vec();
        assert_eq!(b[9], 0);
        b[9] = 2;
        let crc = crc32fast::hash(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        assert!(corrupt(&b).contains("job kind 2"));
    }

    #[test]
    fn decode_rejects_truncated_corrupt_and_foreign_bytes() {
        let mut bytes = Vec::new();
        sample().encode(&mut bytes);
        let mut d = sample();
        d.push_job(99, Direction::Load, 0, 0, &[], &[]);
        let before = d.clone();
        for n in 0..bytes.len() {
            assert!(
                matches!(d.decode(&bytes[..n]), Err(Error::CorruptData(_))),
                "truncated to {n}"
            );
        }
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(
                matches!(d.decode(&b), Err(Error::CorruptData(_))),
                "flipped byte {i}"
            );
        }
        let mut b = bytes.clone();
        b[4] = 2;
        assert!(matches!(d.decode(&b), Err(Error::CorruptData(m)) if m.contains("version 2")));
        assert_eq!(d, before, "a failed decode changes nothing");
    }

    /// The worked example of `docs/step-format.md`, byte for byte.
    #[test]
    fn the_documented_example() {
        let mut s = Step::new();
        s.clear(2);
        s.push_job(1, Direction::Store, 300, 0, &[40, 41], &[2]);
        s.set_flush([0]);
        let mut bytes = Vec::new();
        s.encode(&mut bytes);
        let hex: Vec<String> = bytes.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex.join(" "),
            "4b 56 4f 53 01 00 02 01 01 01 ac 02 00 02 28 29 01 02 01 00 55 8b 0d d9"
        );
        let doc = include_str!("../../docs/step-format.md");
        assert!(
            doc.contains(&hex.join(" ")),
            "docs/step-format.md shows these bytes"
        );
    }
}
