//! Compiles the C and C++ programs of `c_tests/` against the committed `include/kvoffload.h`,
//! links them to the cdylib that `cargo test` builds (`target/<profile>/deps/libkvoffload.so`),
//! and runs them.
//!
//! The compilers are `$CC` (default `cc`) and `$CXX` (default `c++`). With `KVO_VALGRIND=1`
//! and `valgrind` installed, the programs run under valgrind and any memory error or definite
//! leak fails the test.
#![cfg(unix)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const CRATE_DIR: &str = env!("CARGO_MANIFEST_DIR");

/// The directory holding the cdylib: `cargo test` builds the library with all its crate types
/// into `target/<profile>/deps/`, next to this test's executable; `cargo build` puts it one
/// level up.
fn lib_dir() -> PathBuf {
    let name = format!(
        "{}kvoffload{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    );
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("the test executable's directory");
    let candidates = [Some(deps), deps.parent()];
    for dir in candidates.into_iter().flatten() {
        if dir.join(&name).is_file() {
            return dir.to_path_buf();
        }
    }
    panic!(
        "{name} is not in {} nor its parent: build the crate's cdylib first (`cargo build --lib`)",
        deps.display()
    );
}

/// A compiler from `var` (which may carry arguments, as in `CC="ccache gcc"`), or `default`.
fn compiler(var: &str, default: &str) -> Command {
    let value = std::env::var(var).unwrap_or_default();
    let mut words = value.split_whitespace();
    let mut cmd = Command::new(words.next().unwrap_or(default));
    cmd.args(words);
    cmd
}

/// A directory of its own for each program of each test process, under `target/tmp/`.
fn out_dir(source: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "c_api-{}-{}",
        std::process::id(),
        source.replace('.', "_")
    ));
    std::fs::create_dir_all(&dir).expect("create the output directory");
    dir
}

