"""CURVE keys: what a job needs to bind TCP, and what a UI needs to reach it.

``ipc://`` endpoints (the default) are private to this user: they live in the 0700 runtime
directory. Any TCP port, loopback included, is reachable by every user of the machine, so every
TCP endpoint is bound as a ZeroMQ CURVE server (encrypted, the job proves who it is) with a ZAP
authenticator (pyzmq's ``zmq.auth``) that admits only known client keys:

* loopback TCP (``tcp://127.0.0.1``, ``tcp://[::1]``): **per-session keys**, made fresh by
  each job (:func:`new_session_keys`) and written, with the endpoints they are for, into a
  0600 file ``<pid>[-rank].<random>.curve`` in the user's 0700 runtime directory
  (:func:`write_session_keys`). The same user's UI finds them there (:func:`find_session_keys`)
  with no set-up; another user cannot read them, so gets nothing. The file goes at close.
* a public address: the user's keys (below), made once by ``torchscope keys``; only the client
  public keys in ``authorized_clients/`` are admitted.

Key directory (``$TORCHSCOPE_KEYS_DIR``, else ``$XDG_CONFIG_HOME/torchscope/keys``, else
``~/.config/torchscope/keys``), mode 0700, written by ``torchscope keys``::

    server.key_secret   the job's key pair (0600)       stays on the job's machine
    server.key          the job's public key (0644)     every UI machine needs a copy
    client.key_secret   a UI's key pair (0600)          the UI machine needs it
    client.key          that UI's public key (0644)
    authorized_clients/ (0700) public keys of the UIs a job admits: ``*.key`` files

Loading refuses (``SecurityError``, one line, saying what to do) a directory other users can
reach, a secret file other users can read, a file that is not a valid certificate, a secret
that does not match its public key, and a server with no authorized client.

Imports neither torch nor textual; zmq only when keys are made, loaded or used.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torchscope.protocol.runtime import (
    EndpointError,
    pid_alive,
    runtime_dir,
    split_tcp,
    write_private,
)

if TYPE_CHECKING:
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

ENV_KEYS_DIR = "TORCHSCOPE_KEYS_DIR"
SERVER = "server"
CLIENT = "client"
AUTHORIZED_DIR = "authorized_clients"
PUBLIC_SUFFIX = ".key"  # zmq.auth's convention: public certificates are *.key
SECRET_SUFFIX = ".key_secret"
ZAP_DOMAIN = "torchscope"
DIR_MODE = 0o700
PUBLIC_MODE = 0o644
SECRET_MODE = 0o600
MAX_CERT_BYTES = 64 * 1024  # a certificate is ~300 bytes; anything much bigger is not one
EXAMPLE_BIND = "tcp://0.0.0.0:5555"
SESSION_SUFFIX = ".curve"  # per-session key files in the runtime directory
MAX_SESSION_FILE_BYTES = 64 * 1024


class SecurityError(EndpointError):
    """Keys missing, unsafe or invalid. The text is one line and says what to do.

    An EndpointError, so everything that reports a bad endpoint reports this too."""


@dataclass(frozen=True)
class KeyPaths:
    """Where :func:`generate_keys` put the keys."""

    directory: Path
    server_public: Path
    server_secret: Path
    client_public: Path
    client_secret: Path
    authorized_dir: Path
    authorized_client: Path  # the copy of client.key that authorizes it


@dataclass(frozen=True)
class ServerKeys:
    """What a job binding a public address needs. Keys are z85 text (40 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)
    authorized: frozenset[bytes]  # client public keys admitted
    authorized_dir: Path
    directory: Path


