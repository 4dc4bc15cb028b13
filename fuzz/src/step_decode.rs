//! The step decoder on arbitrary bytes, through the Rust API and `kvo_step_decode`, and
//! encode∘decode round trips of plans written field by field in the documented format.

use arbitrary::Arbitrary;
use kvoffload::ffi::*;
use kvoffload::plan::{Direction, FORMAT_VERSION, Step};
use std::ptr::null_mut;

/// A fuzz input: raw bytes for the decoder, or a plan to write, decode and re-encode.
#[derive(Arbitrary, Debug)]
pub enum Input {
    Bytes(Vec<u8>),
    /// A valid plan's bytes with one mutation (a flipped bit, truncation, a patched CRC).
    Mutated {
        plan: Plan,
        at: u16,
        flip: u8,
        fix_crc: bool,
        cut: bool,
    },
    Plan(Plan),
}

#[derive(Arbitrary, Debug, Clone)]
pub struct Plan {
    pub(crate) factor: u32,
    pub(crate) jobs: Vec<PlanJob>,
    pub(crate) flush: Vec<u64>,
}

#[derive(Arbitrary, Debug, Clone)]
pub(crate) struct PlanJob {
    pub(crate) id: u64,
    pub(crate) store: bool,
    pub(crate) request_id: u64,
    pub(crate) block_index: u32,
    pub(crate) src: Vec<u32>,
    pub(crate) dst: Vec<u32>,
}

fn put(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The documented format (`KVOS`, u16 version, LEB128 fields, CRC-32), written independently of
/// the library's encoder.
pub(crate) fn write_plan(p: &Plan) -> Vec<u8> {
    let mut out = b"KVOS".to_vec();
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    put(&mut out, p.factor as u64);
    put(&mut out, p.jobs.len() as u64);
    for j in &p.jobs {
        put(&mut out, j.id);
        put(&mut out, j.store as u64);
        put(&mut out, j.request_id);
        put(&mut out, j.block_index as u64);
        for ids in [&j.src, &j.dst] {
            put(&mut out, ids.len() as u64);
            for &b in ids {
                put(&mut out, b as u64);
            }
        }
    }
    put(&mut out, p.flush.len() as u64);
    for &f in &p.flush {
        put(&mut out, f);
    }
    let crc = crc32(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// CRC-32 (IEEE), bitwise: the harness's own, to check the library's.
fn crc32(bytes: &[u8]) -> u32 {
    let mut c = !0u32;
    for &b in bytes {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                (c >> 1) ^ 0xEDB8_8320
            } else {
                c >> 1
            };
        }
    }
    !c
}

/// A plan already decoded once, to check that a failed decode leaves it unchanged.
fn sentinel() -> Step {
    let mut s = Step::new();
    let bytes = write_plan(&Plan {
        factor: 2,
        jobs: vec![PlanJob {
            id: 7,
            store: true,
            request_id: 3,
            block_index: 0,
            src: vec![1, 2],
            dst: vec![9],
        }],
        flush: vec![5],
    });
    s.decode(&bytes).expect("sentinel plan");
    s
}

/// Decodes `bytes` with the Rust API and the C API; both agree, a failure changes nothing, and
/// a success re-encodes to a plan that decodes equal.
fn decode_any(bytes: &[u8]) -> Option<Step> {
    let mut s = sentinel();
    let before = s.clone();
    let r = s.decode(bytes);
    let mut h = null_mut();
    // SAFETY: out-pointer; the step is freed below.
    assert_eq!(unsafe { kvo_step_new(&mut h) }, kvo_status::Ok);
    // SAFETY: live step, `bytes.len()` readable bytes.
    let st = unsafe { kvo_step_decode(h, bytes.as_ptr(), bytes.len()) };
    // SAFETY: live step, freed once.
    unsafe { kvo_step_free(h) };
    match r {
        Err(e) => {
            assert!(
                matches!(e, kvoffload::Error::CorruptData(_)),
                "decode error {e}"
            );
            assert_eq!(
                st,
                kvo_status::CorruptData,
                "C decode of bytes the Rust decoder refuses"
            );
            assert_eq!(s, before, "a failed decode changed the plan");
            None
        }
        Ok(()) => {
            assert_eq!(
                st,
                kvo_status::Ok,
                "C decode of bytes the Rust decoder takes"
            );
            let mut again = Vec::new();
            s.encode(&mut again);
            let mut d = Step::new();
            d.decode(&again).expect("re-encoded bytes decode");
            assert_eq!(d, s, "decode(encode(decode(bytes))) differs");
            Some(s)
        }
    }
}

/// Runs one input; panics when the library breaks a promise.
pub fn run(input: &Input) {
    match input {
        Input::Bytes(b) => {
            decode_any(b);
        }
        Input::Mutated {
            plan,
            at,
            flip,
            fix_crc,
            cut,
        } => {
            let mut b = write_plan(plan);
            let at = *at as usize % b.len();
            if *cut {
                b.truncate(at);
            } else {
                b[at] ^= flip | 1;
            }
            if *fix_crc && b.len() >= 4 {
                let n = b.len() - 4;
                let crc = crc32(&b[..n]);
                b[n..].copy_from_slice(&crc.to_le_bytes());
            }
            let accepted = decode_any(&b).is_some();
            // CRC-32 detects every error burst of up to 32 bits: a flipped byte is refused
            // unless the checksum was recomputed.
            assert!(
                !accepted || *fix_crc || *cut,
                "a corrupted plan was accepted: {b:?}"
            );
        }
        Input::Plan(p) => {
            let bytes = write_plan(p);
            let s = decode_any(&bytes).expect("a well-formed plan decodes");
            assert_eq!(s.block_size_factor, p.factor);
            assert_eq!(s.jobs().len(), p.jobs.len());
            for (j, want) in s.jobs().iter().zip(&p.jobs) {
                let kind = if want.store {
                    Direction::Store
                } else {
                    Direction::Load
                };
                assert_eq!(
                    (j.id, j.kind, j.request_id, j.block_index),
                    (want.id, kind, want.request_id, want.block_index)
                );
                assert_eq!(s.src(j), &want.src[..]);
                assert_eq!(s.dst(j), &want.dst[..]);
                let gpu = if want.store { &want.src } else { &want.dst };
                assert_eq!(j.num_gpu_blocks as usize, gpu.len());
            }
            assert_eq!(s.flush(), &p.flush[..]);
            let mut again = Vec::new();
            s.encode(&mut again);
            assert_eq!(again, bytes, "encode(decode(bytes)) is not the bytes");
        }
    }
}
