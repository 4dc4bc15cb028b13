//! Compiles the C and C++ programs of `c_tests/` and `examples/` against the committed
//! `include/kvoffload.h` and `include/kvoffload.hpp`, links them to the cdylib that `cargo test`
//! builds (`target/<profile>/deps/libkvoffload.so`), and runs them: the in-tree build.
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

/// Compiles `<source>` (relative to the crate) as C11 or C++17, links it to the cdylib, runs it
/// and checks that it succeeds. Returns its stdout.
fn build_and_run(source: &str) -> String {
    let std = if source.ends_with(".cpp") {
        "-std=c++17"
    } else {
        "-std=c11"
    };
    build_and_run_with(source, std, &[])
}

/// [`build_and_run`] with the language standard `std` and `extra` compiler flags.
fn build_and_run_with(source: &str, std: &str, extra: &[&str]) -> String {
    let cxx = source.ends_with(".cpp");
    let lib = lib_dir();
    let src = Path::new(CRATE_DIR).join(source);
    let tag = format!("{source}{std}{}", extra.join("")).replace(['/', '.', '=', '+'], "_");
    let dir = out_dir(&tag);
    let exe = dir.join("program");

    let mut cc = if cxx {
        compiler("CXX", "c++")
    } else {
        compiler("CC", "cc")
    };
    cc.arg(std)
        .args(["-Wall", "-Wextra", "-Werror", "-pedantic", "-g"])
        .args(extra)
        .arg(format!("-I{CRATE_DIR}/include"))
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .arg(format!("-L{}", lib.display()))
        .arg("-lkvoffload")
        .arg(format!("-Wl,-rpath,{}", lib.display()));
    if cxx {
        cc.arg("-pthread");
    }
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
    let log = dir.join("statuses.log");
    let _ = std::fs::remove_file(&log);
    let out = run
        .env("LD_LIBRARY_PATH", &lib)
        .env("KVO_STATUS_LOG", &log)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    assert!(
        out.status.success(),
        "{}",
        describe(&format!("{source} failed"), &out)
    );
    let observed = std::fs::read_to_string(&log).unwrap_or_default();
    let checks_statuses = std::fs::read_to_string(&src)
        .is_ok_and(|text| text.contains("CHECK_STATUS(kvo_") || text.contains("CHECK_OK(kvo_"));
    assert!(
        !checks_statuses || observed.lines().count() > 0,
        "{source}: the checked statuses were not logged to {}",
        log.display()
    );
    check_observed_statuses(source, &observed);
    // Kept on failure (the asserts above), for a look with a debugger.
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{source}: {}", stdout.trim_end());
    stdout
}

/// The statuses each function's doc comment in the header lists (`KVO_STATUS_*` names), with
/// those of the function whose contract it refers to ("As for `kvo_x`", "same contract as
/// `kvo_x`"); and the value of each status name.
struct DocumentedStatuses {
    by_function: std::collections::HashMap<String, Vec<String>>,
    names: std::collections::HashMap<i32, String>,
}