@dataclass(frozen=True)
class ClientKeys:
    """What a UI connecting to a public address needs. Keys are z85 text (40 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes
    directory: Path


# -- where --------------------------------------------------------------------------------------
def keys_dir() -> Path:
    """The key directory (not created, not checked)."""
    override = os.environ.get(ENV_KEYS_DIR)
    if override:
        return Path(override).expanduser().absolute()
    base = os.environ.get("XDG_CONFIG_HOME")
    if base and os.path.isabs(base):
        return Path(base) / "torchscope" / "keys"
    try:
        home = Path.home()
    except RuntimeError:  # no $HOME and no passwd entry
        raise SecurityError(
            f"cannot tell where CURVE keys live (no home directory): set {ENV_KEYS_DIR}"
        ) from None
    return home / ".config" / "torchscope" / "keys"


def _dir(directory: str | os.PathLike[str] | None) -> Path:
    return keys_dir() if directory is None else Path(directory).expanduser().absolute()


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def _check_dir(path: Path, forbidden: int, hint_mode: int) -> None:
    """``path`` is a directory of ours without the ``forbidden`` mode bits."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SecurityError(f"cannot use key directory {path}: {exc.strerror or exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SecurityError(f"refusing CURVE keys in {path}: it is not a directory")
    uid = _uid()
    if uid is None:
        return
    if st.st_uid != uid:
        raise SecurityError(
            f"refusing CURVE keys in {path}: it is owned by uid {st.st_uid}, not by you (uid {uid})"
        )
    if st.st_mode & forbidden:
        raise SecurityError(
            f"refusing CURVE keys in {path}: its mode is {stat.S_IMODE(st.st_mode):04o}, so other "
            f"users can reach it; run 'chmod {hint_mode:o} {path}'"
        )


def _make_private_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) mode 0700, or check the existing one."""
    try:
        os.makedirs(path.parent, DIR_MODE, exist_ok=True)
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE)  # whatever the umask took away, this one is ours
    except FileExistsError:
        pass
    except OSError as exc:
        raise SecurityError(f"cannot create key directory {path}: {exc.strerror or exc}") from None
    _check_dir(path, 0o077, DIR_MODE)


# -- reading certificates -------------------------------------------------------------------
def _valid_key(key: bytes | None) -> bool:
    from zmq.utils import z85

    if key is None or len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except Exception:  # z85 raises ValueError or others on junk: not a key either way
        return False


def _read_cert(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) of a certificate file; FileNotFoundError if there is none."""
    import zmq
    from zmq.auth import load_certificate

    st = os.stat(path)  # FileNotFoundError: the caller says which keys are missing
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CERT_BYTES:
        raise SecurityError(f"{path} is not a CURVE certificate file")
    uid = _uid()
    if secret and uid is not None:
        if st.st_uid != uid:
            raise SecurityError(
                f"refusing {path}: it is owned by uid {st.st_uid}, not by you (uid {uid})"
            )
        if st.st_mode & 0o077:
            raise SecurityError(
                f"refusing {path}: its mode is {stat.S_IMODE(st.st_mode):04o}, so other users "
                f"can read the secret key; run 'chmod 600 {path}'"
            )
    try:
        public, secret_key = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{path} is not a CURVE certificate: {exc}") from None
    if not _valid_key(public):
        raise SecurityError(f"{path} holds no valid CURVE public key")
    if secret:
        if not _valid_key(secret_key):
            raise SecurityError(f"{path} holds no valid CURVE secret key")
        assert secret_key is not None
        if zmq.curve_public(secret_key) != public:
            raise SecurityError(f"{path}: the secret key does not match the public key")
    return public, secret_key if secret else None


def load_authorized(directory: str | os.PathLike[str] | None = None) -> frozenset[bytes]:
    """Client public keys (z85) in ``<keys>/authorized_clients/*.key``; empty if none.

    Every ``*.key`` file there must be a valid certificate: zmq.auth's loader would otherwise
    fail on it and admit nobody, silently, so we refuse to start and name the file.
    """
    adir = _dir(directory) / AUTHORIZED_DIR
    if not adir.exists():
        return frozenset()
    _check_dir(adir, 0o022, DIR_MODE)  # others must not be able to add a key
    keys = set()
    for path in sorted(adir.glob("*" + PUBLIC_SUFFIX)):
        try:
            public, _ = _read_cert(path, secret=False)
        except FileNotFoundError:
            continue  # removed while we looked
        keys.add(public)
    return frozenset(keys)


def _missing_server(endpoint: str | None, where: Path) -> SecurityError:
    what = f"binding {endpoint}" if endpoint else "binding a public address"
    return SecurityError(f"{what} requires CURVE keys: run `torchscope keys` (looked in {where})")


def _context(endpoint: str | None, exc: SecurityError, verb: str) -> SecurityError:
    return SecurityError(f"{verb} {endpoint}: {exc}") if endpoint else exc


