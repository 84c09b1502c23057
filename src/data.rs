//! Datasets shipped with the app, in `www/data/` (its README names each one's source and licence;
//! the page fetches them from the app's own files, native builds carry them in the binary).
//!
//! **The 8×8 handwritten digits** ([`Digits`]): 1,797 images of 8×8 pixels with integer values
//! 0..16 and their labels 0..9, the test set of the UCI optical digits (Alpaydin and Kaynak,
//! 1998, CC BY 4.0) as scikit-learn ships it, stored as `digits.bin` (`scripts/make-digits.py`):
//! the 8 bytes `DGDIGIT1`, the count as a little-endian u32, then per image 64 pixel bytes row by
//! row and a label byte. Split deterministically ([`Digits::is_test`]): image *i* is a test image
//! when *i* mod 5 = 4.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// The first bytes of `digits.bin`.
pub const DIGITS_MAGIC: &[u8; 8] = b"DGDIGIT1";
/// Pixels per image (8 × 8).
pub const DIGITS_PIXELS: usize = 64;
/// Classes (the digits 0..9).
pub const DIGITS_CLASSES: usize = 10;
/// The largest pixel value.
pub const DIGITS_MAX_PIXEL: u8 = 16;

/// `www/data/digits.bin`, carried in native builds (the page fetches the file instead, keeping
/// its `.wasm` small).
#[cfg(not(target_arch = "wasm32"))]
pub const DIGITS_BIN: &[u8] = include_bytes!("../www/data/digits.bin");

/// The digits: images and labels, in the source's order.
#[derive(Debug, Clone, PartialEq)]
pub struct Digits {
    /// Each image's 64 pixels, row by row, 0..=16.
    pub images: Vec<[u8; DIGITS_PIXELS]>,
    /// Each image's label, 0..=9.
    pub labels: Vec<u8>,
}

fn bad(detail: impl std::fmt::Display) -> Error {
    Error::Input(format!("digits.bin: {detail}"))
}

impl Digits {
    /// Read the `digits.bin` format; an error says what is wrong (never a panic on bad bytes).
    pub fn parse(bytes: &[u8]) -> Result<Digits> {
        let head = DIGITS_MAGIC.len() + 4;
        if bytes.len() < head || &bytes[..DIGITS_MAGIC.len()] != DIGITS_MAGIC {
            return Err(bad("not a digits file (no DGDIGIT1 header)"));
        }
        let mut n = [0u8; 4];
        n.copy_from_slice(&bytes[DIGITS_MAGIC.len()..head]);
        let n = u32::from_le_bytes(n) as usize;
        let record = DIGITS_PIXELS + 1;
        let want = n.checked_mul(record).and_then(|b| b.checked_add(head));
        if want != Some(bytes.len()) {
            return Err(bad(format!(
                "{} bytes for {n} images (each {record} bytes after a {head}-byte header)",
                bytes.len()
            )));
        }
        let mut images = Vec::with_capacity(n);
        let mut labels = Vec::with_capacity(n);
        for (i, r) in bytes[head..].chunks_exact(record).enumerate() {
            let mut px = [0u8; DIGITS_PIXELS];
            px.copy_from_slice(&r[..DIGITS_PIXELS]);
            if let Some(p) = px.iter().find(|&&p| p > DIGITS_MAX_PIXEL) {
                return Err(bad(format!("image {i}: pixel value {p} above 16")));
            }
            let label = r[DIGITS_PIXELS];
            if usize::from(label) >= DIGITS_CLASSES {
                return Err(bad(format!("image {i}: label {label} is not a digit")));
            }
            images.push(px);
            labels.push(label);
        }
        Ok(Digits { images, labels })
    }

    /// The digits this build carries.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn shipped() -> Result<Digits> {
        Digits::parse(DIGITS_BIN)
    }

    /// How many images.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Whether image `i` is in the test set (`i` mod 5 = 4), the same everywhere.
    pub fn is_test(i: usize) -> bool {
        i % 5 == 4
    }

    /// The indices of the training images and of the test images, in order.
    pub fn split(&self) -> (Vec<usize>, Vec<usize>) {
        (0..self.len()).partition(|&i| !Digits::is_test(i))
    }

    /// The images `idx` as a batch: features `[n, 64]` (pixel / 16, in 0..1) and one-hot targets
    /// `[n, 10]`. An index beyond the data is an error.
    pub fn batch(&self, idx: &[usize]) -> Result<(Tensor, Tensor)> {
        let mut x = Vec::with_capacity(idx.len() * DIGITS_PIXELS);
        let mut y = vec![0f32; idx.len() * DIGITS_CLASSES];
        for (row, &i) in idx.iter().enumerate() {
            let (Some(img), Some(&label)) = (self.images.get(i), self.labels.get(i)) else {
                return Err(bad(format!("image {i} asked of {}", self.len())));
            };
            x.extend(
                img.iter()
                    .map(|&p| f32::from(p) / f32::from(DIGITS_MAX_PIXEL)),
            );
            y[row * DIGITS_CLASSES + usize::from(label)] = 1.0;
        }
        Ok((
            Tensor::from_vec(x, &[idx.len(), DIGITS_PIXELS])?,
            Tensor::from_vec(y, &[idx.len(), DIGITS_CLASSES])?,
        ))
    }
}
