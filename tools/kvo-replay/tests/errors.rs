//! Each documented error of `kvo-replay`: one message naming the problem, exit status 2 for
//! impossible options and 1 for input that cannot be read, never a panic.

mod common;

use common::*;

fn fails(args: &[&str], code: i32, message: &str) {
    let out = kvo(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
    assert!(err.contains(message), "{args:?}: {err:?} lacks {message:?}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.stdout.is_empty());
}

#[test]
fn bad_input_files() {
    fails(
        &["--trace", "/nonexistent/t.jsonl"],
        1,
        "kvo-replay: error: /nonexistent/t.jsonl: No such file",
    );
    let bad = temp("bad.jsonl");
    std::fs::write(&bad, "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1, 2]}\n{\"timestamp\": 1,\n").unwrap();
    fails(
        &["--trace", bad.to_str().unwrap()],
        1,
        "bad.jsonl line 2: EOF while parsing",
    );
    std::fs::write(
        &bad,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [1]}\n",
    )
    .unwrap();
    fails(
        &["--trace", bad.to_str().unwrap()],
        1,
        "line 1: 1 hash_ids for input_length 600 (2 blocks of 512 tokens",
    );
    std::fs::write(&bad, "").unwrap();
    fails(&["--trace", bad.to_str().unwrap()], 1, "no requests");
}

#[test]
fn impossible_options() {
    fails(&["--host-blocks", "0"], 2, "--host-blocks: 0");
    fails(&["--host-gib", "0"], 2, "--host-gib: 0");
    fails(&["--host-gib", "0.001"], 2, "less than one block");
    fails(&["--key-len", "8"], 2, "--key-len: 8 is not in 16..=64");
    fails(
        &["--factor", "3"],
        2,
        "--factor: 3 does not divide the 512-token block",
    );
    fails(&["--factor", "0"], 2, "--factor: 0");
    fails(&["--block-tokens", "0"], 2, "--block-tokens: 0");
    fails(&["--max-batch", "0"], 2, "--max-batch: 0");
    fails(&["--gpu-blocks", "3"], 2, "--gpu-blocks: request");
    fails(
        &["--copy", "--gpu-blocks", "0"],
        2,
        "--copy needs a GPU cache",
    );
    fails(
        &["--sweep", "--plot", "x.png"],
        2,
        "--plot: x.png is not an .svg file",
    );
    fails(&["--plot", "x.svg"], 2, "--sweep");
    fails(&["--policy", "fifo"], 2, "invalid value 'fifo'");
    fails(&["--semantics", "0.3"], 2, "invalid value '0.3'");
    fails(
        &["--host-blocks", "5", "--host-gib", "1"],
        2,
        "cannot be used with",
    );
    fails(
        &["--trace", "t.jsonl", "--seed", "2"],
        2,
        "cannot be used with",
    );
}
