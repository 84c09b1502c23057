//! The shipped digits (#39 item 1): the file is the one the README names (its SHA-256), holds what
//! the source holds (counts per digit, the first and last image as scikit-learn's CSV lists them:
//! values read off that CSV with Python, not computed here), splits the same way every time, makes
//! batches scaled to 0..1 with one-hot targets, and bad bytes are errors, not panics.

use distgrad::data::{DIGITS_BIN, DIGITS_CLASSES, DIGITS_PIXELS, Digits};
use sha2::{Digest, Sha256};

#[test]
fn the_shipped_file_is_the_one_the_readme_names() {
    let hex: String = Sha256::digest(DIGITS_BIN)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        hex,
        "de9da4e81f4b142ebaea696903f6fe7351286f5a95efbbab847515fd3a47ea02"
    );
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/www/data/README.md"))
            .expect("www/data/README.md");
    assert!(readme.contains(&hex), "the README names another SHA-256");
    assert!(readme.contains("CC BY 4.0"), "the README names the licence");
}

#[test]
fn the_digits_hold_what_the_source_holds() {
    let d = Digits::shipped().expect("the shipped digits parse");
    assert_eq!(d.len(), 1797);
    let mut counts = [0usize; 10];
    for &l in &d.labels {
        counts[usize::from(l)] += 1;
    }
    assert_eq!(counts, [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]);
    let first: [u8; 64] = [
        0, 0, 5, 13, 9, 1, 0, 0, 0, 0, 13, 15, 10, 15, 5, 0, 0, 3, 15, 2, 0, 11, 8, 0, 0, 4, 12, 0,
        0, 8, 8, 0, 0, 5, 8, 0, 0, 9, 8, 0, 0, 4, 11, 0, 1, 12, 7, 0, 0, 2, 14, 5, 10, 12, 0, 0, 0,
        0, 6, 13, 10, 0, 0, 0,
    ];
    let last: [u8; 64] = [
        0, 0, 10, 14, 8, 1, 0, 0, 0, 2, 16, 14, 6, 1, 0, 0, 0, 0, 15, 15, 8, 15, 0, 0, 0, 0, 5, 16,
        16, 10, 0, 0, 0, 0, 12, 15, 15, 12, 0, 0, 0, 4, 16, 6, 4, 16, 6, 0, 0, 8, 16, 10, 8, 16, 8,
        0, 0, 1, 8, 12, 14, 12, 1, 0,
    ];
    assert_eq!((d.images[0], d.labels[0]), (first, 0));
    assert_eq!((d.images[1796], d.labels[1796]), (last, 8));
    assert_eq!(&d.labels[..12], &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]);
}

#[test]
fn the_split_is_fixed_and_batches_are_scaled_and_one_hot() {
    let d = Digits::shipped().unwrap();
    let (train, test) = d.split();
    assert_eq!((train.len(), test.len()), (1438, 359));
    assert_eq!(&test[..3], &[4, 9, 14]);
    assert_eq!(&train[..5], &[0, 1, 2, 3, 5]);
    let mut all: Vec<usize> = train.iter().chain(&test).copied().collect();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..1797).collect::<Vec<_>>(),
        "every image in exactly one set"
    );
    assert_eq!(d.split(), (train, test), "the same split every time");
    let (x, y) = d.batch(&[0, 1796, 4]).unwrap();
    assert_eq!(
        (x.shape(), y.shape()),
        (&[3, DIGITS_PIXELS][..], &[3, DIGITS_CLASSES][..])
    );
    let (x, y) = (x.to_vec(), y.to_vec());
    assert_eq!(x[2], 5.0 / 16.0, "pixel 2 of image 0 is 5");
    assert_eq!(x[64 + 2], 10.0 / 16.0, "pixel 2 of image 1796 is 10");
    assert!(x.iter().all(|v| (0.0..=1.0).contains(v)));
    assert_eq!(
        &y[..10],
        &[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    );
    assert_eq!(y[10 + 8], 1.0);
    assert_eq!(y[20 + 4], 1.0, "image 4 is a 4");
    assert_eq!(y.iter().sum::<f32>(), 3.0);
    let e = d.batch(&[1797]).unwrap_err().to_string();
    assert!(e.contains("image 1797 asked of 1797"), "{e}");
}

#[test]
fn bad_bytes_are_errors_not_panics() {
    let good = DIGITS_BIN.to_vec();
    let mut pixel = good.clone();
    pixel[12] = 17;
    let mut label = good.clone();
    label[12 + 64] = 10;
    let mut count = good.clone();
    count[8] = 0xff;
    for (bytes, want) in [
        (good[..good.len() - 1].to_vec(), "bytes for 1797 images"),
        (b"DGDIGIT2xxxx".to_vec(), "not a digits file"),
        (Vec::new(), "not a digits file"),
        (pixel, "image 0: pixel value 17"),
        (label, "image 0: label 10"),
        (count, "images (each 65 bytes"),
    ] {
        let e = Digits::parse(&bytes).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
}
