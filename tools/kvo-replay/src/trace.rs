//! Request traces in the Mooncake JSON-lines format (kvcache-ai/Mooncake, `FAST25-release/traces`):
//! one object a line, `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [...]}`. `hash_ids` are the prompt's blocks of `block_tokens` tokens (the last may
//! be partial), prefix-chained: equal ids at a position mean an equal prefix up to that block.

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

/// One request of a workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Arrival time in milliseconds from the start.
    pub arrival_ms: u64,
    /// Prompt tokens (>= 1).
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Prefix-chained ids of the prompt's blocks, `ceil(input_tokens / block_tokens)` of them.
    pub blocks: Vec<u64>,
}

/// A request sequence in arrival order, with the block size its ids are for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Workload {
    /// Where it came from (a file name, or the generator and its seed).
    pub name: String,
    /// Tokens per block id.
    pub block_tokens: u32,
    /// The requests, ordered by arrival (ties keep their order).
    pub requests: Vec<Request>,
}

impl Workload {
    /// Full prompt blocks over all requests (the blocks a prefix cache can hold).
    pub fn full_blocks(&self) -> u64 {
        self.requests
            .iter()
            .map(|r| r.input_tokens / self.block_tokens as u64)
            .sum()
    }

    /// Distinct ids among the full prompt blocks (the capacity that holds every block).
    pub fn distinct_full_blocks(&self) -> usize {
        let mut seen = crate::fasthash::HashSet::<u64>::with_capacity_and_hasher(
            self.full_blocks() as usize,
            crate::fasthash::FoldState::default(),
        );
        for r in &self.requests {
            seen.extend(&r.blocks[..(r.input_tokens / self.block_tokens as u64) as usize]);
        }
        seen.len()
    }
}

#[derive(Deserialize, Serialize)]
struct Line {
    timestamp: u64,
    input_length: u64,
    output_length: u64,
    hash_ids: Vec<u64>,
}

/// Reads a trace; `block_tokens` is the trace's tokens per hash id. Fails with the file name and
/// line number on a line that is not a trace record or whose ids do not cover its prompt.
pub fn read(path: &Path, block_tokens: u32) -> Result<Workload> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    parse(&text, block_tokens, &path.display().to_string())
}

/// Parses trace text (see [`read`]); `name` names it in errors.
pub fn parse(text: &str, block_tokens: u32, name: &str) -> Result<Workload> {
    let bt = block_tokens as u64;
    let mut requests = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{name} line {}", i + 1);
        let l: Line = serde_json::from_str(line).with_context(at)?;
        if l.input_length == 0 {
            bail!("{}: input_length is 0", at());
        }
        let need = l.input_length.div_ceil(bt);
        if l.hash_ids.len() as u64 != need {
            bail!(
                "{}: {} hash_ids for input_length {} ({need} blocks of {bt} tokens; is --block-tokens right?)",
                at(),
                l.hash_ids.len(),
                l.input_length
            );
        }
        requests.push(Request {
            arrival_ms: l.timestamp,
            input_tokens: l.input_length,
            output_tokens: l.output_length,
            blocks: l.hash_ids,
        });
    }
    if requests.is_empty() {
        bail!("{name}: no requests");
    }
    requests.sort_by_key(|r| r.arrival_ms);
    Ok(Workload {
        name: name.to_string(),
        block_tokens,
        requests,
    })
}

/// Writes `w` as a trace (the same format [`read`] reads).
pub fn write(w: &Workload, path: &Path) -> Result<()> {
    let mut out = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("{}", path.display()))?,
    );
    for r in &w.requests {
        let line = Line {
            timestamp: r.arrival_ms,
            input_length: r.input_tokens,
            output_length: r.output_tokens,
            hash_ids: r.blocks.clone(),
        };
        serde_json::to_writer(&mut out, &line)?;
        out.write_all(b"\n")?;
    }
    out.flush().with_context(|| format!("{}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_orders_by_arrival() {
        let t = "{\"timestamp\": 5, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\n\
                 {\"timestamp\": 1, \"input_length\": 2, \"output_length\": 0, \"hash_ids\": [1]}\n";
        let w = parse(t, 2, "t").unwrap();
        assert_eq!(w.requests.len(), 2);
        assert_eq!(w.requests[0].arrival_ms, 1);
        assert_eq!(w.requests[1].blocks, vec![1, 2]);
        assert_eq!(w.full_blocks(), 2);
        assert_eq!(w.distinct_full_blocks(), 1);
    }

    #[test]
    fn errors_name_the_line() {
        let t = "{\"timestamp\": 0, \"input_length\": 2, \"output_length\": 0, \"hash_ids\": [1]}\n{oops\n";
        let e = format!("{:#}", parse(t, 2, "t").unwrap_err());
        assert!(e.contains("t line 2"), "{e}");
        let t =
            "{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 0, \"hash_ids\": [1]}\n";
        let e = format!("{:#}", parse(t, 2, "t").unwrap_err());
        assert!(e.contains("t line 1: 1 hash_ids for input_length 5"), "{e}");
        let t = "{\"timestamp\": 0, \"output_length\": 0, \"hash_ids\": [1]}\n";
        let e = format!("{:#}", parse(t, 2, "t").unwrap_err());
        assert!(e.contains("input_length"), "{e}");
        assert!(parse("\n", 2, "t").is_err());
    }

    #[test]
    fn written_traces_read_back() {
        let t =
            "{\"timestamp\": 1, \"input_length\": 3, \"output_length\": 1, \"hash_ids\": [1, 2]}\n";
        let w = parse(t, 2, "t").unwrap();
        let path =
            std::env::temp_dir().join(format!("kvo-replay-trace-{}.jsonl", std::process::id()));
        write(&w, &path).unwrap();
        let back = read(&path, 2).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(back.requests, w.requests);
    }
}
