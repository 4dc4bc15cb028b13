//! A step plan: the load and store jobs the workers execute this step and the jobs they must
//! wait for (flush) before the forward pass; and its versioned binary encoding for shipping the
//! plan to worker processes.

use crate::error::{Error, Result};

/// Direction of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum JobKind {
    /// Host slots → GPU blocks.
    Load = 0,
    /// GPU blocks → host slots.
    Store = 1,
}

/// One job of a step. Its block ids are ranges of the step's block arena (see [`Step::src`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobDesc {
    /// Job id, unique for the scheduler's lifetime.
    pub id: u64,
    /// Direction.
    pub kind: JobKind,
    /// The request the job belongs to.
    pub request_id: u64,
    /// GPU blocks copied (one per GPU block; a host slot holds `block_size_factor` of them).
    pub group_size: u32,
    /// Logical index, within the request, of the first GPU block copied. For loads,
    /// `block_index % block_size_factor` sub-blocks of the first host slot are skipped (a partial
    /// first chunk); stores always start on a chunk boundary.
    pub block_index: u32,
    src: (u32, u32),
    dst: (u32, u32),
}

/// A step plan. Reused across steps: building into it does not allocate once warm.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// GPU blocks per host slot.
    pub block_size_factor: u32,
    jobs: Vec<JobDesc>,
    blocks: Vec<u32>,
    flush: Vec<u64>,
}

impl Step {
    /// An empty plan.
    pub fn new() -> Self {
        Self::default()
    }

    pub(crate) fn clear(&mut self, block_size_factor: u32) {
        self.block_size_factor = block_size_factor;
        self.jobs.clear();
        self.blocks.clear();
        self.flush.clear();
    }

    /// The jobs: loads first (in creation order), then stores.
    pub fn jobs(&self) -> &[JobDesc] {
        &self.jobs
    }

    /// Source block ids of `job` (host slots for a load, GPU block ids for a store).
    pub fn src(&self, job: &JobDesc) -> &[u32] {
        &self.blocks[job.src.0 as usize..job.src.1 as usize]
    }

    /// Destination block ids of `job` (GPU block ids for a load, host slots for a store).
    pub fn dst(&self, job: &JobDesc) -> &[u32] {
        &self.blocks[job.dst.0 as usize..job.dst.1 as usize]
    }

    /// Jobs the workers must finish before this step's forward pass (preempted requests' stores,
    /// stores whose GPU blocks were reallocated, everything at a reset), ascending.
    pub fn flush(&self) -> &[u64] {
        &self.flush
    }

    /// Appends a job whose block ids are `src` and `dst`.
    pub(crate) fn push_job(
        &mut self,
        id: u64,
        kind: JobKind,
        request_id: u64,
        block_index: u32,
        src: &[u32],
        dst: &[u32],
    ) {
        let group_size = if kind == JobKind::Load {
            dst.len()
        } else {
            src.len()
        } as u32;
        let s0 = self.blocks.len() as u32;
        self.blocks.extend_from_slice(src);
        let s1 = self.blocks.len() as u32;
        self.blocks.extend_from_slice(dst);
        let d1 = self.blocks.len() as u32;
        self.jobs.push(JobDesc {
            id,
            kind,
            request_id,
            group_size,
            block_index,
            src: (s0, s1),
            dst: (s1, d1),
        });
    }

    /// Appends a job copied from another plan.
    pub(crate) fn push_from(&mut self, other: &Step, job: &JobDesc) {
        self.push_job(
            job.id,
            job.kind,
            job.request_id,
            job.block_index,
            other.src(job),
            other.dst(job),
        );
    }

    pub(crate) fn set_flush(&mut self, ids: impl IntoIterator<Item = u64>) {
        self.flush.clear();
        self.flush.extend(ids);
        self.flush.sort_unstable();
        self.flush.dedup();
    }

    /// Encodes the plan: magic `KVOS`, format version, LEB128 varints, and a CRC-32 of everything
    /// before it. `out` is cleared first.
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
            let kind = match r.get()? {
                0 => JobKind::Load,
                1 => JobKind::Store,
                k => return Err(corrupt(&format!("job kind {k}"))),
            };
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
    fn get(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&b) = self.bytes.get(self.at) else {
                return Err(Error::CorruptData("step bytes: truncated varint".into()));
            };
            self.at += 1;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(Error::CorruptData(
            "step bytes: varint longer than 64 bits".into(),
        ))
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
            JobKind::Load,
            42,
            4,
            &[9, 10],
            &[100, 101, 102, 103, 104],
        );
        s.push_job(8, JobKind::Store, 1 << 40, 0, &[5, 6, 7], &[300_000]);
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
            (j.group_size, d.src(&j), d.dst(&j)),
            (5, &[9, 10][..], &[100, 101, 102, 103, 104][..])
        );
        assert_eq!(d.jobs()[1].group_size, 3);
    }

    #[test]
    fn decode_rejects_truncated_corrupt_and_foreign_bytes() {
        let mut bytes = Vec::new();
        sample().encode(&mut bytes);
        let mut d = sample();
        d.push_job(99, JobKind::Load, 0, 0, &[], &[]);
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
}
