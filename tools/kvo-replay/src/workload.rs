//! The embedded workload: a seeded synthetic multi-turn chat workload, generated in the Mooncake
//! trace form (see [`crate::trace`]), so `kvo-replay` runs with no input file.
//!
//! What it models ([`ChatParams`] holds the numbers, [`ChatParams::default`] documents them):
//! - a few **system prompts**, shared: a conversation picks one by Zipf popularity;
//! - **conversations**: each turn's prompt is the system prompt, the whole history (earlier user
//!   messages and answers) and a new user message, so it extends the previous turn's prompt;
//!   the next turn arrives after the answer was generated and the user thought;
//! - a long tail of **one-off requests** (unique prompts, half of them after a system prompt);
//! - **arrival times**: conversations and one-offs start as Poisson processes over the duration.
//!
//! Blocks are prefix-chained ids as in Mooncake traces: a block inside a system prompt has the
//! same id for every request using that prompt; any later block is private to its conversation.

use crate::trace::{Request, Workload};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp, LogNormal, Zipf};
use std::collections::HashMap;

/// Parameters of the synthetic chat workload.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatParams {
    /// Seed of the generator (ChaCha8: the same seed gives the same workload on every machine).
    pub seed: u64,
    /// Tokens per block id.
    pub block_tokens: u32,
    /// Shared system prompts.
    pub system_prompts: usize,
    /// System prompt length in tokens, uniform in this range (inclusive).
    pub system_prompt_tokens: (u64, u64),
    /// Zipf exponent of the system prompts' popularity (1: the first is twice as popular as the
    /// second).
    pub system_prompt_zipf: f64,
    /// Conversations.
    pub conversations: usize,
    /// Mean turns of a conversation (geometric, at least 1).
    pub mean_turns: f64,
    /// Most turns of a conversation.
    pub max_turns: u32,
    /// User message tokens: log-normal with this median and shape (sigma).
    pub user_tokens: (f64, f64),
    /// Answer tokens: log-normal with this median and shape, capped by `max_output_tokens`.
    pub output_tokens: (f64, f64),
    /// Most answer tokens.
    pub max_output_tokens: u64,
    /// Milliseconds per answer token before the user reads the answer.
    pub ms_per_output_token: f64,
    /// Mean time the user thinks before the next turn (exponential), milliseconds.
    pub think_ms: f64,
    /// One-off requests.
    pub one_offs: usize,
    /// One-off prompt tokens: log-normal with this median and shape, capped by `max_one_off_tokens`.
    pub one_off_tokens: (f64, f64),
    /// Most one-off prompt tokens.
    pub max_one_off_tokens: u64,
    /// Conversations and one-offs start within this many milliseconds.
    pub duration_ms: u64,
}

impl Default for ChatParams {
    /// 500 conversations (mean 4 turns, at most 16) over 6 system prompts of 1,024–4,096 tokens,
    /// user messages of median 200 tokens, answers of median 200 tokens (at most 2,048), 30 s
    /// mean think time, and 1,000 one-off prompts of median 1,500 tokens (at most 32,768), all
    /// starting within 10 minutes; 512-token blocks; seed 1.
    fn default() -> Self {
        Self {
            seed: 1,
            block_tokens: 512,
            system_prompts: 6,
            system_prompt_tokens: (1024, 4096),
            system_prompt_zipf: 1.0,
            conversations: 500,
            mean_turns: 4.0,
            max_turns: 16,
            user_tokens: (200.0, 0.8),
            output_tokens: (200.0, 0.7),
            max_output_tokens: 2048,
            ms_per_output_token: 25.0,
            think_ms: 30_000.0,
            one_offs: 1000,
            one_off_tokens: (1500.0, 1.0),
            max_one_off_tokens: 32_768,
            duration_ms: 300_000,
        }
    }
}

/// Block scope: inside a system prompt (shared) or private to one conversation or one-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Scope {
    System(usize),
    Private(usize),
}

/// Assigns block ids, in order of first use (as Mooncake's remapped ids).
struct Ids {
    block_tokens: u64,
    ids: HashMap<(Scope, u64), u64>,
}

impl Ids {
    /// The block ids of a prompt of `tokens` tokens: a system prompt of `system` tokens (of
    /// prompt `p`, if any) followed by text private to `private`.
    fn prompt(&mut self, system: Option<(usize, u64)>, private: usize, tokens: u64) -> Vec<u64> {
        let bt = self.block_tokens;
        (0..tokens.div_ceil(bt))
            .map(|i| {
                let scope = match system {
                    Some((p, len)) if (i + 1) * bt <= len => Scope::System(p),
                    _ => Scope::Private(private),
                };
                let next = self.ids.len() as u64;
                *self.ids.entry((scope, i)).or_insert(next)
            })
            .collect()
    }
}

fn lognormal(rng: &mut ChaCha8Rng, (median, sigma): (f64, f64), max: u64) -> u64 {
    let d = LogNormal::new(median.ln(), sigma).expect("validated parameters");
    (d.sample(rng).round() as u64).clamp(1, max)
}

