"""What a confined command writes to its terminal, filtered before it reaches the caller's.

Sans-IO: `VtFilter.feed(bytes) -> bytes`, state kept between calls (a sequence may be split
across reads), `flush()` at the end. A parser in the shape of the DEC/ECMA-48 one that
terminals use (Paul Williams' state diagram: ground, escape, escape intermediate, CSI,
and the strings OSC, DCS, SOS, PM and APC; C1 controls in their 8-bit forms too) decides
for each sequence whether it only acts on the command's own screen. Those pass byte for
byte; everything else is dropped whole, and counted by kind (`dropped`, never the bytes).

What passes: text (UTF-8, validated), C0 controls but ENQ, SGR, cursor movement and
position, erase, insert and delete, scroll regions and scrolling, tab stops, charset
designations and shifts, save/restore cursor, cursor style, soft reset, and the DEC private
modes of DEC_MODES: application cursor keys and keypad, autowrap, origin mode, cursor
visibility and blinking, the alternate screen, bracketed paste, synchronized output, and
mouse and focus reports (they carry the user's own clicks to the command's own input, as
keystrokes do, and full-screen programs need them).

What is dropped (the kinds of `dropped`):
- clipboard: OSC 52, which writes (or reads back) the caller's clipboard, tmux's paste
  buffer included;
- title: OSC 0/1/2. The title belongs to the caller's window and outlives the run, a
  fake one is a lure ("sudo password:"), and terminals report it back as input;
- colour: OSC 4, 5, 10-19, 104-119 (palette and colour queries answer as typed input);
- osc: every other OSC (hyperlinks, cwd and notification protocols, iTerm2's file
  transfer);
- dcs: every DCS (DECRQSS, XTGETTCAP, DECUDK key definitions, tmux's passthrough, sixel);
- apc_pm_sos: APC (kitty's graphics protocol can make the terminal read a host file), PM,
  SOS;
- query: anything that makes the terminal answer on the command's input: DA1/DA2/DA3,
  DSR and CPR, DECRQM, DECREQTPARM, XTVERSION, DECRQCRA (a checksum of screen contents),
  DECID (ESC Z), ENQ (answerback) and the like;
- window: every CSI t (window moves, resizes and the title and size reports);
- csi, esc: other control sequences not on the lists (modes that change what the caller's
  keyboard sends, the character encoding (ESC %), 8-bit replies (ESC SP G), printing);
- c1: 8-bit C1 controls (0x80-0x9F, raw or UTF-8 encoded as U+0080-U+009F) and what they
  introduce: whether a terminal acts on them depends on its encoding, so none passes and
  only 7-bit forms reach the terminal;
- unterminated: a string longer than MAX_STRING_BYTES, a control sequence longer than
  MAX_CONTROL_BYTES, or one still open when the output ends: dropped, and what follows
  shows as text (the terminal never saw its start).

The terminal then always parses exactly what was let through: every sequence passed is
complete and leaves it in its ground state, and a UTF-8 character is passed whole or not at
all (a byte of no valid character is left out). With `utf8=False` (a caller's locale of
another encoding, where bytes 0x80-0x9F are C1 controls) no byte of 0x80-0x9F passes at all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Final

# A string (OSC, DCS...) longer than this is abandoned: tmux keeps no longer one either
# (INPUT_BUF_LIMIT, 1 MiB, in its input.c); a clipboard copy of a large file stays below.
MAX_STRING_BYTES: Final = 1024 * 1024
# A control sequence is held until its final byte: the longest real ones (SGR with colon
# sub-parameters, a scroll region, mode lists) are well under 100 bytes.
MAX_CONTROL_BYTES: Final = 1024
# Whole CSIs remembered with their fate: a screen redraw repeats a few dozen forms.
DECIDED_CACHE: Final = 512
_UNDECIDED: Final = "?"
# The first bytes of an OSC kept to tell its kind (the number before ';').
_OSC_HEAD: Final = 8

_GROUND: Final = 0
_ESCAPE: Final = 1
_ESC_INTER: Final = 2
_CSI: Final = 3
_STRING: Final = 4

_ESC: Final = 0x1B
_ENQ: Final = 0x05
_BEL: Final = 0x07
_CAN: Final = 0x18
_SUB: Final = 0x1A
_DEL: Final = 0x7F
_ST8: Final = 0x9C

# Text: ASCII but ENQ and ESC, or a whole, valid UTF-8 character other than U+0080-U+009F
# (RFC 3629's table: no overlong forms, no surrogates, nothing above U+10FFFF).
_UTF8_TEXT: Final = re.compile(
    rb"(?:[\x00-\x04\x06-\x1a\x1c-\x7f]|\xc2[\xa0-\xbf]|[\xc3-\xdf][\x80-\xbf]"
    rb"|\xe0[\xa0-\xbf][\x80-\xbf]|[\xe1-\xec\xee\xef][\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]"
    rb"|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3][\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2})+"
)
# The start of a valid UTF-8 character, cut off by the end of a read.
_UTF8_PREFIX: Final = re.compile(
    rb"[\xc2-\xdf]|\xe0[\xa0-\xbf]?|[\xe1-\xec\xee\xef][\x80-\xbf]?|\xed[\x80-\x9f]?"
    rb"|\xf0(?:[\x90-\xbf][\x80-\xbf]?)?|[\xf1-\xf3](?:[\x80-\xbf][\x80-\xbf]?)?"
    rb"|\xf4(?:[\x80-\x8f][\x80-\xbf]?)?"
)
# Text of an 8-bit encoding: everything but ENQ, ESC and the C1 controls.
_LATIN_TEXT: Final = re.compile(rb"[\x00-\x04\x06-\x1a\x1c-\x7f\xa0-\xff]+")

# What ends a string: BEL (an OSC only, as xterm has it), ESC (ST is ESC \), CAN, SUB;
# the 8-bit ST only where 8-bit controls are controls, or after an 8-bit opening (in UTF-8,
# 0x9C may be a byte of a character in the string).
_OSC_END_UTF8: Final = re.compile(rb"[\x07\x18\x1a\x1b]")
_STRING_END_UTF8: Final = re.compile(rb"[\x18\x1a\x1b]")
_OSC_END_8BIT: Final = re.compile(rb"[\x07\x18\x1a\x1b\x9c]")
_STRING_END_8BIT: Final = re.compile(rb"[\x18\x1a\x1b\x9c]")

# ESC followed by one of these opens a string, of this kind.
_STRINGS: Final = {ord("]"): "osc", ord("P"): "dcs", ord("X"): "sos", ord("^"): "pm"}
_STRINGS[ord("_")] = "apc"
# The same strings, opened by an 8-bit C1 control.
_C1_STRINGS: Final = {0x9D: "osc", 0x90: "dcs", 0x98: "sos", 0x9E: "pm", 0x9F: "apc"}
_CSI_8BIT: Final = 0x9B

# ESC + final byte that act on the screen: DECSC/DECRC (7, 8), DECBI/DECFI (6, 9), the
# keypad modes (=, >), RIS (c), IND, NEL, HTS, RI (D, E, H, M), SS2/SS3 (N, O), cursor to
# the lower left (F), locking shifts LS2, LS3, LS1R, LS2R, LS3R (n, o, ~, }, |).
_ESC_FINALS: Final = frozenset(b"6789=>cDEFHMNOno|}~")
# ESC + intermediate: charset designations G0-G3 (( ) * + - . /); DEC line sizes and the
# screen alignment pattern (# 3, 4, 5, 6, 8).
_ESC_CHARSETS: Final = frozenset(b"()*+-./")
_ESC_LINE_FINALS: Final = frozenset(b"34568")

# CSI finals without marker or intermediate that act on the screen: ICH, CUU, CUD, CUF,
# CUB, CNL, CPL, CHA, CUP, CHT, ED, EL, IL, DL, DCH, SU, ECH, CBT, HPA, HPR, REP, VPA,
# VPR, HVP, TBC, SGR, DECSTBM, SCOSC/DECSLRM (s). SD (T) and SCORC (u) are checked apart.
_CSI_FINALS: Final = frozenset(b"@ABCDEFGHIJKLMPSXZ`abdefgmrs")
# ANSI modes (SM/RM): insert mode only. LNM (20) would change what Enter sends after the
# run, SRM (12) turns local echo on, KAM (2) locks the keyboard.
ANSI_MODES: Final = frozenset({4})
# DEC private modes (DECSET/DECRST) that pass: DECCKM 1, DECSCNM 5, DECOM 6, DECAWM 7,
# X10 mouse 9, cursor blink 12, DECTCEM 25, alternate screen 47, DECNKM 66, DECLRMM 69,
# mouse reports 1000, 1002, 1003, focus reports 1004, mouse encodings 1005, 1006, 1015,
# 1016, alternate scroll 1007, alternate screen and saved cursor 1047, 1048, 1049,
# bracketed paste 2004, synchronized output 2026. Not DECCOLM (3: resizes the window),
# logging (46), key encodings (1035-1061) and the like.
DEC_MODES: Final = frozenset(
    {1, 5, 6, 7, 9, 12, 25, 47, 66, 69, 1000, 1002, 1003, 1004, 1005, 1006, 1007}
    | {1015, 1016, 1047, 1048, 1049, 2004, 2026}
)
_CSI_BODY: Final = re.compile(rb"([<=>?]?)([0-9:;]*)([ -/]*)")
# A whole 7-bit CSI in one read, with nothing inside it but its own bytes.
_WHOLE_CSI: Final = re.compile(rb"\x1b\[([<=>?]?[0-9:;]*[ -/]*)[@-~]")
# OSC numbers by kind (the rest is "osc").
_OSC_KINDS: Final = {
    b"52": "clipboard",
    **dict.fromkeys((b"0", b"1", b"2"), "title"),
    **{str(n).encode(): "colour" for n in (4, 5, *range(10, 20), *range(104, 120))},
}

KINDS: Final = (
    "clipboard",
    "title",
    "colour",
    "osc",
    "dcs",
    "apc_pm_sos",
    "query",
    "window",
    "csi",
    "esc",
    "c1",
    "unterminated",
)


class VtFilter:
    """Passes what acts on the command's own screen; see the module docstring."""

    def __init__(self, *, utf8: bool = True) -> None:
        self.utf8 = utf8
        self.dropped: dict[str, int] = {}
        self._text = _UTF8_TEXT if utf8 else _LATIN_TEXT
        # What ends a string, then an OSC: by what opened it (an 8-bit C1 or ESC) and encoding.
        self._ends_8bit = (_STRING_END_8BIT, _OSC_END_8BIT)
        self._ends_7bit = (_STRING_END_UTF8, _OSC_END_UTF8) if utf8 else self._ends_8bit
        self._ends = self._ends_7bit
        self._state = _GROUND
        self._seq = bytearray()  # the control sequence so far (ESC or CSI)
        self._c1 = False  # the sequence was opened by an 8-bit C1 control
        self._carry = b""  # the start of a UTF-8 character, cut by the end of a read
        self._kind = ""  # the open string's kind
        self._size = 0  # the open string's bytes so far
        self._head = bytearray()  # an open OSC's first bytes
        self._string_esc = False  # the last byte of the open string was ESC
        self._decided: dict[bytes, str | None] = {}  # whole CSIs seen, and their fate

    def feed(self, data: bytes) -> bytes:
        """What of `data` passes (it may end with a sequence still open: kept for later)."""
        if self._carry:
            data, self._carry = self._carry + data, b""
        out: list[bytes] = []
        at, end = 0, len(data)
        while at < end:
            if self._state == _GROUND:
                text = self._text.match(data, at)
                if text is not None:
                    out.append(text.group())
                    at = text.end()
                else:
                    at = self._ground(data, at, out)
            elif self._state == _STRING:
                at = self._in_string(data, at)
            else:
                at = self._in_sequence(data, at, out)
        return b"".join(out)

    def flush(self) -> bytes:
        """At the end of the output: a sequence still open is dropped, and so is the start
        of a character never completed (it could end in a byte of 0x80-0x9F)."""
        if self._state == _STRING:
            self._end_string()
            self._count("unterminated")
        elif self._state != _GROUND:
            self._count("unterminated")
            self._to_ground()
        self._carry = b""
        return b""

    # -- ground ---------------------------------------------------------------------------

    def _ground(self, data: bytes, at: int, out: list[bytes]) -> int:
        """One byte that is not text, at `at`; the offset after what it consumed."""
        byte = data[at]
        if byte == _ESC:
            return self._escape(data, at, out)
        if byte == _ENQ:  # the answerback message would be typed in
            self._count("query")
            return at + 1
        if not self.utf8:  # 0x80-0x9F: the only bytes left that the text pattern refuses
            self._c1_control(byte)
            return at + 1
        if byte == 0xC2 and at + 1 < len(data) and 0x80 <= data[at + 1] <= 0x9F:
            self._c1_control(data[at + 1])  # U+0080-U+009F: a C1 control, UTF-8 encoded
            return at + 2
        if len(data) - at <= 3 and _UTF8_PREFIX.fullmatch(data, at):
            self._carry = data[at:]  # the rest of the character comes with the next read
            return len(data)
        if byte <= 0x9F:
            self._c1_control(byte)
        # Else a byte of no valid character: left out (a UTF-8 terminal shows U+FFFD for
        # it; passed, a lone lead byte could join what passes next).
        return at + 1

    def _escape(self, data: bytes, at: int, out: list[bytes]) -> int:
        """ESC in the ground state: a whole CSI decided at once, else the sequence opened."""
        whole = _WHOLE_CSI.match(data, at)
        if whole is not None and whole.end() - at <= MAX_CONTROL_BYTES:
            # The common case at once (as the byte-wise path would decide it).
            seq = whole.group()
            kind = self._decided.get(seq, _UNDECIDED)
            if kind is _UNDECIDED:
                kind = _csi_kind(whole.group(1), seq[-1])
                if len(self._decided) >= DECIDED_CACHE:
                    self._decided.clear()
                self._decided[seq] = kind
            if kind is None:
                out.append(seq)
            else:
                self._count(kind)
            return whole.end()
        self._state, self._c1 = _ESCAPE, False
        self._seq[:] = b"\x1b"
        return at + 1

    def _c1_control(self, byte: int) -> None:
        if byte == _CSI_8BIT:
            self._state, self._c1 = _CSI, True
            self._seq.clear()
        elif byte in _C1_STRINGS:
            self._open_string(_C1_STRINGS[byte], c1=True)
        else:
            self._count("c1")

    # -- control sequences ----------------------------------------------------------------

    def _in_sequence(self, data: bytes, at: int, out: list[bytes]) -> int:
        byte = data[at]
        if byte < 0x20 or byte >= _DEL or len(self._seq) >= MAX_CONTROL_BYTES:
            return self._control_in_sequence(byte, at)
        if self._state == _CSI:
            self._seq.append(byte)
            if byte >= 0x40:
                self._end_csi(out)
        elif self._state == _ESCAPE and byte in _STRINGS:
            self._open_string(_STRINGS[byte])
        else:
            self._seq.append(byte)
            if self._state == _ESCAPE and byte == ord("["):
                self._state = _CSI
            elif byte < 0x30:
                self._state = _ESC_INTER
            else:
                self._end_esc(out)
        return at + 1

    def _control_in_sequence(self, byte: int, at: int) -> int:
        """A C0 control, DEL or a byte above 0x7F inside a sequence, or the sequence is
        too long: the offset to go on from."""
        if byte == _ESC:  # a new sequence begins; the open one is abandoned, as terminals do
            self._state, self._c1 = _ESCAPE, False
            self._seq[:] = b"\x1b"
        elif byte in (_CAN, _SUB):  # cancelled
            self._to_ground()
        elif byte > _DEL:  # no sequence holds one: abandoned, the byte is looked at afresh
            self._to_ground()
            return at
        elif len(self._seq) >= MAX_CONTROL_BYTES:
            self._count("unterminated")
            self._to_ground()
            return at
        elif byte == _ENQ:
            self._count("query")
        else:
            self._seq.append(byte)  # executed in place by the terminal (DEL: ignored)
        return at + 1

    def _end_esc(self, out: list[bytes]) -> None:
        shape = _shape(self._seq)  # the bytes after ESC, without the C0 controls among them
        kind = _esc_kind(shape[:-1], shape[-1])
        if kind is None:
            out.append(bytes(self._seq))
        else:
            self._count(kind)
        self._to_ground()

    def _end_csi(self, out: list[bytes]) -> None:
        body = _shape(self._seq)[0 if self._c1 else 1 :]  # after ESC [ (or 0x9B)
        kind = _csi_kind(body[:-1], body[-1])
        if kind is None and self._c1:
            kind = "c1"
        if kind is None:
            out.append(bytes(self._seq))
        else:
            self._count(kind)
        self._to_ground()

    def _to_ground(self) -> None:
        self._state, self._c1 = _GROUND, False
        self._seq.clear()

    # -- strings --------------------------------------------------------------------------

    def _open_string(self, kind: str, *, c1: bool = False) -> None:
        """A string begins; opened by an 8-bit C1 control, the 8-bit ST ends it too."""
        self._state, self._kind, self._size = _STRING, kind, 0
        self._ends = self._ends_8bit if c1 else self._ends_7bit
        self._head.clear()
        self._string_esc = False
        self._seq.clear()

    def _in_string(self, data: bytes, at: int) -> int:
        if self._string_esc:  # ESC \ is ST; ESC and anything else ends it and begins anew
            self._string_esc = False
            if self._kind == "dcs" and data[at] == _ESC:
                self._size += 1
                return at + 1  # tmux's passthrough doubles every ESC it carries: one string
            self._end_string()
            if data[at] == ord("\\"):
                return at + 1
            self._state = _ESCAPE
            self._seq[:] = b"\x1b"
            return at
        found = self._ends[self._kind == "osc"].search(data, at)
        stop = len(data) if found is None else found.start()
        if self._kind == "osc" and len(self._head) < _OSC_HEAD:
            self._head += data[at : min(stop, at + _OSC_HEAD - len(self._head))]
        self._size += stop - at
        if self._size > MAX_STRING_BYTES:
            self._end_string()
            self._count("unterminated")
            return stop - (self._size - MAX_STRING_BYTES)
        if found is None:
            return stop
        if data[stop] == _ESC:
            self._string_esc = True
        else:
            self._end_string()
        return stop + 1

    def _end_string(self) -> None:
        kind = self._kind
        if kind == "osc":
            kind = _OSC_KINDS.get(bytes(self._head).partition(b";")[0], "osc")
        elif kind != "dcs":
            kind = "apc_pm_sos"
        self._count(kind)
        self._state = _GROUND
        self._head.clear()

    def _count(self, kind: str) -> None:
        self.dropped[kind] = self.dropped.get(kind, 0) + 1