def load_server_keys(
    directory: str | os.PathLike[str] | None = None, *, endpoint: str | None = None
) -> ServerKeys:
    """The job's key pair and the authorized client keys; SecurityError (one line) if they are
    missing, unsafe or invalid. ``endpoint`` only words the message."""
    d = _dir(directory)
    secret_path = d / (SERVER + SECRET_SUFFIX)
    if not secret_path.exists():
        raise _missing_server(endpoint, d)
    try:
        _check_dir(d, 0o077, DIR_MODE)
        public, secret = _read_cert(secret_path, secret=True)
        authorized = load_authorized(d)
    except FileNotFoundError:  # removed while we looked
        raise _missing_server(endpoint, d) from None
    except SecurityError as exc:
        raise _context(endpoint, exc, "binding") from None
    if not authorized:
        raise _context(
            endpoint,
            SecurityError(
                f"no UI is authorized: {d / AUTHORIZED_DIR} holds no *.key file; run "
                f"`torchscope keys` or copy a UI machine's client.key there"
            ),
            "binding",
        )
    assert secret is not None
    return ServerKeys(
        public=public,
        secret=secret,
        authorized=authorized,
        authorized_dir=d / AUTHORIZED_DIR,
        directory=d,
    )


def load_client_keys(
    directory: str | os.PathLike[str] | None = None, *, endpoint: str | None = None
) -> ClientKeys:
    """This UI's key pair and the job's public key; SecurityError (one line) naming what to
    copy where if they are missing. ``endpoint`` only words the message."""
    d = _dir(directory)
    secret_path = d / (CLIENT + SECRET_SUFFIX)
    server_path = d / (SERVER + PUBLIC_SUFFIX)
    what = f"connecting to {endpoint}" if endpoint else "connecting to a public address"
    missing = SecurityError(
        f"{what} requires CURVE keys: copy server.key, client.key and client.key_secret from "
        f"the job's machine (made there by `torchscope keys`) into {d}"
    )
    if not secret_path.exists() or not server_path.exists():
        raise missing
    try:
        _check_dir(d, 0o077, DIR_MODE)
        public, secret = _read_cert(secret_path, secret=True)
        server_public, _ = _read_cert(server_path, secret=False)
    except FileNotFoundError:
        raise missing from None
    except SecurityError as exc:
        raise _context(endpoint, exc, "connecting to") from None
    assert secret is not None
    return ClientKeys(public=public, secret=secret, server_public=server_public, directory=d)


# -- making keys ----------------------------------------------------------------------------
def _paths(d: Path) -> KeyPaths:
    adir = d / AUTHORIZED_DIR
    return KeyPaths(
        directory=d,
        server_public=d / (SERVER + PUBLIC_SUFFIX),
        server_secret=d / (SERVER + SECRET_SUFFIX),
        client_public=d / (CLIENT + PUBLIC_SUFFIX),
        client_secret=d / (CLIENT + SECRET_SUFFIX),
        authorized_dir=adir,
        authorized_client=adir / (CLIENT + PUBLIC_SUFFIX),
    )


