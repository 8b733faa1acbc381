"""Fuzz the terminal relay's filter (runner/vtfilter.py), in both encodings.

The bytes are what a confined command writes to its terminal. Checked on every input:

- nothing escapes `VtFilter.feed` or `flush`;
- fed whole, in two pieces (harness.pieces) and byte by byte, the output and the counts
  are the same;
- the output is a subsequence of the input (nothing is made up or reordered);
- the output holds no string opener (ESC ] P X ^ _), no ENQ and no C1 control (in UTF-8: no
  U+0080-U+009F, raw or encoded; in an 8-bit encoding: no byte of 0x80-0x9F), and every ESC
  in it begins a sequence of the reference grammar below (written from the module's
  docstring, not from its tables);
- the output, filtered again, comes back unchanged with nothing counted: a terminal parses
  it as the filter did.
"""

from __future__ import annotations

import re

import atheris

import harness

with atheris.instrument_imports(include=["egressbox"]):
    from egressbox.runner import vtfilter

harness.check_pure([vtfilter])

_MODES = rb"0*(?:1|5|6|7|9|12|25|47|66|69|100[0234567]|1015|1016|104[789]|2004|2026)"
PASSING = re.compile(
    rb"(?:[^\x1b\x05]"
    rb"|\x1b\[[0-9:;]*[@ABCDEFGHIJKLMPSXZ`abdefgmrs]|\x1b\[[0-9:]*T|\x1b\[u"
    rb"|\x1b\[0*4(?:;0*4)*[hl]|\x1b\[\?" + _MODES + rb"(?:;" + _MODES + rb")*[hl]"
    rb"|\x1b\[\?[0-9:;]*[JK]|\x1b\[[0-9:;]* q|\x1b\[[0-9:;]*!p"
    rb"|\x1b[6789=>cDEFHMNOno|}~]|\x1b[()*+\-./][ -/]*[0-~]|\x1b#[34568])*",
    re.DOTALL,
)
C0_INSIDE = re.compile(rb"[\x00-\x04\x06-\x1a\x1c-\x1f\x7f]")


def filtered(chunks: list[bytes], utf8: bool) -> tuple[bytes, dict[str, int]]:
    vt = vtfilter.VtFilter(utf8=utf8)
    out = b"".join(vt.feed(chunk) for chunk in chunks) + vt.flush()
    return out, vt.dropped


def subsequence(small: bytes, big: bytes) -> bool:
    it = iter(big)
    return all(byte in it for byte in small)


def check(data: bytes, utf8: bool) -> None:
    whole = filtered([data], utf8)
    assert filtered(harness.pieces(data), utf8) == whole
    assert filtered([data[i : i + 1] for i in range(len(data))], utf8) == whole
    out, dropped = whole
    assert set(dropped) <= set(vtfilter.KINDS), dropped
    assert subsequence(out, data)
    assert b"\x05" not in out
    assert PASSING.fullmatch(C0_INSIDE.sub(b"", out)), out
    if utf8:
        text = out.decode("utf-8", "surrogateescape")
        assert not re.search("[\x80-\x9f\udc80-\udc9f]", text), out
    else:
        assert not re.search(rb"[\x80-\x9f]", out), out
    assert filtered([out], utf8) == (out, {})


def test_one_input(data: bytes) -> None:
    check(data, utf8=True)
    check(data, utf8=False)


if __name__ == "__main__":
    harness.main(test_one_input)