def _shape(seq: bytearray) -> bytes:
    """A sequence without ESC and the C0 controls (and DELs) it holds."""
    return bytes(b for b in seq if 0x20 <= b < _DEL)


def _esc_kind(intermediates: bytes, final: int) -> str | None:
    """None when ESC + `intermediates` + `final` passes, else its kind."""
    if not intermediates:
        if final in _ESC_FINALS:
            return None
        return "query" if final == ord("Z") else "esc"  # DECID: answered as DA1
    if intermediates[0] in _ESC_CHARSETS:
        return None
    if intermediates == b"#" and final in _ESC_LINE_FINALS:
        return None
    return "esc"  # ESC % (the encoding), ESC SP F/G (8-bit replies)...


def _csi_kind(body: bytes, final: int) -> str | None:
    """None when CSI + `body` + `final` passes, else its kind."""
    shape = _CSI_BODY.fullmatch(body)
    if shape is None:
        return "csi"  # malformed: terminals ignore it
    marker, params, inter = shape.groups()
    if _is_query(marker, inter, final):
        return "query"
    if final == ord("t"):
        return "window"
    return None if _csi_passes(marker, params, inter, final) else "csi"


def _is_query(marker: bytes, inter: bytes, final: int) -> bool:
    """Sequences a terminal answers on the command's input."""
    letter = chr(final)
    if not inter:
        if letter in "cn":  # DA1, DA2 (>), DA3 (=); DSR, CPR, DEC DSR (?)
            return True
        if letter == "x" and not marker:  # DECREQTPARM
            return True
        if marker == b">" and letter == "q":  # XTVERSION
            return True
        # Kitty's keyboard flags, XTSMGRAPHICS, XTQMODKEYS.
        return marker == b"?" and letter in "uSm"
    # DECRQM ($p), DECRQPSR ($w), DECRQTSR ($u), DECRQCRA (*y), XTREPORTSGR (#|).
    return (inter, letter) in {(b"$", "p"), (b"$", "w"), (b"$", "u"), (b"*", "y"), (b"#", "|")}


