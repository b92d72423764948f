"""Token ids -> text deltas: nothing shown is ever taken back, stop strings cut the text before
them, and a character split over tokens is held until it is whole."""

from starsd.star.textstream import TextStream


class ByteTokenizer:
    """Each id is one byte, decoded as UTF-8 the way a byte-level BPE tokenizer decodes a split
    character: as U+FFFD until its last byte arrives."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, text: str, chunk: int):
    """Give `text`'s bytes `chunk` at a time; the deltas and whether a stop string ended it."""
    data = list(text.encode())
    out = []
    for i in range(0, len(data), chunk):
        delta, stopped = stream.add(data[i:i + chunk])
        out.append(delta)
        if stopped:
            return out, True
    out.append(stream.flush())
    return out, False


def test_deltas_add_up_to_the_text_for_any_split():
    text = "héllo wörld, ünïcode ✓ and 日本語"
    for chunk in range(1, 6):
        deltas, stopped = feed(TextStream(ByteTokenizer()), text, chunk)
        assert "".join(deltas) == text and not stopped
        assert all("\ufffd" not in d for d in deltas)  # a split character is never shown half


def test_a_stop_string_ends_the_text_before_it_whatever_the_split():
    text = "def f():\n    return 1\n\nclass A:\n    pass\n"
    for chunk in range(1, 7):
        deltas, stopped = feed(TextStream(ByteTokenizer(), ("\nclass", "never")), text, chunk)
        assert stopped and "".join(deltas) == "def f():\n    return 1\n"


def test_text_that_may_begin_a_stop_string_is_held_then_released():
    s = TextStream(ByteTokenizer(), ("END",))
    assert s.add(list(b"abc E")) == ("abc ", False)  # "E" could begin "END"
    assert s.add(list(b"N")) == ("", False)  # "EN" still could
    assert s.add(list(b"x")) == ("ENx", False)  # it did not: released
    assert s.add(list(b" END tail")) == (" ", True)


def test_the_earliest_of_several_stop_strings_wins():
    s = TextStream(ByteTokenizer(), ("zz", "b"))
    assert s.add(list(b"aazzab")) == ("aa", True)
