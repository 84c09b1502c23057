//! Every decoder of bytes that arrive from the network must reject garbage without panicking.
//! Run: `cargo +nightly fuzz run decoders -- -max_total_time=60` (see docs/testing.md).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    distgrad::fuzz_decoders(data);
});