fn documented_statuses() -> DocumentedStatuses {
    let header = std::fs::read_to_string(format!("{CRATE_DIR}/include/kvoffload.h")).unwrap();
    let statuses_in = |text: &str| -> Vec<String> {
        let mut v: Vec<String> = text
            .match_indices("KVO_STATUS_")
            .map(|(i, _)| {
                let rest = &text[i..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_uppercase() || c == '_'))
                    .unwrap_or(rest.len());
                rest[..end].to_owned()
            })
            .collect();
        v.sort();
        v.dedup();
        v
    };
    let mut names = std::collections::HashMap::new();
    for line in header.lines() {
        let t = line.trim();
        if let Some((name, value)) = t
            .strip_prefix("KVO_STATUS_")
            .and_then(|r| r.split_once(" = "))
        {
            let value: i32 = value.trim_end_matches(',').parse().expect("status value");
            names.insert(value, format!("KVO_STATUS_{name}"));
        }
    }
    // Each doc comment `/** ... */` and the declaration after it, up to its `;`.
    let mut by_function = std::collections::HashMap::new();
    let mut refers = Vec::new();
    let mut rest = header.as_str();
    while let Some(start) = rest.find("/**") {
        let Some(len) = rest[start..].find("*/") else {
            break;
        };
        let doc = &rest[start..start + len];
        let after = &rest[start + len + 2..];
        let decl = &after[..after.find([';', '{']).unwrap_or(after.len())];
        rest = after;
        if !decl.contains("kvo_status kvo_") {
            continue;
        }
        let name = decl[decl.find("kvo_status kvo_").unwrap() + "kvo_status ".len()..]
            .split('(')
            .next()
            .unwrap()
            .trim()
            .to_owned();
        for marker in ["As for `", "same contract as `"] {
            if let Some(i) = doc.find(marker) {
                let other = doc[i + marker.len()..]
                    .split('`')
                    .next()
                    .unwrap()
                    .to_owned();
                refers.push((name.clone(), other));
            }
        }
        by_function.insert(name, statuses_in(doc));
    }
    for (name, other) in refers {
        let inherited = by_function.get(&other).cloned().unwrap_or_default();
        by_function.get_mut(&name).unwrap().extend(inherited);
    }
    DocumentedStatuses { by_function, names }
}

/// Every `(function, status)` a test program observed (its `KVO_STATUS_LOG` lines) is one that
/// the function's doc comment lists (`KVO_STATUS_PANIC` is documented once, for every call, at
/// the top of the header).
fn check_observed_statuses(source: &str, log: &str) {
    let docs = documented_statuses();
    let mut wrong = Vec::new();
    for line in log.lines() {
        let (function, status) = line.split_once(' ').expect("log line: <function> <status>");
        let status: i32 = status.parse().expect("status number");
        let name = docs
            .names
            .get(&status)
            .cloned()
            .unwrap_or_else(|| format!("unknown status {status}"));
        let listed = docs
            .by_function
            .get(function)
            .is_some_and(|v| v.contains(&name));
        if !listed && name != "KVO_STATUS_PANIC" && !wrong.contains(&(function, name.clone())) {
            wrong.push((function, name));
        }
    }
    assert!(
        wrong.is_empty(),
        "{source}: statuses returned that the header's docs do not list: {wrong:?}"
    );
}

/// Every function returning `kvo_status` lists in its doc comment the statuses it returns
/// (at least `KVO_STATUS_OK`, or the contract of another function it refers to).
#[test]
fn every_fallible_function_documents_its_statuses() {
    let docs = documented_statuses();
    assert!(
        docs.by_function.len() > 40,
        "{} functions",
        docs.by_function.len()
    );
    assert_eq!(
        docs.names.get(&0).map(String::as_str),
        Some("KVO_STATUS_OK")
    );
    let undocumented: Vec<&String> = docs
        .by_function
        .iter()
        .filter(|(_, v)| !v.iter().any(|s| s == "KVO_STATUS_OK"))
        .map(|(f, _)| f)
        .collect();
    assert!(
        undocumented.is_empty(),
        "no statuses listed: {undocumented:?}"
    );
    // The checker itself: a status no doc of kvo_step_new lists is refused.
    let refused = std::panic::catch_unwind(|| {
        check_observed_statuses("self-test", "kvo_step_new 5\n");
    });
    assert!(
        refused.is_err(),
        "KVO_STATUS_NO_ROOM is not a status of kvo_step_new"
    );
    check_observed_statuses("self-test", "kvo_step_new 0\nkvo_step_new 1\n");
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
    build_and_run("c_tests/header_only.c");
}

#[test]
fn header_compiles_as_cxx17() {
    build_and_run("c_tests/header_only.cpp");
}

