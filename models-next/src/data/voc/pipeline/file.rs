//! Reading an image file for the pipeline: decoded whole, or checked from its header and its last
//! bytes (`skip_bad_images`), each refusing what would decode without a word but wrongly.

use super::VocImage;
use crate::memsave::{Error, Result};

/// Decodes `image`'s file, refusing what would decode without a word but wrongly: a JPEG that
/// stops before its end-of-image marker (cut short: the decoder would fill the rest, as PIL
/// reports "image file is truncated"), and a header claiming more pixels than the annotation
/// says (refused before the decoder allocates them). Errors name the file.
pub(super) fn decode(image: &VocImage) -> Result<image::DynamicImage> {
    let mut reader = open_checked(image)?;
    let mut limits = image::Limits::default();
    limits.max_image_width = u32::try_from(image.width).ok();
    limits.max_image_height = u32::try_from(image.height).ok();
    reader.limits(limits);
    reader.decode().map_err(|e| match e {
        image::ImageError::Limits(_) => claims_more(image),
        other => Error::Data(format!(
            "{}: cannot decode the image: {other}",
            image.path.display()
        )),
    })
}

/// Whether `image`'s file would decode as its annotation says, read from its header and its
/// last bytes only (no pixel is decoded): the check `skip_bad_images` runs on every image.
pub fn check_image(image: &VocImage) -> Result<()> {
    let reader = open_checked(image)?;
    let (width, height) = reader
        .into_dimensions()
        .map_err(|e| Error::data_file(&image.path, "cannot read the image's header", e))?;
    if width as usize > image.width || height as usize > image.height {
        return Err(claims_more(image));
    }
    same_size(image, width, height)
}

/// An error unless the decoded `width` x `height` are the annotation's.
pub(super) fn same_size(image: &VocImage, width: u32, height: u32) -> Result<()> {
    if (width as usize, height as usize) != (image.width, image.height) {
        return Err(Error::Data(format!(
            "{}: the image is {width} x {height}, its annotation says {} x {}",
            image.path.display(),
            image.width,
            image.height
        )));
    }
    Ok(())
}

fn claims_more(image: &VocImage) -> Error {
    Error::Data(format!(
        "{}: the image's header claims more pixels than its annotation's {} x {}",
        image.path.display(),
        image.width,
        image.height
    ))
}

/// The image's reader, its format read from its first bytes; a JPEG without its end-of-image
/// marker is refused here.
fn open_checked(image: &VocImage) -> Result<image::ImageReader<std::io::BufReader<std::fs::File>>> {
    let path = &image.path;
    let bad = |what: String| Error::Data(format!("{}: {what}", path.display()));
    let reader = image::ImageReader::open(path)
        .and_then(|reader| reader.with_guessed_format())
        .map_err(|e| Error::data_file(path, "cannot read the image", e))?;
    if reader.format() == Some(image::ImageFormat::Jpeg) {
        let (tail, size) =
            file_tail(path).map_err(|e| Error::data_file(path, "cannot read the image", e))?;
        if !ends_with_eoi(&tail) {
            return Err(bad(format!(
                "the JPEG is truncated ({size} bytes, no end-of-image marker): the file is damaged"
            )));
        }
    }
    Ok(reader)
}

/// The last bytes of a file (up to 64) and its size, read without reading the rest.
fn file_tail(path: &std::path::Path) -> std::io::Result<(Vec<u8>, u64)> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(path)?;
    let size = file.metadata()?.len();
    let from = size.saturating_sub(64);
    file.seek(SeekFrom::Start(from))?;
    let mut tail = Vec::with_capacity(64);
    file.read_to_end(&mut tail)?;
    Ok((tail, size))
}

/// Whether a JPEG's bytes end with its end-of-image marker (`FF D9`), trailing zero bytes aside.
fn ends_with_eoi(bytes: &[u8]) -> bool {
    let end = bytes.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1);
    end >= 2 && bytes[end - 2..end] == [0xFF, 0xD9]
}
