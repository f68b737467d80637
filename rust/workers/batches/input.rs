//! A batch's input file, read a line at a time with never more than `--max-batch-line-bytes` of one line held:
//! a line is one request, and a file of one 64 MiB line once cost the runner 4.6 GB. The same reader checks a
//! `purpose: batch` upload, a batch as it is created, and the lines as the runner validates and runs them, so a
//! file kept before the bound was lowered is refused too, never read whole.

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};

/// Why an input file cannot be a batch.
#[derive(Debug)]
pub enum Refused {
    /// Its line `line` (counted from 1, blank lines included) is longer than `max` bytes.
    TooLong {
        line: usize,
        max: usize,
    },
    /// It has more than `max` requests.
    TooMany {
        max: usize,
    },
    Io(std::io::Error),
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Refused::TooLong { line, max } => write!(
                f,
                "Line {line} of the input file is longer than {max} bytes (--max-batch-line-bytes): a batch's line \
                 is one request."
            ),
            Refused::TooMany { max } => write!(f, "The input file has more than {max} requests, a batch's limit."),
            Refused::Io(e) => write!(f, "The input file could not be read: {e}"),
        }
    }
}

/// The lines of an input file, each at most `max` bytes (its newline aside).
pub struct InputLines<R> {
    reader: BufReader<R>,
    max: usize,
    /// Lines read so far, blank ones included.
    read: usize,
    buf: Vec<u8>,
}

impl<R: AsyncRead + Unpin> InputLines<R> {
    pub fn new(file: R, max: usize) -> Self {
        InputLines { reader: BufReader::with_capacity(64 << 10, file), max, read: 0, buf: Vec::new() }
    }

    /// The next line's bytes (without its line end), or None at the end; never reads more than `max + 1` bytes
    /// of one line.
    pub async fn next_bytes(&mut self) -> Result<Option<&[u8]>, Refused> {
        self.buf.clear();
        let limit = self.max as u64 + 2; // the line, a `\r` and its `\n`
        let n = (&mut self.reader).take(limit).read_until(b'\n', &mut self.buf).await.map_err(Refused::Io)?;
        if n == 0 {
            return Ok(None);
        }
        self.read += 1;
        let line = self.buf.strip_suffix(b"\n").map(|l| l.strip_suffix(b"\r").unwrap_or(l));
        match line {
            Some(line) if line.len() <= self.max => Ok(Some(line)),
            None if n as u64 <= self.max as u64 => Ok(Some(&self.buf[..])), // the last line, without a newline
            _ => Err(Refused::TooLong { line: self.read, max: self.max }),
        }
    }

    /// The next line that is not blank, as text (a line that is not UTF-8 comes as its lossy text, which then
    /// fails as JSON with the line's number).
    pub async fn next_line(&mut self) -> Result<Option<String>, Refused> {
        while let Some(line) = self.next_bytes().await? {
            if !line.trim_ascii().is_empty() {
                return Ok(Some(String::from_utf8_lossy(line).into_owned()));
            }
        }
        Ok(None)
    }
}

/// Check a whole input file without keeping it: each line within `max_line` bytes, at most `max_lines` requests
/// (lines that are not blank). How many requests it has.
pub async fn scan<R: AsyncRead + Unpin>(file: R, max_line: usize, max_lines: usize) -> Result<usize, Refused> {
    let mut lines = InputLines::new(file, max_line);
    let mut requests = 0;
    while let Some(line) = lines.next_bytes().await? {
        if !line.trim_ascii().is_empty() {
            requests += 1;
            if requests > max_lines {
                return Err(Refused::TooMany { max: max_lines });
            }
        }
    }
    Ok(requests)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_line_past_the_bound_is_named_and_never_read_whole() {
        let mut lines = InputLines::new(&b"ab\r\n\ncdef\nabcdefghij"[..], 4);
        assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("ab"));
        assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("cdef"));
        assert!(matches!(lines.next_line().await, Err(Refused::TooLong { line: 4, max: 4 })));
        assert!(lines.buf.len() <= 6, "held {} bytes", lines.buf.len());
        assert_eq!(InputLines::new(&b"abcd"[..], 4).next_line().await.unwrap().as_deref(), Some("abcd"));
    }

    #[tokio::test]
    async fn a_scan_counts_requests_and_stops_past_the_most() {
        assert_eq!(scan(&b"a\n\nb\nc"[..], 8, 3).await.unwrap(), 3);
        assert!(matches!(scan(&b"a\nb\nc\nd\n"[..], 8, 3).await, Err(Refused::TooMany { max: 3 })));
        assert!(matches!(scan(&b"a\nbbbbbbbbbb\n"[..], 8, 3).await, Err(Refused::TooLong { line: 2, max: 8 })));
    }
}