def generate_keys(directory: str | os.PathLike[str] | None = None, force: bool = False) -> KeyPaths:
    """Create a server and a client key pair (zmq.auth.create_certificates) in the key
    directory, and authorize the client (its public key copied into ``authorized_clients/``).

    Public files 0644, secret files 0600, directories 0700. Refuses (SecurityError) to replace
    existing keys unless ``force``; other keys in ``authorized_clients/`` are kept either way.
    Files are written into a private temporary directory and renamed into place, so a reader
    never sees half a key and the secret is never readable by others, whatever the umask.
    """
    from zmq.auth import create_certificates

    paths = _paths(_dir(directory))
    d = paths.directory
    _make_private_dir(d)
    targets = (
        paths.server_public,
        paths.server_secret,
        paths.client_public,
        paths.client_secret,
        paths.authorized_client,
    )
    existing = [p for p in targets if os.path.lexists(p)]
    if existing and not force:
        names = ", ".join(str(p.relative_to(d)) for p in existing)
        raise SecurityError(
            f"CURVE keys already exist in {d} ({names}); run `torchscope keys --force` to "
            f"replace them (UIs holding the old keys will then be refused)"
        )
    _make_private_dir(paths.authorized_dir)
    tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=d))  # 0700
    try:
        made = {}
        for name in (SERVER, CLIENT):
            public, secret = create_certificates(tmp, name)
            os.chmod(secret, SECRET_MODE)
            os.chmod(public, PUBLIC_MODE)
            made[name] = (Path(public), Path(secret))
        authorized = tmp / "authorized.key"
        shutil.copyfile(made[CLIENT][0], authorized)
        os.chmod(authorized, PUBLIC_MODE)
        # Secrets first, public keys after: a half-done run never leaves a public key whose
        # secret is gone. The authorizing copy goes last.
        os.replace(made[SERVER][1], paths.server_secret)
        os.replace(made[CLIENT][1], paths.client_secret)
        os.replace(made[SERVER][0], paths.server_public)
        os.replace(made[CLIENT][0], paths.client_public)
        os.replace(authorized, paths.authorized_client)
    except OSError as exc:
        raise SecurityError(f"cannot write CURVE keys in {d}: {exc.strerror or exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return paths


# -- per-session keys (loopback TCP) ---------------------------------------------------------
@dataclass(frozen=True)
class SessionKeys:
    """Keys one job makes for its loopback TCP endpoints: its server pair and the one client
    pair it admits. z85 text (40 bytes)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    client_public: bytes
    client_secret: bytes = field(repr=False)

    @property
    def server(self) -> ServerKeys:
        """As :class:`ServerKeys`, for :func:`configure_server`."""
        here = Path(".")
        return ServerKeys(
            public=self.server_public,
            secret=self.server_secret,
            authorized=frozenset({self.client_public}),
            authorized_dir=here,
            directory=here,
        )


def require_curve(endpoint: str | None = None) -> None:
    """SecurityError (one line) when this libzmq cannot do CURVE (TCP then is refused)."""
    import zmq

    if not zmq.has("curve"):
        what = f"binding {endpoint}" if endpoint else "a tcp endpoint"
        raise SecurityError(
            f"{what} needs CURVE, which this libzmq lacks; use the default ipc:// endpoint "
            "(unset TORCHSCOPE_BIND)"
        )


def new_session_keys() -> SessionKeys:
    """Fresh server and client key pairs for one job's loopback TCP endpoints."""
    import zmq

    require_curve()
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return SessionKeys(server_public, server_secret, client_public, client_secret)


def write_session_keys(
    keys: SessionKeys, endpoints: Iterable[str], *, pid: int, rank: int | None = None
) -> Path:
    """Write ``keys`` and the ``endpoints`` they open into the runtime directory (0700), as
    ``<pid>[-rank].<random>.curve``, mode 0600, atomically (temp file, rename). Returns the
    path; :func:`remove_session_keys` undoes it. Raises EndpointError / OSError."""
    directory = runtime_dir()
    stem = f"{pid}" if rank is None else f"{pid}-{rank}"
    final = directory / f"{stem}.{secrets.token_hex(4)}{SESSION_SUFFIX}"
    data = json.dumps(
        {
            "v": 1,
            "pid": pid,
            "rank": rank,
            "endpoints": [e for e in endpoints if isinstance(e, str)],
            "server_public": keys.server_public.decode(),
            "client_public": keys.client_public.decode(),
            "client_secret": keys.client_secret.decode(),
        }
    ).encode()
    write_private(final, data)
    return final


def remove_session_keys(path: str | os.PathLike[str] | None) -> None:
    """Delete a file written by :func:`write_session_keys`; quiet if it is gone."""
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _read_session_file(path: Path) -> dict[str, Any] | None:
    """A session key file's contents, if it is ours, private and well formed."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            uid = _uid()
            if not stat.S_ISREG(st.st_mode) or (
                uid is not None and (st.st_uid != uid or st.st_mode & 0o077)
            ):
                return None
            data = fh.read(MAX_SESSION_FILE_BYTES + 1)
        if len(data) > MAX_SESSION_FILE_BYTES:
            return None
        d = json.loads(data)
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("endpoints"), list):
        return None
    for key in ("server_public", "client_public", "client_secret"):
        value = d.get(key)
        if not isinstance(value, str) or not _valid_key(value.encode("ascii", "replace")):
            return None
    if not isinstance(d.get("pid"), int):
        return None
    return d


def _tcp_key(endpoint: str) -> tuple[str, str] | None:
    """(host, port) of a tcp endpoint, host normalised; None if it is not one."""
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    try:
        host, port = split_tcp(endpoint)
    except EndpointError:
        return None
    if port is None:
        return None
    host = host.lower()
    if host == "localhost":
        host = "127.0.0.1"
    return host, port


def find_session_keys(endpoint: str) -> ClientKeys | None:
    """The client keys for a loopback tcp ``endpoint`` of one of this user's running jobs,
    from its session key file in the runtime directory; None when there is none (another
    user's job, a job that has ended, not a torchscope job)."""
    want = _tcp_key(endpoint)
    if want is None:
        return None
    try:
        directory = runtime_dir()
        paths = list(directory.glob("*" + SESSION_SUFFIX))
    except (OSError, EndpointError):
        return None
    best: tuple[float, ClientKeys] | None = None
    for path in paths:
        d = _read_session_file(path)
        if d is None or want not in {_tcp_key(e) for e in d["endpoints"]}:
            continue
        if not pid_alive(d["pid"]):
            continue  # a dead job's file (its port may be someone else's now)
        with contextlib.suppress(OSError):
            mtime = path.stat().st_mtime
            keys = ClientKeys(
                public=d["client_public"].encode(),
                secret=d["client_secret"].encode(),
                server_public=d["server_public"].encode(),
                directory=path,
            )
            if best is None or mtime > best[0]:
                best = (mtime, keys)
    return best[1] if best is not None else None


# -- using keys on sockets --------------------------------------------------------------------
def configure_server(sock: zmq.Socket, keys: ServerKeys) -> None:
    """Make ``sock`` a CURVE server that asks the ZAP handler (see :func:`start_authenticator`)
    about every client, and refuses clients when no handler answers. Call before ``bind``."""
    import zmq

    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    # Without this, a CURVE server whose context has no ZAP handler admits any client key.
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def configure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make ``sock`` a CURVE client that only talks to the job holding ``server.key``'s
    secret. Call before ``connect``."""
    import zmq

    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


class _Admit:
    """zmq.auth credentials provider: admits exactly a fixed set of z85 client keys."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def start_authenticator(
    context: zmq.Context, keys: ServerKeys | None, extra_clients: Iterable[bytes] = ()
) -> ThreadAuthenticator:
    """A ZAP handler in ``context`` admitting exactly ``keys.authorized`` (the user's
    authorized UIs, for a public bind) and ``extra_clients`` (a session's own client key, for
    loopback). Start it before binding; ``stop()`` it before terminating the context. Keys
    added to the directory later are seen by the next job, not this one."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(context)
    auth.start()
    try:
        admitted = set(extra_clients)
        if keys is not None:
            auth.configure_curve(domain=ZAP_DOMAIN, location=str(keys.authorized_dir))
            loaded = frozenset(auth.certs.get(ZAP_DOMAIN, {}))
            if loaded != keys.authorized:  # the directory changed since we checked it
                raise SecurityError(
                    f"{keys.authorized_dir} changed while it was being read; start the job again"
                )
            admitted |= keys.authorized
        # A credentials provider takes precedence over the certificates loaded above.
        auth.configure_curve_callback(
            domain=ZAP_DOMAIN, credentials_provider=_Admit(frozenset(admitted))
        )
    except BaseException:
        auth.stop()
        raise
    return auth


# -- `torchscope keys` ------------------------------------------------------------------------
def generate_and_describe(
    force: bool = False, directory: str | os.PathLike[str] | None = None
) -> str:
    """Make the keys (see :func:`generate_keys`) and return what to tell the user."""
    p = generate_keys(directory, force=force)
    d = p.directory
    return "\n".join(
        [
            f"torchscope: CURVE keys written to {d}",
            f"  {p.server_secret.name:<18} the job's key pair: keep it on the job's machine (0600)",
            f"  {p.server_public.name:<18} the job's public key: every UI machine needs a copy",
            f"  {p.client_secret.name:<18} a UI's key pair (0600)",
            f"  {p.client_public.name:<18} that UI's public key, authorized by its copy in "
            f"{p.authorized_client}",
            "",
            "Bind a public address (a job refuses to without these keys):",
            f"  TORCHSCOPE_BIND={EXAMPLE_BIND} torchscope run train.py",
            "ipc:// endpoints need no keys; loopback TCP uses keys each job makes for itself.",
            "",
            "Watch from another machine (UIHOST): copy the job's public key and the UI key pair",
            "there, privately (or into its $TORCHSCOPE_KEYS_DIR):",
            "  ssh UIHOST 'mkdir -p -m 700 ~/.config/torchscope/keys'",
            f"  scp -p {p.server_public} {p.client_public} {p.client_secret} "
            "UIHOST:.config/torchscope/keys/",
            "then on UIHOST:  torchscope tui tcp://JOBHOST:5555",
            "",
            "A UI machine with its own key pair: run `torchscope keys` there, copy its client.key",
            f"into {p.authorized_dir}/NAME.key here, and restart the job.",
        ]
    )


__all__ = [
    "AUTHORIZED_DIR",
    "ENV_KEYS_DIR",
    "ClientKeys",
    "KeyPaths",
    "SecurityError",
    "ServerKeys",
    "SessionKeys",
    "configure_client",
    "configure_server",
    "find_session_keys",
    "generate_and_describe",
    "generate_keys",
    "keys_dir",
    "load_authorized",
    "load_client_keys",
    "load_server_keys",
    "new_session_keys",
    "remove_session_keys",
    "require_curve",
    "start_authenticator",
    "write_session_keys",
]
