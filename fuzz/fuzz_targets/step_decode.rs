#![no_main]
//! libFuzzer entry point; the harness is `kvoffload_fuzz::step_decode`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: kvoffload_fuzz::step_decode::Input| kvoffload_fuzz::step_decode::run(&input));
