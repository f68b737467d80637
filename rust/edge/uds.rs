//! `--uds PATH`: serve on a Unix socket instead of TCP, for a proxy or sidecar on the same host (no port to
//! allocate or expose, and file permissions instead of a network to decide who may connect).
//!
//! - A socket file left by a server that is gone (SIGKILL, a crash) is replaced: nothing answers on it. A socket
//!   that something still answers on is not (a second server on the same path is an error, not a takeover), and
//!   neither is any other kind of file.
//! - The socket's mode is 0660 whatever the umask: the server's user and group may connect (connecting needs
//!   write permission), others may not. Give the proxy the server's group, or a directory only it can enter.
//! - The file is removed when the server stops, unless another server has replaced it meanwhile.

use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use tokio::net::UnixListener;

/// The mode of the socket file (documented in the README's options table).
pub const MODE: u32 = 0o660;

type FileId = (u64, u64, i64, i64);

fn file_id(meta: &fs::Metadata) -> FileId {
    (meta.dev(), meta.ino(), meta.ctime(), meta.ctime_nsec())
}

/// The socket file this server created, removed on drop if it is still the same file.
pub struct SocketFile {
    path: PathBuf,
    /// Device, inode and change time of the file bound: a file put at the same path later is not ours to remove
    /// (a new file may get the inode of a removed one; not its change time as well).
    id: FileId,
}

impl SocketFile {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        if let Ok(meta) = fs::symlink_metadata(&self.path)
            && file_id(&meta) == self.id
            && let Err(e) = fs::remove_file(&self.path)
        {
            tracing::warn!("cannot remove the socket {}: {e}", self.path.display());
        }
    }
}

/// Bind a listening socket at `path`, replacing a stale socket file, with mode `MODE`.
pub fn bind(path: &str) -> io::Result<(UnixListener, SocketFile)> {
    let fail = |e: io::Error| io::Error::new(e.kind(), format!("--uds {path}: {e}"));
    clear_stale(Path::new(path)).map_err(fail)?;
    let listener = UnixListener::bind(path).map_err(fail)?;
    fs::set_permissions(path, fs::Permissions::from_mode(MODE)).map_err(fail)?;
    let meta = fs::symlink_metadata(path).map_err(fail)?;
    Ok((listener, SocketFile { path: path.into(), id: file_id(&meta) }))
}

/// Remove a socket file at `path` that nothing answers on; refuse a live socket or any other file.
fn clear_stale(path: &Path) -> io::Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.file_type().is_socket() {
        return Err(io::Error::new(io::ErrorKind::AlreadyExists, "exists and is not a socket; not replacing it"));
    }
    match std::os::unix::net::UnixStream::connect(path) {
        Ok(_) => Err(io::Error::new(io::ErrorKind::AddrInUse, "another process is listening on this socket")),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
            tracing::info!("replacing the stale socket {} (nothing listens on it)", path.display());
            fs::remove_file(path)
        }
        Err(e) => Err(io::Error::new(e.kind(), format!("cannot tell whether the socket is in use: {e}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stale_socket_is_replaced_a_live_one_and_a_plain_file_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let p = path.to_str().unwrap();
        // Stale: a socket bound and closed leaves its file behind.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let (listener, file) = bind(p).expect("a stale socket is replaced");
        assert_eq!(fs::metadata(&path).unwrap().permissions().mode() & 0o777, MODE);
        // Live: this server's own socket.
        let err = bind(p).err().expect("a live socket is not taken over");
        assert_eq!(err.kind(), io::ErrorKind::AddrInUse, "{err}");
        assert!(err.to_string().contains(p), "{err}");
        drop(listener);
        drop(file);
        assert!(!path.exists(), "removed on drop");
        fs::write(&path, b"data").unwrap();
        let err = bind(p).err().expect("a plain file is never replaced");
        assert_eq!(err.kind(), io::ErrorKind::AlreadyExists);
        assert_eq!(fs::read(&path).unwrap(), b"data");
    }

    #[tokio::test]
    async fn a_file_another_server_put_there_is_not_removed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let (listener, file) = bind(path.to_str().unwrap()).unwrap();
        drop(listener);
        fs::remove_file(&path).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20)); // past the file system's timestamp granularity
        let other = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(file);
        assert!(path.exists(), "the newer socket stays");
        drop(other);
    }
}
