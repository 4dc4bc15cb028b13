//! Replays every committed input of `seeds/<target>/` and `regressions/<target>/` through its
//! harness, as libFuzzer would decode it (`Arbitrary::arbitrary_take_rest`). Runs on stable:
//! `cargo test --manifest-path fuzz/Cargo.toml`.

use arbitrary::{Arbitrary, Unstructured};
use std::path::Path;

fn replay<T: for<'a> Arbitrary<'a>>(target: &str, run: fn(&T)) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for dir in ["seeds", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        for e in entries {
            let path = e.expect("directory entry").path();
            let bytes = std::fs::read(&path).expect("read an input");
            if let Ok(input) = T::arbitrary_take_rest(Unstructured::new(&bytes)) {
                run(&input);
            }
            n += 1;
        }
    }
    assert!(n > 0, "no committed inputs for {target}");
}

#[test]
fn manager_ops() {
    replay("manager_ops", kvoffload_fuzz::manager_ops::run);
}

#[test]
fn scheduler_ops() {
    replay("scheduler_ops", kvoffload_fuzz::scheduler_ops::run);
}

#[test]
fn step_decode() {
    replay("step_decode", kvoffload_fuzz::step_decode::run);
}

#[test]
fn worker_jobs() {
    replay("worker_jobs", kvoffload_fuzz::worker_jobs::run);
}
