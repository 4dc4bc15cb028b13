#![no_main]
//! libFuzzer entry point; the harness is `kvoffload_fuzz::scheduler_ops`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(
    |input: kvoffload_fuzz::scheduler_ops::Input| kvoffload_fuzz::scheduler_ops::run(&input)
);