#[test]
fn manager_api_from_c() {
    let out = build_and_run("c_tests/manager.c");
    assert_all_passed("manager.c", &out);
}

#[test]
fn manager_api_from_cxx() {
    let out = build_and_run("c_tests/manager.cpp");
    assert_all_passed("manager.cpp", &out);
}

#[test]
fn scheduler_api_from_c() {
    let out = build_and_run("c_tests/scheduler.c");
    assert_all_passed("scheduler.c", &out);
}

#[test]
fn scheduler_api_from_cxx() {
    let out = build_and_run("c_tests/scheduler.cpp");
    assert_all_passed("scheduler.cpp", &out);
}

/// `kvoffload.hpp` alone, as C++17 and C++20, with and without exceptions.
#[test]
fn cxx_header_compiles_alone_as_cxx17_and_cxx20() {
    for std in ["-std=c++17", "-std=c++20"] {
        for extra in [&[][..], &["-fno-exceptions"][..]] {
            build_and_run_with("c_tests/header_only_hpp.cpp", std, extra);
        }
    }
}

/// The worker through the C++ wrappers' non-throwing forms, also built without exceptions.
#[test]
fn worker_api_from_cxx() {
    for (std, extra) in [
        ("-std=c++17", &[][..]),
        ("-std=c++20", &["-fno-exceptions"][..]),
    ] {
        let out = build_and_run_with("c_tests/worker.cpp", std, extra);
        assert_all_passed("worker.cpp", &out);
    }
}

/// An aborted request's queued load must not overwrite the KV of the request that reuses its
/// GPU blocks (checked on the bytes).
#[test]
fn abort_while_loading_keeps_the_reusing_requests_kv() {
    let out = build_and_run("c_tests/abort_race.c");
    assert_all_passed("abort_race.c", &out);
}

#[test]
fn worker_api_from_c() {
    let out = build_and_run("c_tests/worker.c");
    assert_all_passed("worker.c", &out);
}

/// The README's example in `lang` (its first ```lang block) is `path` after the file's first
/// comment line.
fn assert_readme_example(lang: &str, path: &str) {
    let readme = std::fs::read_to_string(format!("{CRATE_DIR}/README.md")).unwrap();
    let block = readme
        .split(&format!("```{lang}\n"))
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .unwrap_or_else(|| panic!("README.md has a ```{lang} block"));
    let file = std::fs::read_to_string(format!("{CRATE_DIR}/{path}")).unwrap();
    let body = file.split_once('\n').map(|(_, b)| b).unwrap_or("");
    assert_eq!(block, body, "README.md's {lang} example and {path} differ");
}

/// The README's C example is `examples/readme_example.c`, and it builds and runs in-tree.
#[test]
fn readme_c_example_is_the_tested_program() {
    assert_readme_example("c", "examples/readme_example.c");
    let out = build_and_run("examples/readme_example.c");
    assert!(out.contains("request 8 loaded 32 tokens"), "{out}");
}

/// The README's C++ example is `examples/readme_example.cpp`, and it builds and runs in-tree.
#[test]
fn readme_cxx_example_is_the_tested_program() {
    assert_readme_example("cpp", "examples/readme_example.cpp");
    let out = build_and_run("examples/readme_example.cpp");
    assert!(
        out.contains("request 8 loaded 32 tokens; 8192 bytes loaded"),
        "{out}"
    );
}

/// The README's CMake snippet is `examples/CMakeLists.txt` (tests/install.rs builds it).
#[test]
fn readme_cmake_snippet_is_the_examples_project() {
    let readme = std::fs::read_to_string(format!("{CRATE_DIR}/README.md")).unwrap();
    let block = readme
        .split("```cmake\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("README.md has a ```cmake block");
    let file = std::fs::read_to_string(format!("{CRATE_DIR}/examples/CMakeLists.txt")).unwrap();
    assert_eq!(
        block, file,
        "README.md's CMake snippet and examples/CMakeLists.txt differ"
    );
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
