//! The committed header must equal the one cbindgen generates from the sources.
//! Run with `KVO_BLESS=1` to rewrite `include/kvoffload.h`.

#[test]
fn committed_header_is_up_to_date() {
    let generated = include_str!(concat!(env!("OUT_DIR"), "/kvoffload.h"));
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/include/kvoffload.h");
    if std::env::var_os("KVO_BLESS").is_some() {
        std::fs::write(path, generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == generated,
        "include/kvoffload.h is stale: run `KVO_BLESS=1 cargo test --test header` and commit it"
    );
}
