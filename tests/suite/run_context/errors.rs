//! Typed errors: memsave's errors keep their causes: each error below is walked down its `source()` chain to
//! the typed error that caused it (an io error, a record that does not decode, the TOML parser's
//! error, the snapshot format's), never a string that stood in for it.

use std::collections::BTreeMap;
use std::error::Error as _;
use std::path::Path;

use burn::backend::Flex;
use burn::nn::LinearConfig;
use memsave::config::Config;
use memsave::train::snapshot::codec::CodecError;
use memsave::train::snapshot::{FormatError, SnapshotCause};
use memsave::train::{load_weights, Snapshot, SnapshotMeta};
use memsave::Error;

/// The errors of `error`'s chain, from its first cause down.
fn causes(error: &Error) -> Vec<&(dyn std::error::Error + 'static)> {
    let mut out = Vec::new();
    let mut next = error.source();
    while let Some(cause) = next {
        out.push(cause);
        next = cause.source();
    }
    out
}

fn dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("memsave-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn a_config_that_cannot_be_read_keeps_the_io_error() {
    let path = dir("io").join("missing.toml");
    let error = Config::<toml::Value, toml::Value>::load(&path, &[]).unwrap_err();
    assert!(
        matches!(&error, Error::Io { path: p, .. } if p == &path),
        "{error}"
    );
    let causes = causes(&error);
    let io = causes[0]
        .downcast_ref::<std::io::Error>()
        .expect("the io error is the cause");
    assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
    assert!(error.to_string().contains("missing.toml"), "{error}");
}

#[test]
fn a_config_that_is_not_toml_keeps_the_parsers_error() {
    let error =
        Config::<toml::Value, toml::Value>::parse("model = [1, 2", Path::new("broken.toml"), &[])
            .unwrap_err();
    let said = error.to_string();
    assert!(matches!(&error, Error::Config { .. }), "{said}");
    assert!(
        said.contains("broken.toml") && said.contains("TOML"),
        "{said}"
    );
    let toml_error = causes(&error)[0]
        .downcast_ref::<toml::de::Error>()
        .expect("the TOML parser's error is the cause");
    assert!(toml_error.span().is_some(), "it says where: {toml_error}");

    // A key misspelt: the deserialiser's error, and the key it names.
    let error = Config::<toml::Value, toml::Value>::parse(
        "model = 1\ndata = 2\nrunnr = 3",
        Path::new("typed.toml"),
        &[],
    )
    .unwrap_err();
    let said = error.to_string();
    assert!(
        said.contains("`runnr`") && said.contains("`runner`"),
        "{said}"
    );
    assert!(
        causes(&error)[0]
            .downcast_ref::<toml::de::Error>()
            .is_some(),
        "{said}"
    );
}

#[test]
fn a_file_that_is_not_a_snapshot_keeps_the_format_error() {
    let path = dir("format").join("not-a-snapshot.ckpt");
    std::fs::write(&path, b"these are not the bytes of a memsave checkpoint").unwrap();
    let error = Snapshot::load(&path).unwrap_err();
    assert!(error.to_string().contains("not-a-snapshot.ckpt"), "{error}");
    let chain = causes(&error);
    assert!(
        matches!(
            chain[0].downcast_ref::<SnapshotCause>(),
            Some(SnapshotCause::Format(FormatError::NotASnapshot))
        ),
        "{error}"
    );
    assert!(matches!(
        chain[1].downcast_ref::<FormatError>(),
        Some(FormatError::NotASnapshot)
    ));

    // A bit flipped in a whole snapshot: its checksum, with both values.
    let snapshot = Snapshot {
        meta: SnapshotMeta {
            memsave_version: "test".into(),
            iter: 1,
            epoch: 0,
            param_shapes: vec![],
            precision: None,
            weights: None,
            hooks: BTreeMap::new(),
        },
        model: vec![1, 2, 3],
        optimizer: vec![4, 5, 6],
        weights: None,
    };
    let mut bytes = snapshot.to_bytes().unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 1;
    let error = Snapshot::from_bytes(&bytes, Path::new("flipped.ckpt")).unwrap_err();
    assert!(
        matches!(
            causes(&error)[1].downcast_ref::<FormatError>(),
            Some(FormatError::Checksum { stored, computed }) if stored != computed
        ),
        "{error}"
    );
}

#[test]
fn a_snapshot_whose_model_record_is_damaged_keeps_the_codecs_error() {
    let device = Default::default();
    let model = LinearConfig::new(3, 2).init::<Flex>(&device);
    // A whole file (header and checksum right) whose model section is not a record.
    let snapshot = Snapshot {
        meta: SnapshotMeta {
            memsave_version: "test".into(),
            iter: 1,
            epoch: 0,
            param_shapes: vec![vec![3, 2], vec![2]],
            precision: None,
            weights: None,
            hooks: BTreeMap::new(),
        },
        model: vec![0xff; 17],
        optimizer: vec![],
        weights: None,
    };
    let path = dir("codec").join("damaged.ckpt");
    snapshot.save(&path).unwrap();
    let error = load_weights::<Flex, _>(model, &path, &device).unwrap_err();
    let said = error.to_string();
    assert!(said.contains("damaged.ckpt"), "{said}");
    let causes = causes(&error);
    assert!(
        matches!(
            causes[0].downcast_ref::<SnapshotCause>(),
            Some(SnapshotCause::Codec(cause))
                if matches!(cause.downcast_ref::<CodecError>(), Some(CodecError::Decode(_)))
        ),
        "{said}"
    );
    assert!(
        causes[1].downcast_ref::<CodecError>().is_some(),
        "the codec's error: {said}"
    );
    assert_eq!(causes.len(), 3, "bincode's error at the bottom: {said}");
}
