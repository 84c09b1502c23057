//! The datasets the page fetches from the app's own files (`data/`, see `crate::data`).

use wasm_bindgen_futures::JsFuture;

use crate::data::{DIGITS_CLASSES, Digits};
use crate::error::{Error, Result};

use super::lessons::fetch_ok;

/// The bytes of the app's file at `path`.
async fn fetch_bytes(path: &str) -> Result<Vec<u8>> {
    let fail = |what: &str| Error::Input(format!("fetching {path}: {what}"));
    let resp = fetch_ok(path).await?;
    let buf = JsFuture::from(resp.array_buffer().map_err(|_| fail("no body"))?)
        .await
        .map_err(|_| fail("reading the body"))?;
    Ok(js_sys::Uint8Array::new(&buf).to_vec())
}

/// The digits, fetched from `data/digits.bin` and checked.
pub(super) async fn digits() -> Result<Digits> {
    Digits::parse(&fetch_bytes("data/digits.bin").await?)
}

/// What the page holds of the digits, as JSON: images, training and test images, images per
/// digit (for `window.distgrad.digits()`).
pub(super) async fn digits_summary() -> Result<String> {
    let d = digits().await?;
    let (train, test) = d.split();
    let mut per_digit = [0usize; DIGITS_CLASSES];
    for &l in &d.labels {
        per_digit[usize::from(l)] += 1;
    }
    Ok(serde_json::json!({
        "images": d.len(),
        "train": train.len(),
        "test": test.len(),
        "per_digit": per_digit,
    })
    .to_string())
}
