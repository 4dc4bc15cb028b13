#![no_main]
//! libFuzzer entry point; the harness is `kvoffload_fuzz::manager_ops`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: kvoffload_fuzz::manager_ops::Input| kvoffload_fuzz::manager_ops::run(&input));
