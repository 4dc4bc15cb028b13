//! Runs the Python package's tests (`python/tests/run.py`, stdlib `unittest`) against the cdylib
//! that this `cargo test` built. `python3` must be installed: a missing interpreter fails the
//! test instead of skipping it (CI has one).

use std::path::{Path, PathBuf};
use std::process::Command;

const LIB_NAME: &str = if cfg!(target_os = "macos") {
    "libkvoffload.dylib"
} else if cfg!(windows) {
    "kvoffload.dll"
} else {
    "libkvoffload.so"
};

/// `target/<profile>/deps/`, where this test executable lives.
fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .expect("test executable has a directory")
        .to_path_buf()
}

fn find_lib(deps: &Path) -> Option<PathBuf> {
    [Some(deps), deps.parent()]
        .into_iter()
        .flatten()
        .map(|d| d.join(LIB_NAME))
        .find(|p| p.is_file())
}

/// Builds the cdylib with the same profile as this test (`target/<profile>/deps` → `<profile>`).
fn build_lib(deps: &Path) {
    let profile_dir = deps.parent().expect("deps has a parent");
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    // `cargo test` sets CARGO (and RUSTUP_TOOLCHAIN) for the tests it runs. Run by hand, the
    // test goes through the `cargo` on PATH: a toolchain's own cargo binary would let rustup pick
    // a dependency's rust-toolchain.toml (cbindgen asks for nightly) when building it.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let status = Command::new(&cargo)
        .args(["build", "--lib", "--profile", profile])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .status()
        .unwrap_or_else(|e| panic!("cannot run `{cargo} build --lib`: {e}"));
    assert!(status.success(), "`{cargo} build --lib` failed: {status}");
}

#[test]
fn python_package_tests_pass() {
    let deps = deps_dir();
    let lib = find_lib(&deps).unwrap_or_else(|| {
        build_lib(&deps);
        find_lib(&deps).unwrap_or_else(|| {
            panic!(
                "{LIB_NAME} not found in {} or its parent after building it",
                deps.display()
            )
        })
    });
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("python3")
        .arg(root.join("python/tests/run.py"))
        .current_dir(root)
        .env("KVOFFLOAD_LIB", &lib)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run python3 (it is required for this test, not optional): {e}")
        });
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let summary = stdout.lines().last().unwrap_or("").to_owned();
    assert!(
        output.status.success(),
        "python tests failed ({}), library {}:\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}",
        output.status,
        lib.display()
    );
    assert!(
        summary.ends_with(" 0 failed") && !summary.starts_with("0 passed"),
        "unexpected summary line {summary:?}:\n{stdout}\n{stderr}"
    );
    println!("python: {summary} (library {})", lib.display());
}
