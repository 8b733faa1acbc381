"""The terminal relay's filter (runner/vtfilter.py): what acts on the command's own screen
passes byte for byte, what reaches beyond it (clipboard, title, queries the terminal answers,
strings) is dropped whole and counted, whatever way the bytes are cut into reads.

Fed whole, byte by byte and in random pieces (Hypothesis); the output is checked against a
reference grammar of what may pass, written here independently of the module's tables.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from egressbox.runner.vtfilter import (
    MAX_CONTROL_BYTES,
    MAX_STRING_BYTES,
    VtFilter,
    utf8_locale,
)

ESC = b"\x1b"
CSI = b"\x1b["
ST = b"\x1b\\"

# Each passes unchanged, with nothing counted.
SAFE = {
    "text": b"hello, world\r\n",
    "utf8": "Größe 日本語 — 😀 €".encode(),
    "c0": b"a\tb\x08c\x07\x0e\x0f\x00\n\r",
    "sgr": CSI + b"1;31m" + CSI + b"38;5;208m" + CSI + b"38:2::10:20:30m" + CSI + b"m",
    "cursor": CSI + b"5;10H" + CSI + b"A" + CSI + b"3B" + CSI + b"2C" + CSI + b"D" + CSI + b"7G",
    "cursor_more": CSI + b"2E" + CSI + b"F" + CSI + b"3d" + CSI + b"4`" + CSI + b"1;1f",
    "erase": CSI + b"2J" + CSI + b"3J" + CSI + b"K" + CSI + b"1K" + CSI + b"5X",
    "selective_erase": CSI + b"?2J" + CSI + b"?K",
    "insert_delete": CSI + b"3@" + CSI + b"2P" + CSI + b"L" + CSI + b"4M",
    "scroll": CSI + b"1;20r" + CSI + b"3S" + CSI + b"2T" + CSI + b"r",
    "save_restore": ESC + b"7" + ESC + b"8" + CSI + b"s" + CSI + b"u",
    "alternate_screen": CSI + b"?1049h" + CSI + b"?1049l" + CSI + b"?47h" + CSI + b"?1047l",
    "modes": CSI + b"?25l" + CSI + b"?25h" + CSI + b"?7h" + CSI + b"?1h" + CSI + b"?12l",
    "bracketed_paste": CSI + b"?2004h" + CSI + b"?2004l",
    "mouse": CSI + b"?1000;1002;1006h" + CSI + b"?1003l" + CSI + b"?1004h",
    "synchronized": CSI + b"?2026h" + CSI + b"?2026l",
    "insert_mode": CSI + b"4h" + CSI + b"4l",
    "charsets": ESC + b"(0" + ESC + b"(B" + ESC + b")0" + ESC + b"*A" + ESC + b"(%5",
    "line_size": ESC + b"#8" + ESC + b"#6",
    "keypad": ESC + b"=" + ESC + b">",
    "index": ESC + b"D" + ESC + b"E" + ESC + b"M" + ESC + b"H",
    "reset": ESC + b"c" + CSI + b"!p",
    "cursor_style": CSI + b"2 q",
    "tabs": CSI + b"3g" + CSI + b"2I" + CSI + b"Z",
    "repeat": b"x" + CSI + b"5b",
    "c0_inside_csi": CSI + b"1\n2m",
}

# Each is dropped whole, counted as this kind.
UNSAFE = {
    "osc52_bel": (b"\x1b]52;c;aGVsbG8=\x07", "clipboard"),
    "osc52_st": (b"\x1b]52;p;aGVsbG8=" + ST, "clipboard"),
    "osc52_query": (b"\x1b]52;c;?\x07", "clipboard"),
    "osc52_c1": (b"\x9d52;c;aGVsbG8=\x07", "clipboard"),
    "osc52_c1_utf8": (b"\xc2\x9d52;c;aGVsbG8=\x07", "clipboard"),
    "title_0": (b"\x1b]0;fake title\x07", "title"),
    "title_2": (b"\x1b]2;fake" + ST, "title"),
    "colour_query": (b"\x1b]11;?\x07", "colour"),
    "palette_query": (b"\x1b]4;1;?" + ST, "colour"),
    "hyperlink": (b"\x1b]8;;https://example.com/\x07", "osc"),
    "notify": (b"\x1b]777;notify;a;b\x07", "osc"),
    "decrqss": (b"\x1bP$qm" + ST, "dcs"),
    "xtgettcap": (b"\x1bP+q544e" + ST, "dcs"),
    "tmux_passthrough": (b"\x1bPtmux;\x1b\x1b]52;c;aGk=\x07" + ST, "dcs"),
    "dcs_c1": (b"\x90$qm\x9c", "dcs"),
    "apc_kitty": (b"\x1b_Gf=100,t=f;L2V0Yy9wYXNzd2Q=" + ST, "apc_pm_sos"),
    "pm": (b"\x1b^private" + ST, "apc_pm_sos"),
    "sos": (b"\x1bXstring" + ST, "apc_pm_sos"),
    "da1": (CSI + b"c", "query"),
    "da1_0": (CSI + b"0c", "query"),
    "da2": (CSI + b">c", "query"),
    "da3": (CSI + b"=c", "query"),
    "dsr": (CSI + b"5n", "query"),
    "cpr": (CSI + b"6n", "query"),
    "dec_dsr": (CSI + b"?6n", "query"),
    "decrqm": (CSI + b"?2004$p", "query"),
    "decrqm_ansi": (CSI + b"4$p", "query"),
    "decreqtparm": (CSI + b"x", "query"),
    "xtversion": (CSI + b">q", "query"),
    "decrqcra": (CSI + b"1;1;1;1;10;10*y", "query"),
    "kitty_keyboard_query": (CSI + b"?u", "query"),
    "decid": (ESC + b"Z", "query"),
    "enq": (b"\x05", "query"),
    "csi_c1_query": (b"\x9b6n", "query"),
    "title_report": (CSI + b"21t", "window"),
    "size_report": (CSI + b"18t", "window"),
    "window_move": (CSI + b"3;0;0t", "window"),
    "title_push": (CSI + b"22;0t", "window"),
    "deccolm": (CSI + b"?3h", "csi"),
    "unknown_dec_mode": (CSI + b"?1;3h", "csi"),
    "lnm": (CSI + b"20h", "csi"),
    "srm": (CSI + b"12l", "csi"),
    "modify_keys": (CSI + b">4;1m", "csi"),
    "kitty_keyboard_push": (CSI + b">1u", "csi"),
    "xtrestore": (CSI + b"?1000r", "csi"),
    "media_copy": (CSI + b"5i", "csi"),
    "mouse_highlight": (CSI + b"1;2;3;4;5T", "csi"),
    "malformed": (CSI + b"1?2m", "csi"),
    "docs": (ESC + b"%@", "esc"),
    "s8c1t": (ESC + b" G", "esc"),
    "lone_st": (ST, "esc"),
    "c1_ind": (b"\x84", "c1"),
    "c1_utf8_nel": (b"\xc2\x85", "c1"),
    "csi_c1_sgr": (b"\x9b1m", "c1"),
}


def run(
    data: bytes, *, utf8: bool = True, cut: list[int] | None = None
) -> tuple[bytes, dict[str, int]]:
    """The filter's output for `data` (cut at the offsets in `cut`), then its counts."""
    vt = VtFilter(utf8=utf8)
    pieces, last = [], 0
    for point in [*(cut or []), len(data)]:
        pieces.append(vt.feed(data[last:point]))
        last = point
    pieces.append(vt.flush())
    return b"".join(pieces), vt.dropped


