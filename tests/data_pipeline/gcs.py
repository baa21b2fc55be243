"""A Google Cloud Storage endpoint on 127.0.0.1 for ``gs://`` tests: gcp-storage-emulator's
JSON API, behind a TLS front (``gsutil`` speaks only HTTPS) with a self-signed certificate,
and a boto config that points the real ``gsutil`` at it."""

from __future__ import annotations

import datetime
import socket
import ssl
import threading
import urllib.request
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from gcp_storage_emulator.server import create_server

from tests.ports import free_port


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class TlsFront:
    """Accepts TLS on ``port`` and relays each connection in plain TCP to ``backend``."""

    def __init__(self, backend: int, directory: Path) -> None:
        self.backend, self.port = backend, free_port()
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.load_cert_chain(*self_signed(directory))
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            secure = self.context.wrap_socket(client, server_side=True)
        except (ssl.SSLError, OSError):
            client.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.backend))
        threading.Thread(target=_pump, args=(upstream, secure), daemon=True).start()
        _pump(secure, upstream)

    def close(self) -> None:
        self.listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class GcsEndpoint:
    """The emulator (in memory) with its TLS front; ``boto_config`` is the file to name in
    ``BOTO_CONFIG``."""

    def __init__(self, directory: Path) -> None:
        self.api_port = free_port()
        self.server = create_server("127.0.0.1", self.api_port, in_memory=True)
        self.server.start()
        self.front = TlsFront(self.api_port, directory)
        self.boto_config = directory / "boto.cfg"
        self.boto_config.write_text(
            "[Credentials]\n"
            f"gs_json_host = 127.0.0.1\ngs_json_port = {self.front.port}\n"
            "[Boto]\nhttps_validate_certificates = False\nnum_retries = 0\n"
            "[GSUtil]\ndefault_project_id = test\n")

    def create_bucket(self, name: str) -> None:
        self._request("POST", "/storage/v1/b?project=test", f'{{"name": "{name}"}}'.encode(),
                      "application/json")

    def upload(self, bucket: str, name: str, data: bytes) -> None:
        self._request("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={name}",
                      data, "application/octet-stream")

    def _request(self, method: str, path: str, body: bytes, kind: str) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{self.api_port}{path}", body,
                                         {"Content-Type": kind}, method=method)
        urllib.request.urlopen(request, timeout=10).close()

    def stop(self) -> None:
        self.front.close()
        self.server.stop()
