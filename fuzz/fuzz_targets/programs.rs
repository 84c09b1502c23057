//! The program and lesson reader and the checker must refuse anything without panicking, and
//! planning must stay within the program's caps (what a member of a room can send every tab).
//! Run: `cargo +nightly fuzz run programs -- -max_total_time=60` (see docs/testing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    distgrad::fuzz_programs(data);
});