@pytest.mark.parametrize("name", sorted(SAFE))
def test_what_acts_on_the_screen_passes_unchanged(name: str) -> None:
    data = SAFE[name]
    for cut in (None, list(range(1, len(data)))):
        assert run(data, cut=cut) == (data, {}), name


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_what_reaches_beyond_the_screen_is_dropped_and_counted(name: str) -> None:
    data, kind = UNSAFE[name]
    framed = b"<" + data + b">"
    for cut in (None, list(range(1, len(framed)))):
        assert run(framed, cut=cut) == (b"<>", {kind: 1}), name


def test_a_string_ended_by_another_sequence_drops_only_itself() -> None:
    # ESC that is not ST ends the string (as terminals do) and begins the next sequence.
    data = b"\x1b]52;c;aGk=\x1b[1mbold"
    assert run(data) == (b"\x1b[1mbold", {"clipboard": 1})


def test_cancel_and_substitute_abandon_a_sequence() -> None:
    assert run(b"\x1b[1\x18m\x1b]52;c;x\x1aok") == (b"mok", {"clipboard": 1})


def test_enq_inside_a_passing_sequence_is_taken_out() -> None:
    assert run(CSI + b"1\x05m") == (CSI + b"1m", {"query": 1})


def test_an_endless_string_is_abandoned_at_the_bound() -> None:
    tail = b"visible"
    data = b"\x1b]52;c;" + b"A" * (MAX_STRING_BYTES - 5) + tail
    out, dropped = run(data, cut=[5, 1000, 70000])
    # The bound is on the string's bytes after ESC ]: what comes after shows as text.
    assert out == tail and dropped == {"clipboard": 1, "unterminated": 1}


def test_an_endless_control_sequence_is_abandoned_at_the_bound() -> None:
    data = CSI + b"1;" * MAX_CONTROL_BYTES + b"m"
    out, dropped = run(data)
    assert dropped == {"unterminated": 1}
    assert out == data[MAX_CONTROL_BYTES:], "what follows the bound is text"


def test_an_open_sequence_at_the_end_is_dropped() -> None:
    assert run(b"ok\x1b]52;c;abc") == (b"ok", {"clipboard": 1, "unterminated": 1})
    assert run(b"ok\x1b[12") == (b"ok", {"unterminated": 1})


