"""Helpers for the remote-tier tests: a real redis-server on a free loopback port, and remote "nodes"."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from jitwarm.cache import KernelCache

WORKER = Path(__file__).with_name("workers") / "remote_worker.py"
SKIP_REASON = ("needs Redis: set JITWARM_TEST_REDIS_URL=redis://HOST:PORT/DB or put redis-server on PATH "
               "(apt-get install -y redis-server)")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str | None:
    """Return the path of redis-server, or None."""
    return shutil.which("redis-server")


class RedisServer:
    """A redis-server process of our own on 127.0.0.1 (no persistence), for one session or one test."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"redis-{self.port}.log"
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(workdir), "--logfile", str(self.log), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.password = extra[extra.index("--requirepass") + 1] if "--requirepass" in extra else None
        self._wait_ready()

    def url(self, db: int = 0) -> str:
        """Return the redis:// URL of database ``db`` (with the password, if any)."""
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    def _wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited ({self.proc.returncode}); see {self.log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not listen on port {self.port} within {timeout} s")

    def stop(self) -> None:
        """Kill the server (SIGKILL: as abrupt as a crashed cache node) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


class TrickleProxy:
    """A TCP proxy on 127.0.0.1 in front of ``port``: what the client sends passes at once; what comes back passes
    at once too, or, while ``trickle`` is set, ``chunk`` bytes every ``pace`` seconds (each read is quick, the
    whole reply is not). ``trickled`` counts connections that trickled. Stopped with :meth:`stop`."""

    def __init__(self, port: int) -> None:
        import threading

        self.trickle = False
        self.chunk, self.pace = 100, 0.2
        self.trickled = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._upstream = port
        self._threads = threading
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            upstream = socket.create_connection(("127.0.0.1", self._upstream))
            self._threads.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            self._threads.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, back: bool) -> None:
        counted = False
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if not (back and self.trickle):
                    dst.sendall(data)
                    continue
                if not counted:
                    self.trickled, counted = self.trickled + 1, True
                for i in range(0, len(data), self.chunk):
                    dst.sendall(data[i:i + self.chunk])
                    time.sleep(self.pace)
        for s in (src, dst):  # one side closed or was shut: close both, so the other pipe ends too
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def stop(self) -> None:
        self._listener.close()


class Remote:
    """One test's view of the shared Redis: its URL and a namespace (key prefix) no other test uses."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.prefix = f"jwtest-{uuid.uuid4().hex[:12]}"

    def client(self):
        """A redis-py client on the same server (for inspecting or tampering with entries)."""
        import redis

        return redis.Redis.from_url(self.url)

    def cache(self, root: Path, **kwargs) -> KernelCache:
        """A "node": a KernelCache on its own ``root`` that shares this remote."""
        kwargs.setdefault("layers", ())
        return KernelCache(root=root, remote=self.url, remote_prefix=self.prefix, **kwargs)

    def entry_name(self, key: str) -> str:
        """The Redis key of the entry hash of ``key``."""
        return f"{self.prefix}:v1:entry:{key}"

    def lease_name(self, key: str) -> str:
        """The Redis key of the fleet lease of ``key``."""
        return f"{self.prefix}:v1:lease:{key}"

    def flags(self) -> list[str]:
        """The jitwarm CLI flags that point at this remote."""
        return ["--remote", self.url, "--remote-prefix", self.prefix]

    def spawn(self, root: Path, n: int, *, env: dict[str, str] | None = None, **flags: object) -> subprocess.Popen:
        """Start a remote_worker.py node on ``root`` for artifact ``n``; ``flags`` become ``--name value``."""
        cmd = [sys.executable, str(WORKER), str(root), self.url, self.prefix, str(n)]
        for name, value in flags.items():
            opt = f"--{name.replace('_', '-')}"
            cmd += [opt] if value is True else [opt, str(value)]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, **(env or {})})


class MotoServer:
    """A moto S3 server of our own on 127.0.0.1 (``moto_server -H 127.0.0.1 -p PORT``), in memory."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / f"moto-{self.port}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                                          str(self.port)], stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait_ready()

    def _wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited ({self.proc.returncode}); see {self.log}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return
            time.sleep(0.05)
        raise RuntimeError(f"moto_server did not listen on port {self.port} within {timeout} s")

    def stop(self) -> None:
        """Kill the server (SIGKILL: a store that vanishes) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def use_endpoint(monkeypatch, endpoint: str) -> None:
    """Point boto3 here and in every node at ``endpoint``, whatever the developer's AWS profile says."""
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    for name, value in s3_env(endpoint).items():
        monkeypatch.setenv(name, value)


