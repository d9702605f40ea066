"""Incremental text never carries a broken character and stops exactly before a stop string."""

from scheduler.detokenizer import IncrementalDetokenizer
from tests.factories import tiny_tokenizer

TEXT = "héllo wörld 🙂 the quick brown fox"


def stream(text, stop=()):
    tok = tiny_tokenizer()
    ids = tok(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, tok("prompt:", add_special_tokens=False).input_ids, stop)
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    return detok, deltas


def test_deltas_join_to_the_text_and_never_split_a_character():
    detok, deltas = stream(TEXT)
    assert "".join(deltas) == TEXT == detok.text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # the emoji's first bytes produced no text until it was complete


def test_stop_string_cuts_the_text_and_is_never_emitted():
    detok, deltas = stream(TEXT, stop=("quick", "zzz"))
    assert detok.stopped and detok.text == "héllo wörld 🙂 the "
    assert "".join(deltas) == detok.text
    assert "q" not in "".join(deltas)


def test_no_stop_string_no_holdback():
    detok, deltas = stream("the fox", stop=())
    assert not detok.stopped and "".join(deltas[:-1]) == "the fox"


def test_the_fast_path_decodes_as_the_tokenizer_does():
    """A plain fast tokenizer is decoded through its backend directly: the same text for any ids,
    special tokens, broken characters and the embedded model's tokenizer included; any other goes
    through `decode`."""
    import random

    from scheduler.detokenizer import decoder
    from workers.catalog import DEFAULT_MODEL
    from workers.loader import load_tokenizer

    class Custom:
        def decode(self, ids, **kw):
            return f"custom {ids}"

    assert decoder(Custom())([1, 2]) == "custom [1, 2]"
    rng = random.Random(0)
    for tok in (tiny_tokenizer(), load_tokenizer(DEFAULT_MODEL).tokenizer):
        fast = decoder(tok)
        assert fast.func == tok.backend_tokenizer.decode  # the fast path was taken
        vocab = len(tok)
        for _ in range(200):
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
            assert fast(ids) == tok.decode(
                ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
            )


def test_the_streaming_path_emits_what_the_two_decodes_per_token_emit(monkeypatch):
    """For a plain fast tokenizer with a byte-level decoder each token costs one call into
    `tokenizers` (DecodeStream), not two decodes: the same deltas as the Python path for any ids
    (broken characters, special tokens, stop strings) and natural text, a prompt that ends inside a
    character included (the Python path runs until the first text, then the stream)."""
    import random

    from scheduler import detokenizer
    from workers.catalog import DEFAULT_MODEL
    from workers.loader import load_tokenizer

    def run(tok, prompt, output, stop):
        detok = IncrementalDetokenizer(tok, prompt, stop)
        deltas = [detok.push(t) for t in output] + [detok.flush()]
        return deltas, detok.text, detok.stopped, detok._step is not None

    rng = random.Random(1)
    for tok in (tiny_tokenizer(), load_tokenizer(DEFAULT_MODEL).tokenizer):
        vocab, natural = len(tok), tok(TEXT + " 日本語 " + TEXT, add_special_tokens=False).input_ids
        streamed = 0
        for trial in range(300):
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 8))]
            output = (
                natural
                if trial % 3 == 0
                else [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
            )
            stop = ("the", "ö") if trial % 5 == 0 else ()
            *fast, on_stream = run(tok, prompt, output, stop)
            with monkeypatch.context() as m:
                m.setattr(detokenizer, "_stream", lambda *args: None)
                *slow, _ = run(tok, prompt, output, stop)
            assert fast == slow
            streamed += on_stream
        assert streamed > 250  # the stream was in use by the end