def test_utf8_characters_cut_between_reads_pass_whole() -> None:
    data = "€😀é".encode()
    for cut in ([1], [2], [1, 2], [4, 5, 6], list(range(1, len(data)))):
        assert run(data, cut=cut) == (data, {})


def test_bytes_of_no_utf8_character_are_left_out_and_never_make_a_c1() -> None:
    # 0x80-0x9F alone are C1 controls; an overlong form of ESC (C0 9B) makes nothing.
    assert run(b"a\xffb\xe9c\xc3") == (b"abc", {})
    assert run(b"\xc0\x9b6n") == (b"", {"query": 1})


def test_an_8bit_locale_drops_every_c1_byte() -> None:
    # Under ISO-8859-1, the continuation bytes of UTF-8 text are C1 controls (0x9D is OSC).
    # The OSC that 0x9D opens runs to the end, as such a terminal would read it.
    out, dropped = run("a✝b".encode(), utf8=False)  # U+271D: E2 9C 9D
    assert out == b"a\xe2" and dropped == {"c1": 1, "osc": 1, "unterminated": 1}
    assert run(b"caf\xe9", utf8=False) == (b"caf\xe9", {})


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"LANG": "C.UTF-8"}, True),
        ({"LANG": "en_US.utf8"}, True),
        ({}, True),
        ({"LANG": "C"}, True),
        ({"LANG": "de_DE.ISO-8859-1"}, False),
        ({"LANG": "en_US"}, False),
        ({"LANG": "en_US.UTF-8", "LC_CTYPE": "fr_FR.ISO-8859-15"}, False),
        ({"LANG": "fr_FR", "LC_ALL": "fr_FR.UTF-8@euro"}, True),
    ],
)
def test_the_callers_locale_chooses_the_encoding(env: dict[str, str], expected: bool) -> None:
    assert utf8_locale(env) is expected


# -- properties -----------------------------------------------------------------------------

FRAGMENTS = [*SAFE.values(), *(data for data, _ in UNSAFE.values())]
FRAGMENTS += [ESC, CSI, b"\x1b]", b"\x1bP", b"\x07", ST, b"\x9b", b"\x9d", b"\xc2", b"\x18"]

# The reference: what may reach the terminal, written from the module's docstring.
_MODES = r"0*(?:1|5|6|7|9|12|25|47|66|69|100[0234567]|1015|1016|104[789]|2004|2026)"
_PASSING = re.compile(
    rb"(?:[^\x1b\x05]"  # text (C0 controls among a sequence's bytes were taken out)
    rb"|\x1b\[[0-9:;]*[@ABCDEFGHIJKLMPSXZ`abdefgmrs]|\x1b\[[0-9:]*T|\x1b\[u"
    rb"|\x1b\[0*4(?:;0*4)*[hl]|\x1b\[\?" + _MODES.encode() + rb"(?:;" + _MODES.encode() + rb")*[hl]"
    rb"|\x1b\[\?[0-9:;]*[JK]|\x1b\[[0-9:;]* q|\x1b\[[0-9:;]*!p"
    rb"|\x1b[6789=>cDEFHMNOno|}~]|\x1b[()*+\-./][ -/]*[0-~]|\x1b#[34568])*"
)


def _is_subsequence(small: bytes, big: bytes) -> bool:
    it = iter(big)
    return all(byte in it for byte in small)


@st.composite
def terminal_output(draw: st.DrawFn) -> bytes:
    parts = draw(
        st.lists(
            st.one_of(
                st.sampled_from(FRAGMENTS),
                st.binary(max_size=6),
                st.text(max_size=4).map(str.encode),
            ),
            max_size=24,
        )
    )
    return b"".join(parts)


@given(terminal_output(), st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_any_cut_gives_the_same_output_and_counts(data: bytes, points: list[int]) -> None:
    whole = run(data)
    assert run(data, cut=sorted(p for p in points if p <= len(data))) == whole
    assert run(data, cut=list(range(1, len(data)))) == whole


@given(terminal_output(), st.booleans())
def test_only_what_may_pass_passes(data: bytes, utf8: bool) -> None:
    out, _ = run(data, utf8=utf8)
    assert _is_subsequence(out, data)
    # The reference grammar, on the output without its C0 controls (ESC aside).
    assert _PASSING.fullmatch(re.sub(rb"[\x00-\x04\x06-\x1a\x1c-\x1f\x7f]", b"", out)), out
    assert b"\x05" not in out
    if utf8:  # no C1 control, raw or encoded
        text = out.decode("utf-8", "surrogateescape")
        assert not re.search("[\x80-\x9f\udc80-\udc9f]", text), out
    else:
        assert not re.search(rb"[\x80-\x9f]", out), out
    # What passed passes again, unchanged: the terminal parses it as the filter did.
    assert run(out, utf8=utf8) == (out, {})
