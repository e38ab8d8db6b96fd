//! Compile-time misuse of the macros: each case in tests/ui/ with its expected message.

#[test]
fn compile_fail() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}
