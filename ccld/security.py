"""Who may talk to a collector: CurveZMQ keys, the collector's allow-list, and the loopback rule.

A collector listens on loopback by default, where only local processes reach it. Listening on any
other address needs CurveZMQ: traffic is encrypted, the agent proves it holds a key the collector
lists, and the agent checks the collector's public key. `ccld keys DIR NAME` makes a key pair
(NAME.key public, NAME.key_secret owner-only). A collector is given its secret key and a directory
of allowed agents' public keys; an agent is given its own secret key and the collector's public key.
Every refused agent is logged with its key. Caveat: keys are read once at start; to revoke one,
remove its file and restart the collector.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import re
import threading
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Set

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from ccld.errors import CcldError

log = logging.getLogger("ccld.security")


class SecurityError(CcldError):
    pass


def is_loopback(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// endpoints on 127.0.0.0/8, ::1 or localhost."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    m = re.match(r"^tcp://(\[[^\]]+\]|[^:]+):", endpoint)
    if not m:
        return False
    host = m.group(1).strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname or interface name: it may be reachable from outside


def make_keypair(directory: str, name: str) -> tuple:
    """Write NAME.key (public) and NAME.key_secret (owner-only) in DIRECTORY (made 0700)."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SecurityError(f"key name {name!r}: use letters, digits, '.', '_' and '-' only")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.chmod(directory, 0o700)
    old = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(old)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
    return public, secret


def _load(path: str, need_secret: bool) -> tuple:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise SecurityError(f"cannot read key file {path}: {e}") from None
    if need_secret and not secret:
        raise SecurityError(f"{path} holds no secret key (give the .key_secret file)")
    if need_secret and os.stat(path).st_mode & 0o077:
        raise SecurityError(f"{path} is readable by others: chmod 600 {path}")
    return public, secret


@dataclass(frozen=True)
class ServerKeys:
    secret_file: str   # the collector's NAME.key_secret
    allow_dir: str     # a directory of allowed agents' NAME.key files


@dataclass(frozen=True)
class ClientKeys:
    secret_file: str   # the agent's NAME.key_secret
    server_file: str   # the collector's NAME.key (public)


class _AllowList:
    """CURVE credentials check for the ZAP handler: listed keys pass; others are refused and logged."""

    def __init__(self, allow_dir: str, on_refused: Callable[[str], None]):
        self.allowed: Set[bytes] = set()
        self.on_refused = on_refused
        self.refused: Dict[bytes, int] = {}
        self._lock = threading.Lock()
        try:
            names = sorted(os.listdir(allow_dir))
        except OSError as e:
            raise SecurityError(f"cannot read allowed-agent keys in {allow_dir}: {e}") from None
        for n in names:
            if n.endswith(".key"):
                pub, _ = _load(os.path.join(allow_dir, n), need_secret=False)
                self.allowed.add(pub)
        if not self.allowed:
            raise SecurityError(f"no agent public keys (*.key) in {allow_dir}: every agent would be refused")

    def callback(self, domain, z85_key: bytes) -> bool:
        if z85_key in self.allowed:
            return True
        with self._lock:
            n = self.refused[z85_key] = self.refused.get(z85_key, 0) + 1
        if n == 1 or n % 100 == 0:  # an agent retrying every 200 ms must not flood the log
            self.on_refused(f"ccld: refused an agent with an unlisted key {z85_key.decode()} ({n} tries)")
        return False


class ServerGuard:
    """The ZAP authenticator and a handshake watcher of one CURVE server socket; stop() ends both."""

    HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, keys: ServerKeys, on_refused: Callable[[str], None]):
        public, secret = _load(keys.secret_file, need_secret=True)
        self.allow_list = _AllowList(keys.allow_dir, on_refused)
        self.on_refused = on_refused
        self.failed_handshakes = 0
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("ccld.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=self.allow_list)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        # A client without CURVE never reaches the allow-list (the handshake fails first): watch
        # the socket's handshake failures so those are logged too.
        self._sock = sock
        self._monitor = sock.get_monitor_socket(self.HANDSHAKE_FAILED)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ccld-handshakes", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        from zmq.utils.monitor import recv_monitor_message
        while not self._stop.is_set():
            if not self._monitor.poll(200):
                continue
            try:
                msg = recv_monitor_message(self._monitor)
            except zmq.ZMQError:
                break
            self.failed_handshakes += 1
            if self.failed_handshakes == 1 or self.failed_handshakes % 100 == 0:
                self.on_refused(f"ccld: refused a connection that failed the CURVE handshake "
                                f"(no or wrong encryption; {self.failed_handshakes} so far; "
                                f"{msg.get('endpoint', b'').decode(errors='replace')})")
        self._monitor.close(linger=0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.auth.stop()


def secure_server(ctx: zmq.Context, sock: zmq.Socket, keys: ServerKeys,
                  on_refused: Callable[[str], None]) -> ServerGuard:
    """Make `sock` (not yet bound) a CURVE server that accepts only agents in keys.allow_dir."""
    return ServerGuard(ctx, sock, keys, on_refused)


def secure_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """Make `sock` (not yet connected) a CURVE client of the collector whose public key is given."""
    public, secret = _load(keys.secret_file, need_secret=True)
    server_public, _ = _load(keys.server_file, need_secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def check_listen(endpoint: str, keys: Optional[ServerKeys]) -> None:
    """Refuse to listen beyond loopback without authentication."""
    if keys is None and not is_loopback(endpoint):
        raise SecurityError(
            f"refusing to listen on {endpoint} without authentication: anyone who can reach it could "
            "send events. Make keys (ccld keys DIR collector; ccld keys DIR agent1) and start with "
            "--curve-key DIR/collector.key_secret --allow-keys DIR_WITH_AGENT_PUBLIC_KEYS, or listen on "
            "tcp://127.0.0.1:PORT")
