//! The install as a C/C++ consumer meets it: runs README.md's "Install" blocks as written —
//! CMake drives cargo and installs into a temporary prefix; the README's C and C++ examples are
//! built through pkg-config (shared and static) and through CMake's `find_package`, and run
//! without `LD_LIBRARY_PATH`. Also checks the installed files, the SONAME and its links, the
//! pkg-config metadata, and a `DESTDIR` staging install.
//!
//! The build directory is the README's `build/` (ignored by git; cargo keeps it incremental).
//! Needs `cmake`, `pkg-config`, `cc`, `c++` and `readelf`; without them the test fails, unless
//! `KVO_SKIP_INSTALL_TEST=1`, which skips it with the reason printed.
#![cfg(target_os = "linux")]

use std::path::{Path, PathBuf};
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The README's ```sh block whose first line is `first_line`.
fn readme_block(first_line: &str) -> String {
    let readme = std::fs::read_to_string(format!("{ROOT}/README.md")).expect("README.md");
    readme
        .split("```sh\n")
        .skip(1)
        .filter_map(|rest| rest.split("```").next())
        .find(|block| block.lines().next() == Some(first_line))
        .unwrap_or_else(|| panic!("README.md has no ```sh block starting with {first_line:?}"))
        .to_owned()
}

/// Runs `script` with bash (`-euo pipefail`) in `dir` with `PREFIX` set and no
/// `LD_LIBRARY_PATH` (cargo sets one for tests; a consumer has none). Returns stdout.
fn run_block(what: &str, script: &str, dir: &Path, prefix: &Path) -> String {
    let out = Command::new("bash")
        .args(["-euo", "pipefail", "-c", script])
        .current_dir(dir)
        .env("PREFIX", prefix)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("PKG_CONFIG_PATH")
        .output()
        .unwrap_or_else(|e| panic!("cannot run bash: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{script}\n--- stdout ---\n{stdout}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The tools missing from PATH.
fn missing_tools() -> Vec<&'static str> {
    ["cmake", "pkg-config", "cc", "c++", "readelf"]
        .into_iter()
        .filter(|t| {
            !Command::new(t)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .collect()
}

fn readelf_soname(lib: &Path) -> String {
    let out = Command::new("readelf")
        .arg("-d")
        .arg(lib)
        .output()
        .expect("readelf runs");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.contains("(SONAME)"))
        .and_then(|l| l.split('[').nth(1))
        .and_then(|l| l.split(']').next())
        .unwrap_or("")
        .to_owned()
}

/// A fresh temporary directory under cargo's `target/tmp`.
fn temp_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("install-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temporary directory");
    dir
}

/// The directory under `prefix` holding the shared library (`lib`, `lib64` or multiarch).
fn libdir(prefix: &Path) -> PathBuf {
    let name = "libkvoffload.so.0";
    for cand in ["lib", "lib64"] {
        if prefix.join(cand).join(name).exists() {
            return prefix.join(cand);
        }
    }
    std::fs::read_dir(prefix.join("lib"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.join(name).exists())
        .unwrap_or_else(|| panic!("{name} is nowhere under {}", prefix.display()))
}

fn check_layout(prefix: &Path, want_pc_prefix: &Path) {
    let lib = libdir(prefix);
    let full = lib.join(format!("libkvoffload.so.{VERSION}"));
    assert!(full.is_file(), "{} is installed", full.display());
    assert_eq!(readelf_soname(&full), "libkvoffload.so.0", "SONAME");
    for (link, target) in [
        ("libkvoffload.so.0", format!("libkvoffload.so.{VERSION}")),
        ("libkvoffload.so", "libkvoffload.so.0".to_owned()),
    ] {
        let got = std::fs::read_link(lib.join(link))
            .unwrap_or_else(|e| panic!("{link} is a symbolic link: {e}"));
        assert_eq!(got, Path::new(&target), "{link} points to {target}");
    }
    assert!(lib.join("libkvoffload.a").is_file(), "the static library");
    for h in ["kvoffload.h", "kvoffload.hpp"] {
        let installed = std::fs::read(prefix.join("include").join(h)).expect(h);
        let source = std::fs::read(format!("{ROOT}/include/{h}")).unwrap();
        assert!(installed == source, "include/{h} is the repository's");
    }
    let pc = std::fs::read_to_string(lib.join("pkgconfig/kvoffload.pc")).expect("kvoffload.pc");
    assert!(
        pc.lines()
            .any(|l| l == format!("prefix={}", want_pc_prefix.display())),
        "kvoffload.pc names the prefix {}:\n{pc}",
        want_pc_prefix.display()
    );
    assert!(pc.contains(&format!("\nVersion: {VERSION}\n")), "{pc}");
    for f in ["kvoffload-config.cmake", "kvoffload-config-version.cmake"] {
        assert!(lib.join("cmake/kvoffload").join(f).is_file(), "{f}");
    }
}

#[test]
fn install_and_build_consumers_as_the_readme_says() {
    let missing = missing_tools();
    if !missing.is_empty() {
        let why = format!(
            "the install test needs {} (.ci/run installs them)",
            missing.join(", ")
        );
        if std::env::var("KVO_SKIP_INSTALL_TEST").is_ok_and(|v| v == "1") {
            eprintln!("SKIPPED install_and_build_consumers_as_the_readme_says: {why}");
            return;
        }
        panic!("{why}; KVO_SKIP_INSTALL_TEST=1 skips this test");
    }

    let tmp = temp_dir("consumer");
    let prefix = tmp.join("prefix");
    run_block(
        "the README's install",
        &readme_block("# Build and install (from the repository root)"),
        Path::new(ROOT),
        &prefix,
    );
    check_layout(&prefix, &prefix);

    // The consumer's directory holds the examples, as a project of its own would.
    let work = tmp.join("work");
    std::fs::create_dir_all(&work).unwrap();
    std::os::unix::fs::symlink(format!("{ROOT}/examples"), work.join("examples")).unwrap();

    let want = "request 8 loaded 32 tokens";
    let out = run_block(
        "the README's pkg-config builds",
        &readme_block("# Compile against the installed library with pkg-config"),
        &work,
        &prefix,
    );
    assert_eq!(out.matches(want).count(), 3, "three programs ran:\n{out}");
    assert!(
        out.contains("vllm:kv_offload_load_bytes_total{rank=\"0\"} 8192"),
        "the C++ example prints the worker's metrics:\n{out}"
    );

    let out = run_block(
        "the README's CMake builds",
        &readme_block("# Build the examples with CMake's find_package"),
        &work,
        &prefix,
    );
    assert_eq!(out.matches(want).count(), 3, "three programs ran:\n{out}");

    // The programs link the installed library by its SONAME, found through their RUNPATH.
    let lib = libdir(&prefix);
    for exe in [
        work.join("readme_example"),
        work.join("build-examples/readme_example_cpp"),
    ] {
        let out = Command::new("readelf")
            .arg("-d")
            .arg(&exe)
            .output()
            .unwrap();
        let dynamic = String::from_utf8_lossy(&out.stdout);
        assert!(
            dynamic.contains("Shared library: [libkvoffload.so.0]"),
            "{} needs libkvoffload.so.0:\n{dynamic}",
            exe.display()
        );
        assert!(
            dynamic.contains(lib.to_str().unwrap()),
            "{} has the install's libdir in its RUNPATH:\n{dynamic}",
            exe.display()
        );
    }
    let out = Command::new("readelf")
        .arg("-d")
        .arg(work.join("readme_example_static"))
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&out.stdout).contains("libkvoffload"),
        "the static program needs no libkvoffload"
    );

    // Staging for a package: DESTDIR holds the files, the metadata names the final prefix.
    let stage = tmp.join("stage");
    let out = Command::new("cmake")
        .args(["--install", "build", "--prefix", "/opt/kvoffload"])
        .current_dir(ROOT)
        .env("DESTDIR", &stage)
        .output()
        .expect("cmake runs");
    assert!(
        out.status.success(),
        "DESTDIR install: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    check_layout(&stage.join("opt/kvoffload"), Path::new("/opt/kvoffload"));

    let _ = std::fs::remove_dir_all(&tmp);
}