impl ChatParams {
    /// Checks the parameters (the generator then cannot fail).
    pub fn validate(&self) -> anyhow::Result<()> {
        let ok = self.block_tokens > 0
            && self.system_prompts > 0
            && self.system_prompt_tokens.0 >= 1
            && self.system_prompt_tokens.0 <= self.system_prompt_tokens.1
            && self.system_prompt_zipf > 0.0
            && self.mean_turns >= 1.0
            && self.max_turns >= 1
            && [self.user_tokens, self.output_tokens, self.one_off_tokens]
                .iter()
                .all(|&(m, s)| m >= 1.0 && s > 0.0 && m.is_finite() && s.is_finite())
            && self.max_output_tokens >= 1
            && self.max_one_off_tokens >= 1
            && self.ms_per_output_token >= 0.0
            && self.think_ms > 0.0
            && self.duration_ms > 0
            && self.conversations + self.one_offs > 0;
        anyhow::ensure!(ok, "invalid synthetic workload parameters: {self:?}");
        Ok(())
    }

    /// Generates the workload.
    pub fn generate(&self) -> anyhow::Result<Workload> {
        self.validate()?;
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut ids = Ids {
            block_tokens: self.block_tokens as u64,
            ids: HashMap::new(),
        };
        let system: Vec<u64> = (0..self.system_prompts)
            .map(|_| rng.random_range(self.system_prompt_tokens.0..=self.system_prompt_tokens.1))
            .collect();
        let popularity = Zipf::new(self.system_prompts as f64, self.system_prompt_zipf)
            .map_err(|e| anyhow::anyhow!("system prompt popularity: {e:?}"))?;
        let think =
            Exp::new(1.0 / self.think_ms).map_err(|e| anyhow::anyhow!("think time: {e:?}"))?;
        let p_more = 1.0 - 1.0 / self.mean_turns;
        let mut requests = Vec::new();
        for c in 0..self.conversations {
            let p = popularity.sample(&mut rng) as usize - 1;
            let mut at = rng.random_range(0..self.duration_ms) as f64;
            let mut history = 0;
            for turn in 0..self.max_turns {
                if turn > 0 && !rng.random_bool(p_more) {
                    break;
                }
                let input = system[p] + history + lognormal(&mut rng, self.user_tokens, u64::MAX);
                let output = lognormal(&mut rng, self.output_tokens, self.max_output_tokens);
                requests.push(Request {
                    arrival_ms: at as u64,
                    input_tokens: input,
                    output_tokens: output,
                    blocks: ids.prompt(Some((p, system[p])), c, input),
                });
                history = input - system[p] + output;
                at += output as f64 * self.ms_per_output_token + think.sample(&mut rng);
            }
        }
        for o in 0..self.one_offs {
            let private = self.conversations + o;
            let at = rng.random_range(0..self.duration_ms);
            let body = lognormal(&mut rng, self.one_off_tokens, self.max_one_off_tokens);
            let output = lognormal(&mut rng, self.output_tokens, self.max_output_tokens);
            let sys = rng
                .random_bool(0.5)
                .then(|| popularity.sample(&mut rng) as usize - 1);
            let (input, blocks) = match sys {
                Some(p) => (
                    system[p] + body,
                    ids.prompt(Some((p, system[p])), private, system[p] + body),
                ),
                None => (body, ids.prompt(None, private, body)),
            };
            requests.push(Request {
                arrival_ms: at,
                input_tokens: input,
                output_tokens: output,
                blocks,
            });
        }
        requests.sort_by_key(|r| r.arrival_ms);
        Ok(Workload {
            name: format!("embedded chat workload (seed {})", self.seed),
            block_tokens: self.block_tokens,
            requests,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_and_shaped() {
        let p = ChatParams::default();
        let a = p.generate().unwrap();
        assert_eq!(a, p.generate().unwrap(), "same seed, same workload");
        let b = ChatParams {
            seed: 2,
            ..p.clone()
        }
        .generate()
        .unwrap();
        assert_ne!(a.requests, b.requests);
        let bt = p.block_tokens as u64;
        for r in &a.requests {
            assert_eq!(r.blocks.len() as u64, r.input_tokens.div_ceil(bt));
            assert!(r.output_tokens >= 1 && r.output_tokens <= p.max_output_tokens);
        }
        assert!(
            a.requests
                .windows(2)
                .all(|w| w[0].arrival_ms <= w[1].arrival_ms)
        );
        // Turns extend their history: some request's blocks are a proper prefix of a later one's.
        let n = a.requests.len();
        assert!(
            n > p.conversations + p.one_offs,
            "multi-turn conversations: {n}"
        );
        let full = |r: &Request| r.blocks[..(r.input_tokens / bt) as usize].to_vec();
        let extended = (0..n).any(|i| {
            let f = full(&a.requests[i]);
            f.len() > 4
                && a.requests[i + 1..]
                    .iter()
                    .any(|r| r.blocks.len() > f.len() && r.blocks.starts_with(&f))
        });
        assert!(extended);
        // Shared system prompts: block id 0 (the first system prompt's first block) is reused widely.
        let shared = a
            .requests
            .iter()
            .filter(|r| r.blocks[0] == a.requests[0].blocks[0])
            .count();
        assert!(shared > 10, "{shared}");
        // One-offs: many requests share not even their first block.
        let firsts: std::collections::HashSet<u64> =
            a.requests.iter().map(|r| r.blocks[0]).collect();
        assert!(firsts.len() > p.one_offs / 4, "{}", firsts.len());
    }
}
