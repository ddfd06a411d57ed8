"""The kernel's audit records as AppArmor denials: the record text (as AppArmor writes it in
security/apparmor/audit.c and lib/audit.c), the netlink framing, and the reader's socket.
The whole path, a real denial in a real sandbox recorded in the ledger, is in
tests/security/test_apparmor.py (kernels with AppArmor: scripts/node-vm.sh)."""

from __future__ import annotations

import asyncio
import os
import struct

import pytest

from edged.security import apparmor, audit

OPEN = ('audit(1764590400.123:4242): apparmor="DENIED" operation="open" class="file" '
        'profile="edged-sbx-t1" name="/answers/key.txt" pid=31337 comm="cat" '
        'requested_mask="r" denied_mask="r" fsuid=1073741824 ouid=1073741824')
SIGNAL = ('audit(1764590400.456:4243): apparmor="DENIED" operation="signal" class="signal" '
          'profile="edged-sbx-t1" pid=4000 comm="kill" requested_mask="send" '
          'denied_mask="send" signal=term peer="unconfined"')
# a name with a space is logged as hex (audit_log_untrustedstring)
HEX = ('audit(1764590401.000:4244): apparmor="DENIED" operation="mknod" class="file" '
       'profile="edged-grader-t1" name=2F7573722F62696E2F612062 pid=12 comm=6D7920746F6F6C '
       'requested_mask="c" denied_mask="c"')
ALLOWED = ('audit(1764590401.000:4245): apparmor="ALLOWED" operation="open" '
           'profile="edged-sbx-t1" name="/x" pid=1 comm="a"')


def _nl(rtype: int, text: str) -> bytes:
    body = text.encode() + b"\0"
    msg = struct.pack("=IHHII", 16 + len(body), rtype, 0, 0, 0) + body
    return msg + b"\0" * (-len(msg) % 4)


def test_a_file_denial_is_parsed() -> None:
    d = audit.apparmor_denial(audit.parse_record(audit.AUDIT_AVC, OPEN))
    assert d is not None
    assert (d.profile, d.operation, d.name, d.pid, d.comm) == (
        "edged-sbx-t1", "open", "/answers/key.txt", 31337, "cat")
    assert d.detail() == {"operation": "open", "profile": "edged-sbx-t1", "audit_serial": 4242,
                          "requested": "r", "denied": "r"}
    assert apparmor.sandbox_of(d.profile) == "t1"


def test_a_signal_denial_names_the_peer_and_signal() -> None:
    d = audit.apparmor_denial(audit.parse_record(audit.AUDIT_AVC, "type=1400 " + SIGNAL))
    assert d is not None and d.operation == "signal"
    assert (d.peer, d.signal, d.name, d.serial) == ("unconfined", "term", None, 4243)


def test_hex_encoded_untrusted_strings_are_decoded() -> None:
    d = audit.apparmor_denial(audit.parse_record(audit.AUDIT_AVC, HEX))
    assert d is not None
    assert (d.name, d.comm) == ("/usr/bin/a b", "my tool")
    assert apparmor.sandbox_of(d.profile) == "t1"


def test_what_is_not_a_denial_of_ours_is_left_out() -> None:
    assert audit.apparmor_denial(audit.parse_record(audit.AUDIT_AVC, ALLOWED)) is None
    # the same text in a user-space message type (AUDIT_USER_AVC, 1107: any process with
    # CAP_AUDIT_WRITE can send one) is not the kernel's and is ignored
    assert audit.apparmor_denial(audit.parse_record(1107, OPEN)) is None
    with pytest.raises(ValueError):
        audit.parse_record(audit.AUDIT_AVC, 'apparmor="DENIED" profile="edged-sbx-x"')
    for label in ("unconfined", "edged-sbx-", "edged-sbxx", "/usr/bin/man", "edged-sbx-A B"):
        assert apparmor.sandbox_of(label) is None, label
    assert apparmor.sandbox_of("edged-sbx-a.b//null-/bin/true") == "a.b"


def test_netlink_datagrams_carry_one_or_more_records() -> None:
    data = _nl(audit.AUDIT_AVC, OPEN) + _nl(1300, "audit(1.2:3): arch=c000003e syscall=2") + \
        _nl(audit.AUDIT_AVC, SIGNAL)
    recs = audit.parse_messages(data)
    assert [r.type for r in recs] == [audit.AUDIT_AVC, 1300, audit.AUDIT_AVC]
    assert [r.serial for r in recs] == [4242, 3, 4243]
    # a truncated message ends the datagram, whatever it held
    assert [r.serial for r in audit.parse_messages(data[:-5])] == [4242, 3]
    assert audit.parse_messages(b"\x01\x02") == []


@pytest.mark.root
def test_the_reader_joins_the_audit_log_and_leaves_it() -> None:
    seen: list[audit.AppArmorDenial] = []

    async def body() -> None:
        r = audit.AuditReader(seen.append)
        assert r.start(), "root has CAP_AUDIT_READ: the multicast group can be joined"
        fd = r._sock.fileno() if r._sock is not None else -1
        assert os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        assert r.start()  # once
        r.close()
        r.close()
        with pytest.raises(OSError):
            os.fstat(fd)

    asyncio.run(body())
    assert seen == []
