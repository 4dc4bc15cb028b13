//! Generates the C header into `OUT_DIR/kvoffload.h` with the pinned cbindgen; the test
//! `tests/header.rs` checks that the committed `include/kvoffload.h` equals it.

fn main() {
    let crate_dir = std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR");
    let out = std::path::Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("kvoffload.h");
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    let config =
        cbindgen::Config::from_file(format!("{crate_dir}/cbindgen.toml")).expect("cbindgen.toml");
    cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen could not generate the header")
        .write_to_file(out);
}
