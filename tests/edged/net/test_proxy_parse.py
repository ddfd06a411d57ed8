"""The SNI/Host proxy's parsing of the first bytes (no root): real ClientHellos made by the
ssl module, split records, HTTP request heads."""

from __future__ import annotations

import ssl

import pytest

from edged.net.proxy import NotNamed, http_host, tls_server_name


def client_hello(name: str | None) -> bytes:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(inc, out, server_hostname=name)
    with pytest.raises(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def split_records(hello: bytes, at: int) -> bytes:
    """The same handshake message in two TLS records (RFC 8446 §5.1 allows it)."""
    body = hello[5:]
    head = hello[:3]
    return (head + len(body[:at]).to_bytes(2, "big") + body[:at]
            + head + len(body[at:]).to_bytes(2, "big") + body[at:])


def test_sni_of_a_real_client_hello() -> None:
    hello = client_hello("Files.PythonHosted.org")
    assert tls_server_name(hello) == "files.pythonhosted.org"
    for cut in (3, 5, 40, len(hello) - 1):
        assert tls_server_name(hello[:cut]) is None, cut  # more bytes needed
    assert tls_server_name(split_records(hello, 30)) == "files.pythonhosted.org"
    assert tls_server_name(split_records(hello, 30)[:60]) is None


def test_what_names_no_host_is_refused() -> None:
    with pytest.raises(NotNamed) as e:
        tls_server_name(client_hello(None))
    assert e.value.why == "no_sni"
    for data in (b"GET / HTTP/1.1\r\n\r\n", b"\x16\x03\x01\x00\x05\x02\x00\x00\x01\x00",
                 b"\x17\x03\x03\x00\x10" + bytes(16)):
        with pytest.raises(NotNamed) as e:
            tls_server_name(data)
        assert e.value.why == "not_tls", data


def test_http_host() -> None:
    assert http_host(b"GET /simple/ HTTP/1.1\r\nHost: PyPI.org:80\r\nA: b\r\n\r\n") == "pypi.org"
    assert http_host(b"GET http://deb.debian.org/debian HTTP/1.1\r\nHost: x.org\r\n\r\n") \
        == "deb.debian.org"
    assert http_host(b"GET / HTTP/1.0\r\nhost:[2001:db8::1]:80\r\n\r\n") == "2001:db8::1"
    assert http_host(b"GET / HTTP/1.1\r\nHost: a.org\r\n") is None  # head not complete
    assert http_host(b"GE") is None
    for data, why in ((b"CONNECT evil.org:443 HTTP/1.1\r\n\r\n", "connect_method"),
                      (b"hello\n", "not_http"), (b"\x16\x03\x01\x02\x00\x01\x00\x01", "not_http"),
                      (b"GET / HTTP/1.1\r\n\r\n", "no_host"), (b"GET /\r\n\r\n", "not_http")):
        with pytest.raises(NotNamed) as e:
            http_host(data)
        assert e.value.why == why, data
