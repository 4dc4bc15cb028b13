#![no_main]
//! libFuzzer entry point; the harness is `kvoffload_fuzz::worker_jobs`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: kvoffload_fuzz::worker_jobs::Input| kvoffload_fuzz::worker_jobs::run(&input));
