"""Where the server keeps state across requests (stored responses, conversations, uploaded files): its flags, their
check, and what the Rust front end is handed (rust/store).

The default is an embedded SQLite file under the user's state directory: nothing to install or start, and it
survives a restart. Replicas behind a gateway share a PostgreSQL database instead (`--state-store
postgresql://…`), so a response stored by one is found by all. Uploaded files' contents go to a directory beside
the SQLite file by default; replicas that share a database need a volume they all mount (`--files-dir`).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path

from deepinfer_server import limits_args
from deepinfer_server._native import StateConfig

log = logging.getLogger("deepinfer_server")


def default_store() -> str:
    """`$DEEPINFER_SERVER_STATE_STORE`, else `state.sqlite3` in `$XDG_STATE_HOME/deepinfer-server` (by default
    `~/.local/state/deepinfer-server`)."""
    env = os.environ.get("DEEPINFER_SERVER_STATE_STORE")
    if env:
        return env
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return str(Path(base) / "deepinfer-server" / "state.sqlite3")


def add_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--state-store",
        default=None,
        metavar="PATH|URL",
        help="Where stored responses are kept: a SQLite file (the default: state.sqlite3 under "
        "$XDG_STATE_HOME/deepinfer-server, or $DEEPINFER_SERVER_STATE_STORE), 'memory' (lost at exit), a "
        "'postgresql://user:password@host/db' URL shared by replicas, or 'off'.",
    )
    p.add_argument(
        "--files-dir",
        default=None,
        metavar="DIR",
        help="Where uploaded files' contents are kept (/v1/files). Default: 'files' beside the SQLite store; a "
        "temporary directory with --state-store memory; with PostgreSQL, 'files' under "
        "$XDG_STATE_HOME/deepinfer-server (replicas sharing a database must share this directory: mount one volume "
        "on all of them).",
    )
    limits_args.add_declared(p, "state")  # what the store, files and background runs may hold, and for how long
    p.add_argument(
        "--disable-response-store",
        action="store_true",
        help="Keep no responses, whatever a request's 'store' says ('previous_response_id' is then a 400).",
    )


def store_spec(args: argparse.Namespace) -> str:
    """The store as the front end takes it: empty when off."""
    spec = args.state_store if args.state_store is not None else default_store()
    return "" if spec == "off" or args.disable_response_store else spec


def resolve(args: argparse.Namespace) -> str | None:
    """Why the store's flags cannot work, if they cannot; makes a SQLite file's directory."""
    if args.response_store_ttl < 0:
        return "--response-store-ttl must be 0 (keep until deleted) or more seconds"
    if args.state_store_max_bytes < 0:
        return "--state-store-max-bytes must be 0 (no cap) or more bytes"
    if args.files_max_total_bytes < 0:
        return "--files-max-total-bytes must be 0 (no cap) or more bytes"
    if min(args.max_background_runs, args.max_background_runs_per_owner, args.background_replay_bytes) < 1:
        return "--max-background-runs, --max-background-runs-per-owner and --background-replay-bytes must be positive"
    for flag in ("state_store_max_bytes_per_owner", "files_max_bytes_per_owner"):
        if getattr(args, flag) < 0:
            return f"--{flag.replace('_', '-')} must be 0 (an even share of the total) or more bytes"
    for flag in ("state_store_max_item_bytes", "state_store_max_chain_bytes"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be positive"
    if args.claim_lease < 3:
        return "--claim-lease must be at least 3 seconds (claims are renewed every second or two)"
    if args.max_file_bytes < 1 or args.upload_timeout <= 0:
        return "--max-file-bytes and --upload-timeout must be positive"
    spec = store_spec(args)
    if not spec or spec == "memory" or spec.startswith(("postgres://", "postgresql://", "sqlite::memory:")):
        return None
    path = Path(spec.removeprefix("sqlite://").removeprefix("sqlite:").split("?", 1)[0]).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        if args.state_store is None and "DEEPINFER_SERVER_STATE_STORE" not in os.environ:
            # The default place is not writable here (a read-only home): keep responses in memory rather than
            # refuse to start; the operator who wants them kept names a place.
            log.warning("cannot make %s (%s): stored responses are kept in memory only", path.parent, e.strerror)
            args.state_store = "memory"
            return None
        return f"--state-store: cannot make the directory of {path}: {e.strerror}"
    if path.is_dir():
        return f"--state-store: {path} is a directory; name a file"
    return None


def files_dir(args: argparse.Namespace, spec: str) -> str:
    """Where uploads go: `--files-dir`, else beside the SQLite file, a temporary directory for a store in memory,
    or under the state directory beside PostgreSQL; empty with no store."""
    if not spec:
        return ""
    if args.files_dir:
        return str(Path(args.files_dir).expanduser())
    if spec == "memory" or spec.startswith("sqlite::memory:"):
        return tempfile.mkdtemp(prefix="deepinfer-server-files-")
    if spec.startswith(("postgres://", "postgresql://")):
        return str(Path(default_store()).parent / "files")
    return str(Path(spec.removeprefix("sqlite://").removeprefix("sqlite:").split("?", 1)[0]).parent / "files")


def server_config(args: argparse.Namespace) -> StateConfig:
    """Where the Rust server keeps its state (rust/config.rs)."""
    spec = store_spec(args)
    if spec and not spec.startswith(("postgres://", "postgresql://", "sqlite:", "memory")):
        spec = str(Path(spec).expanduser())
    return StateConfig(store=spec, store_responses=bool(spec), files_dir=files_dir(args, spec))
