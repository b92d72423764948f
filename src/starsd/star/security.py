"""Who may talk to a StarSD socket: CurveZMQ keys, the rule for listening without them, and a
client's socket, connected with its keys.

`starsd keys DIR NAME` writes a key pair with pyzmq's zmq.auth: DIR/NAME.key holds the public key
(give it to the peers) and DIR/NAME.key_secret both keys (keep it). A server given its secret key
and a directory of allowed public keys runs CURVE: ZeroMQ's authentication handler (ZAP) checks
each peer's key during the handshake, so a peer without an allowed key never completes it and gets
no message at all. Every message then carries its peer's public key (the ZAP "User-Id"), and a
session belongs to that key as well as to the connection. A client needs its own key pair and the
server's public key.

Without keys a server listens only on loopback (127.0.0.0/8, ::1, localhost, ipc://, inproc://):
binding any other address unencrypted and unauthenticated takes an explicit `insecure`.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from starsd.config import ClientKeys
from starsd.errors import StarsdError, Unavailable


class SecurityError(StarsdError, ValueError):
    """Keys that cannot be used, or an address that may not be bound without them."""


def make_keys(directory: str, name: str) -> tuple[str, str]:
    """Write a new key pair; returns the paths of the public and the secret key file."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ address can be reached from this machine only."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    return is_loopback_host(rest.rsplit(":", 1)[0])


def is_loopback_host(host: str) -> bool:
    """Whether a host name or IP address (an HTTP server's --host) is reachable from this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # "*", "", an interface name or a host name: could be reachable from anywhere
        return False


def check_listen(bind: str, key: str = "", allowed: str = "", insecure: bool = False) -> None:
    """Refuse, before any model is loaded, what binding `bind` would refuse later: an address that
    may not be opened without keys, keys that cannot be read, a TCP port that is taken."""
    _check_keys(bind, key, allowed, insecure)
    if key:
        _load(key, secret=True)
    scheme, _, rest = bind.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme != "tcp" or not port.isdigit() or port == "0":
        return  # ipc, inproc, or a port ZeroMQ picks: nothing to take
    host = "" if host == "*" else host.strip("[]")
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZeroMQ does: TIME_WAIT is no owner
            probe.bind((host, int(port)))
    except socket.gaierror:
        return  # an interface name (tcp://eth0:5555): ZeroMQ resolves it, and refuses it if it must
    except OSError as e:
        raise Unavailable(f"cannot listen on {bind}: {e.strerror.lower()}; choose another address or port") from None


def _check_keys(bind: str, key: str, allowed: str, insecure: bool) -> None:
    if not key:
        if allowed:
            raise SecurityError("allowed client keys were given without the server's own secret key")
        if not (insecure or is_loopback(bind)):
            raise SecurityError(f"{bind} is not a loopback address: give the server a key pair and the allowed "
                                "client keys (starsd keys), or pass --insecure to listen without authentication")
    elif not allowed or not Path(allowed).is_dir():
        raise SecurityError(f"a directory of allowed client public keys is needed with a server key, not {allowed!r}")


def _load(path: str, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot read the key file {path}: {e}") from e
    if secret and secret_key is None:
        raise SecurityError(f"{path} holds no secret key: give the .key_secret file that `starsd keys` wrote")
    return public, secret_key


def guard_server(ctx: zmq.Context, sock: zmq.Socket, bind: str, key: str = "", allowed: str = "",
                 insecure: bool = False) -> ThreadAuthenticator | None:
    """Set up `sock` (before it binds `bind`): CURVE with the secret `key` and the public keys in the
    directory `allowed`, or no keys on a loopback address (or with `insecure`). Returns the running
    authenticator, to be stopped before the context is closed."""
    _check_keys(bind, key, allowed, insecure)
    if not key:
        return None
    public, secret = _load(key, secret=True)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=allowed)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return auth


def guard_client(sock: zmq.Socket, key: str = "", server_key: str = "") -> None:
    """Set up `sock` (before it connects) to authenticate with the secret `key` to the server whose
    public key is in `server_key`; nothing without keys."""
    if not key and not server_key:
        return
    if not (key and server_key):
        raise SecurityError("a client needs both its own secret key and the server's public key")
    public, secret = _load(key, secret=True)
    server_public, _ = _load(server_key, secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def peer_key(frame: zmq.Frame) -> str:
    """The authenticated public key (Z85) of the peer that sent `frame`; "" without CURVE."""
    try:
        return frame.get("User-Id") or ""
    except (zmq.ZMQError, KeyError):
        return ""


SEND_TIMEOUT_MS = 5000  # a send that cannot even be queued (connect(), below)


def connect(ctx: zmq.Context, address: str, keys: ClientKeys, send_hwm: int = 0) -> zmq.Socket:
    """A DEALER socket with a fresh random routing id, connected to `address` (authenticating with
    `keys` if given); `send_hwm` > 0 bounds the messages it queues while the server is away."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # A message that cannot even be queued fails instead of blocking for good. A DEALER queues for a
    # server that is away, but not once a server has refused its key: libzmq 4.3.5 then drops the
    # connection, and a send more than a few ms after connect() finds none to queue on (measured).
    # An allowed client's hello once blocked in send too, beside another test module (cause not found)
    sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
    sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().bytes)
    if send_hwm:
        sock.setsockopt(zmq.SNDHWM, send_hwm)
    guard_client(sock, keys.curve_key, keys.curve_server_key)
    sock.connect(address)
    return sock