fn describe(what: &str, out: &Output) -> String {
    format!(
        "{what}: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn valgrind_wanted() -> bool {
    std::env::var("KVO_VALGRIND").is_ok_and(|v| v == "1")
        && Command::new("valgrind")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
}

/// Compiles `c_tests/<source>` as C11 or C++17, links it to the cdylib, runs it and checks that
/// it succeeds. Returns its stdout.
fn build_and_run(source: &str) -> String {
    let cxx = source.ends_with(".cpp");
    let lib = lib_dir();
    let src = Path::new(CRATE_DIR).join("c_tests").join(source);
    let dir = out_dir(source);
    let exe = dir.join(source.replace('.', "_"));

    let mut cc = if cxx {
        compiler("CXX", "c++")
    } else {
        compiler("CC", "cc")
    };
    cc.arg(if cxx { "-std=c++17" } else { "-std=c11" })
        .args(["-Wall", "-Wextra", "-Werror", "-pedantic", "-g"])
        .arg(format!("-I{CRATE_DIR}/include"))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lkvoffload")
        .arg(format!("-Wl,-rpath,{}", lib.display()));
    let out = cc
        .output()
        .unwrap_or_else(|e| panic!("cannot run the compiler {cc:?}: {e}"));
    assert!(
        out.status.success(),
        "{}",
        describe(&format!("compiling {source} failed ({cc:?})"), &out)
    );

    let mut run = if valgrind_wanted() {
        let mut v = Command::new("valgrind");
        v.args([
            "--quiet",
            "--error-exitcode=99",
            "--leak-check=full",
            "--errors-for-leak-kinds=definite",
        ])
        .arg(&exe);
        v
    } else {
        Command::new(&exe)
    };
    // Cargo puts target/<profile> on LD_LIBRARY_PATH, which beats the binary's RUNPATH: load the
    // library this test linked, not a stale copy from an earlier `cargo build`.
    let out = run
        .env("LD_LIBRARY_PATH", &lib)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    assert!(
        out.status.success(),
        "{}",
        describe(&format!("{source} failed"), &out)
    );
    // Kept on failure (the asserts above), for a look with a debugger.
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{source}: {}", stdout.trim_end());
    stdout
}

/// The summary line of a program that reports `N passed, M failed`.
fn assert_all_passed(source: &str, stdout: &str) {
    let last = stdout.lines().last().unwrap_or("");
    assert!(
        last.ends_with(" passed, 0 failed") && !last.starts_with("0 passed"),
        "{source}: unexpected summary {last:?}\n{stdout}"
    );
}

#[test]
fn header_compiles_as_c11() {
    build_and_run("header_only.c");
}

#[test]
fn header_compiles_as_cxx17() {
    build_and_run("header_only.cpp");
}

#[test]
fn manager_api_from_c() {
    let out = build_and_run("manager.c");
    assert_all_passed("manager.c", &out);
}

#[test]
fn manager_api_from_cxx() {
    let out = build_and_run("manager.cpp");
    assert_all_passed("manager.cpp", &out);
}

#[test]
fn scheduler_api_from_c() {
    let out = build_and_run("scheduler.c");
    assert_all_passed("scheduler.c", &out);
}

#[test]
fn scheduler_api_from_cxx() {
    let out = build_and_run("scheduler.cpp");
    assert_all_passed("scheduler.cpp", &out);
}

/// An aborted request's queued load must not overwrite the KV of the request that reuses its
/// GPU blocks (checked on the bytes).
#[test]
fn abort_while_loading_keeps_the_reusing_requests_kv() {
    let out = build_and_run("abort_race.c");
    assert_all_passed("abort_race.c", &out);
}

#[test]
fn worker_api_from_c() {
    let out = build_and_run("worker.c");
    assert_all_passed("worker.c", &out);
}

/// The README's C example is `c_tests/readme_example.c` (after its first comment line), and it
/// compiles and runs: the README stays true.
#[test]
fn readme_c_example_is_the_tested_program() {
    let root = env!("CARGO_MANIFEST_DIR");
    let readme = std::fs::read_to_string(format!("{root}/README.md")).unwrap();
    let block = readme
        .split("```c\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("README.md has a ```c block");
    let file = std::fs::read_to_string(format!("{root}/c_tests/readme_example.c")).unwrap();
    let body = file.split_once('\n').map(|(_, b)| b).unwrap_or("");
    assert_eq!(
        block, body,
        "README.md's C example and c_tests/readme_example.c differ"
    );
    build_and_run("readme_example.c");
}

/// The library exports exactly the functions the header declares (all `kvo_*`), nothing else.
#[test]
fn exported_symbols_match_the_header() {
    let root = env!("CARGO_MANIFEST_DIR");
    let header = std::fs::read_to_string(format!("{root}/include/kvoffload.h")).unwrap();
    // Function names: identifiers followed by `(` on code lines (not comment lines).
    let mut declared: Vec<String> = Vec::new();
    for line in header.lines() {
        let t = line.trim_start();
        if t.starts_with('*') || t.starts_with("/*") || t.starts_with('#') {
            continue;
        }
        for (i, _) in line.match_indices("kvo_") {
            let before = line[..i].chars().next_back();
            if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
                continue;
            }
            let rest = &line[i..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            if rest[end..].starts_with('(') {
                declared.push(rest[..end].to_owned());
            }
        }
    }
    declared.sort();
    declared.dedup();
    let lib = lib_dir().join(format!(
        "{}kvoffload{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("nm (binutils) runs");
    assert!(out.status.success(), "nm failed on {}", lib.display());
    let mut exported: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| s.starts_with("kvo_"))
        .map(str::to_owned)
        .collect();
    exported.sort();
    assert_eq!(
        exported, declared,
        "exported kvo_* symbols differ from the header's functions"
    );
    let others: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.split_whitespace().nth(1).is_some_and(|t| t == "T"))
        .filter_map(|l| l.split_whitespace().nth(2))
        .filter(|s| !s.starts_with("kvo_"))
        .map(str::to_owned)
        .collect();
    assert!(
        others.is_empty(),
        "functions exported beside kvo_*: {others:?}"
    );
}