#: What a client of a loopback moto server needs (any credentials do), and nothing from the developer's ~/.aws.
def s3_env(endpoint: str) -> dict[str, str]:
    """The AWS environment that points boto3 (and so jitwarm) at ``endpoint``."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "jitwarm-test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
            "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


class Bucket:
    """One test's empty bucket on the shared S3 endpoint: its ``s3://`` URL, a client, and "nodes"."""

    def __init__(self, endpoint: str) -> None:
        import boto3

        self.endpoint = endpoint
        self.name = f"jwtest-{uuid.uuid4().hex[:12]}"
        self.prefix = "jitwarm"
        self.url = f"s3://{self.name}/fleet"
        self.client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                                   aws_access_key_id="jitwarm-test", aws_secret_access_key="test")
        self.client.create_bucket(Bucket=self.name)

    def cache(self, root: Path, **kwargs) -> KernelCache:
        """A "node": a KernelCache on its own ``root`` that shares this bucket."""
        kwargs.setdefault("layers", ())
        return KernelCache(root=root, remote=self.url, remote_prefix=self.prefix, **kwargs)

    def flags(self) -> list[str]:
        """The jitwarm CLI flags that point at this bucket."""
        return ["--remote", self.url, "--remote-prefix", self.prefix]

    def keys(self, under: str = "") -> dict[str, int]:
        """Object key -> size of every object under ``fleet/jitwarm/v1/<under>``."""
        listed = self.client.list_objects_v2(Bucket=self.name, Prefix=f"fleet/{self.prefix}/v1/{under}")
        return {o["Key"]: o["Size"] for o in listed.get("Contents", [])}

    def read(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=key)["Body"].read()

    def write(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=body)


class FaultyProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint that breaks the requests it is told to.

    ``fault`` (set at any time) is None (pass through), an HTTP status (``403``, ``412``, ``500``: an S3
    error reply), ``"slow"`` (answer after ``delay`` seconds), ``"truncated"`` (half the body, then close) or
    ``"trickle"`` (the body ``chunk`` bytes at a time, one every ``pace`` seconds: each read is quick, the whole
    is not).
    Only requests whose path contains ``only`` (``"/blobs/"``) are broken. ``hits`` counts broken requests.
    """

    def __init__(self, upstream: str, only: str = "") -> None:
        import http.client
        import http.server
        import threading
        from urllib.parse import urlsplit

        self.fault: int | str | None = None
        self.only = only
        self.delay = 3.0
        self.chunk, self.pace = 100, 0.2
        self.hits = 0
        target = urlsplit(upstream)
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                fault = proxy.fault if proxy.only in self.path else None
                if isinstance(fault, int):
                    proxy.hits += 1
                    code = {403: "AccessDenied", 412: "PreconditionFailed", 500: "InternalError"}[fault]
                    reply = f"<Error><Code>{code}</Code><Message>injected {fault}</Message></Error>".encode()
                    self.send_response(fault)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                    return
                if fault == "slow":
                    proxy.hits += 1
                    time.sleep(proxy.delay)
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "host")}
                headers["Host"] = target.netloc
                conn.request(self.command, self.path, body=body, headers=headers)
                upstream_reply = conn.getresponse()
                data = upstream_reply.read()
                self.send_response(upstream_reply.status)
                for k, v in upstream_reply.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "date", "server"):
                        self.send_header(k, v)
                size = upstream_reply.getheader("Content-Length") if self.command == "HEAD" else len(data)
                self.send_header("Content-Length", str(size or 0))
                cut = fault == "truncated" and self.command == "GET" and len(data) > 1
                if cut:
                    proxy.hits += 1
                    self.send_header("Connection", "close")
                self.end_headers()
                if fault == "trickle" and self.command == "GET":
                    proxy.hits += 1
                    self._trickle(data)
                else:
                    self.wfile.write(data[: len(data) // 2] if cut else data)
                self.close_connection = cut or fault == "trickle"
                conn.close()

            def _trickle(self, data: bytes) -> None:
                try:
                    for i in range(0, len(data), proxy.chunk):
                        self.wfile.write(data[i:i + proxy.chunk])
                        self.wfile.flush()
                        time.sleep(proxy.pace)
                except OSError:  # the reader gave up: its deadline shut the connection
                    pass

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()



def warm_while_the_store_stops(server: RedisServer | MotoServer, root: Path, *flags: str) -> tuple[int, str, str]:
    """Run ``jitwarm warm`` of the tiny plan on ``root`` with ``flags``; stop ``server`` once a spec is published.

    The store goes away mid-warm (SIGKILL) after the first spec is in the local root; returns the warm's
    (exit code, stdout, stderr). The server is stopped whatever happens.
    """
    from precompile_fixtures import TINY_FAST, start_jitwarm

    try:
        proc = start_jitwarm("warm", *TINY_FAST, "--json", "--jobs", "1", "--cache-dir", str(root), *flags)
        deadline = time.monotonic() + 60
        while not any((root / "v1" / "entries").glob("*/*")):  # the first spec is published locally
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        server.stop()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        server.stop()
    return proc.returncode, stdout, stderr


def assert_built_locally(root: Path, code: int, stdout: str, stderr: str) -> None:
    """A lenient warm whose store went away: exit 0, every spec built here, the store reported unavailable."""
    assert code == 0, stderr
    report = json.loads(stdout)
    assert report["ok"] and report["totals"]["built"] == 3
    assert report["remote"]["available"] is False and "Error" in report["remote"]["error"]
    assert KernelCache(root=root, layers=()).verify([s["key"] for s in report["specs"]]).clean