def _csi_passes(marker: bytes, params: bytes, inter: bytes, final: int) -> bool:
    if inter:
        # DECSCUSR (cursor style), DECSTR (soft reset).
        return not marker and (inter, final) in {(b" ", ord("q")), (b"!", ord("p"))}
    if final in b"hl" and marker in (b"", b"?"):
        return _modes(params, DEC_MODES if marker else ANSI_MODES)
    if marker:
        # DECSED, DECSEL; not xterm's key modifiers, kitty's keyboard protocol and the like.
        return marker == b"?" and final in b"JK"
    if final == ord("T"):
        return b";" not in params  # SD; with five parameters it is mouse highlight tracking
    if final == ord("u"):
        return not params  # SCORC; with parameters, kitty's keyboard protocol
    return final in _CSI_FINALS


def _modes(params: bytes, allowed: frozenset[int]) -> bool:
    words = params.split(b";")
    return all(word.isdigit() and int(word) in allowed for word in words)


def utf8_locale(env: Mapping[str, str] | None = None) -> bool:
    """Whether the caller's locale (LC_ALL, else LC_CTYPE, else LANG) is UTF-8. No locale
    (C, POSIX, unset) counts as UTF-8: Python and most tools write UTF-8 there, and modern
    terminals read it; a locale naming another encoding (or none, as `en_US` means
    ISO-8859-1 to glibc) does not."""
    source = os.environ if env is None else env
    name = source.get("LC_ALL") or source.get("LC_CTYPE") or source.get("LANG") or ""
    if name in ("", "C", "POSIX"):
        return True
    codeset = name.partition(".")[2].partition("@")[0]
    return codeset.lower().replace("-", "") == "utf8"
