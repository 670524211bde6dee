"""The pocketsphinx worker process (the child side of `backend.voice.asr.PocketsphinxRecognizer`).

pocketsphinx holds the GIL while it decodes (measured: a thread decoding with the general LM
stalled the event loop 15 ms per frame and ~1 s at `end_utt`), so decoding runs in a separate
process. The parent sends pickled commands over a pipe; this process answers with results:

    ("grammar", key, phrases)   compile a grammar once; later streams name it by key
    ("open", sid, key)          start an utterance with grammar `key` (or None: LM only)
    ("feed", sid, pcm)          one frame of 16 kHz PCM16
    ("finish", sid)             end it: answers ("result", sid, text, engine, detail)
    ("cancel", sid)             drop it
    ("ping", token)             answers ("pong", token, open streams, decoders loaded)
    ("stop",)                   exit

Each utterance meets two decoders. The general language model (~90 MB each: a small bounded
pool) decodes while the user speaks; a stream that finds no LM decoder free keeps its audio and
catches up when one is released. The grammar decoder (its own small dictionary, ~6 MB) decodes
the whole utterance at `finish`, in one pass (~46 ms of CPU per second of speech): in one pass
the cepstral mean is the utterance's own. Streamed, it is a running mean carried over from
whatever the decoder heard before, so a decoder's first utterances and another speaker's
leftovers decoded differently (measured: 72 % of number commands right on a fresh decoder,
100 % in one pass).
"""

import os
import re
import tempfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

NUMBER_SLOT = "<number>"
_ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
_TENS = ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
NUMBER_WORDS: tuple[str, ...] = (
    *_ONES,
    *(f"{tens} {one}".strip() for tens in _TENS for one in ("", *_ONES[1:10])),
    "one hundred",
)
GRAMMAR_CONFIDENT = 0.56  # score of a whole grammar phrase that stands without the LM
LM_AGREEMENT = 0.5  # share of the grammar's content words the LM must have heard (more than)
MAX_GRAMMARS_PER_DECODER = 16
# A units word after a tens word ("thirty eight") that the decoder is unsure of and that is
# short is noise after "thirty": under a noise floor the grammar read 15 % of bare tens as
# "<tens> eight/two"; those words had a posterior of 0.15-0.78 and lasted 150-280 ms, while
# real units words scored 0.93-1.0 (one 0.53, lasting 530 ms).
UNSURE_UNITS_PROB = 0.8
UNSURE_UNITS_FRAMES = 30  # 10 ms feature frames


@dataclass(frozen=True, slots=True)
class Hyp:
    """A hypothesis of a decoder: its text and score."""

    text: str
    score: float
    complete: bool = True  # a whole phrase of the grammar (always true for the LM)


def words_of(text: str) -> list[str]:
    """Lowercase words of a text, without punctuation (the dictionary's spelling)."""
    return re.sub(r"[^a-z' ]+", " ", text.lower()).split()


_FUNCTION_WORDS = frozenset(
    words_of(
        "the a an is are am i my me to of do does did what how why when should can could it its "
        "please and in for this that with your you be get"
    )
)


def _agreement(grammar: str, lm: str) -> float:
    """The share of the grammar hypothesis's content words that the LM also heard."""
    expected = [w for w in words_of(grammar) if w not in _FUNCTION_WORDS] or words_of(grammar)
    heard = set(words_of(lm))
    return sum(word in heard for word in expected) / len(expected) if expected else 0.0


def grammar_confirmed(grammar: Hyp | None, lm: Hyp | None) -> bool:
    """Whether the grammar's phrase stands. A grammar forces speech onto its phrases, so a whole
    phrase needs a fair score (measured: right phrases score 0.59-0.89 on the device path,
    phrases forced onto other speech 0.50-0.53) or the free LM hearing most of its content
    words. Partial phrases never stand."""
    if grammar is None or not grammar.text or not grammar.complete:
        return False
    if grammar.score >= GRAMMAR_CONFIDENT:
        return True
    return lm is not None and _agreement(grammar.text, lm.text) > LM_AGREEMENT


def choose(grammar: Hyp | None, lm: Hyp | None) -> tuple[str, str]:
    """(text, engine): the grammar's phrase when the LM confirms it, else the LM's text."""
    if grammar is not None and grammar_confirmed(grammar, lm):
        return grammar.text, "pocketsphinx-grammar"
    return (lm.text if lm is not None else ""), "pocketsphinx-lm"


def phrase_pattern(phrases: list[list[str]]) -> re.Pattern[str]:
    """Matches a whole phrase of the grammar. The grammar search returns its best partial path
    when no phrase fits the audio ("show the" for "should I get my wisdom teeth removed")."""
    number = "(?:" + "|".join(NUMBER_WORDS) + ")"
    alternatives = sorted(
        {" ".join(number if w == NUMBER_SLOT else re.escape(w) for w in p) for p in phrases}
    )
    return re.compile("(?:" + "|".join(alternatives) + ")" if alternatives else "(?!)")


def jsgf(phrases: list[list[str]]) -> str:
    """A JSGF grammar accepting each phrase (word lists; NUMBER_SLOT stands for 0..100). The
    phrases are written as a prefix tree ("set the (volume | brightness) to <number>"): as a
    flat list of alternatives, 450 phrases cost 12 ms of CPU per frame instead of ~1 ms."""
    trie: dict[str, Any] = {}
    for phrase in phrases:
        node = trie
        for word in phrase:
            node = node.setdefault(word, {})
        node[_END] = {}
    body = _expression(trie) or "<VOID>"
    return f"#JSGF V1.0; grammar g; public <s> = {body}; {_NUMBER_RULES}"


# 0..100 in few states: every <number> in the grammar is a copy of this rule.
_NUMBER_RULES = (
    f"<number> = {' | '.join(_ONES[:1] + _ONES[10:])} | <digit> | <tens> [ <digit> ] | "
    f"one hundred; <digit> = {' | '.join(_ONES[1:10])}; <tens> = {' | '.join(_TENS)};"
)


_END = ""


def _expression(node: dict[str, Any]) -> str:
    """The JSGF of what may follow a prefix-tree node ("" when the phrase may only end)."""
    branches = []
    for word in sorted(key for key in node if key != _END):
        rest = _expression(node[word])
        branches.append(f"{word} {rest}" if rest else word)
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "( " + " | ".join(branches) + " )"
    return f"[ {body} ]" if _END in node else body


@dataclass(frozen=True, slots=True)
class Word:
    """One word of a decoder's segmentation."""

    text: str
    prob: float  # posterior
    frames: int  # duration in 10 ms feature frames


def without_unsure_units(text: str, words: list[Word]) -> str:
    """`text` without a trailing units word the decoder was unsure of (see UNSURE_UNITS_PROB)."""
    spoken = [w for w in words if not w.text.startswith("<")]  # <s>, </s>, <sil>
    if len(spoken) < 2 or spoken[-2].text not in _TENS or spoken[-1].text not in _ONES[1:10]:
        return text
    last = spoken[-1]
    if last.prob >= UNSURE_UNITS_PROB or last.frames >= UNSURE_UNITS_FRAMES:
        return text
    return text.rsplit(" ", 1)[0]


@dataclass
class _Stream:
    grammar_key: str | None
    audio: list[bytes] = field(default_factory=list)
    lm: Any = None
    lm_fed: int = 0  # frames of `audio` the LM decoder has seen
    finishing: bool = False
    grammar_hyp: Hyp | None = None


class Worker:
    """The worker's state: compiled grammars, open streams and the LM decoders they share."""

    def __init__(self, conn: Connection, lm_decoders: int) -> None:
        import pocketsphinx

        self.ps = pocketsphinx
        self.conn = conn
        self.lm_limit = lm_decoders
        self.lm_free: list[Any] = []
        self.lm_count = 0
        self.grammar_decoder: Any = None  # one: grammar decodes run one at a time, at finish
        self.grammars: dict[str, tuple[str, frozenset[str]]] = {}  # key -> (JSGF, its words)
        self.complete: dict[str, re.Pattern[str]] = {}  # key -> a whole phrase of the grammar
        self.loaded: dict[int, OrderedDict[str, None]] = {}  # id(decoder) -> grammar keys (LRU)
        self.streams: dict[int, _Stream] = {}
        self.waiting: list[int] = []  # streams without an LM decoder, oldest first
        self._dict_path = ""
        self._lexicon: Any = None  # the first LM decoder: its dictionary spells new words

    # ---- decoders ----------------------------------------------------------------------------

    def _new_lm(self) -> Any:
        self.lm_count += 1
        decoder = self.ps.Decoder(samprate=16000, loglevel="FATAL")
        self._lexicon = self._lexicon or decoder
        return decoder

    def _new_grammar_decoder(self) -> Any:
        lexicon = self._lexicon or self._take_lm_for_lexicon()
        if not self._dict_path:
            handle, self._dict_path = tempfile.mkstemp(prefix="asr-", suffix=".dict")
            with os.fdopen(handle, "w") as out:  # a dictionary needs one word; others are added
                out.write(f"zero {lexicon.lookup_word('zero')}\n")
        decoder = self.ps.Decoder(samprate=16000, loglevel="FATAL", lm=None, dict=self._dict_path)
        self.loaded[id(decoder)] = OrderedDict()
        return decoder

    def _take_lm_for_lexicon(self) -> Any:
        decoder = self._new_lm()
        self.lm_free.append(decoder)
        return decoder

    def _grammar(self) -> Any:
        if self.grammar_decoder is None:
            self.grammar_decoder = self._new_grammar_decoder()
        return self.grammar_decoder

    def _lm_decoder(self) -> Any | None:
        if self.lm_free:
            return self.lm_free.pop()
        if self.lm_count < self.lm_limit:
            return self._new_lm()
        return None

    def _activate(self, decoder: Any, key: str) -> None:
        keys = self.loaded[id(decoder)]
        if key not in keys:
            lexicon = self._lexicon or self._take_lm_for_lexicon()
            text, words = self.grammars[key]
            missing = sorted(word for word in words if decoder.lookup_word(word) is None)
            for position, word in enumerate(missing):  # the last one rebuilds the search
                decoder.add_word(word, lexicon.lookup_word(word), position == len(missing) - 1)
            decoder.add_jsgf_string(key, text)
            keys[key] = None
            if len(keys) > MAX_GRAMMARS_PER_DECODER:
                decoder.remove_search(keys.popitem(last=False)[0])
        keys.move_to_end(key)
        decoder.activate_search(key)

    # ---- commands ----------------------------------------------------------------------------

    def add_grammar(self, key: str, phrases: list[str]) -> None:
        """Compile a grammar of the phrases whose words the dictionary knows, under `key`."""
        lexicon = self._lexicon or self._take_lm_for_lexicon()
        known = []
        for phrase in phrases:
            words = phrase.split()
            if all(w == NUMBER_SLOT or lexicon.lookup_word(w) for w in words):
                known.append(words)
        vocabulary = {w for words in known for w in words if w != NUMBER_SLOT}
        vocabulary.update(w for number in NUMBER_WORDS for w in number.split())
        self.grammars[key] = (jsgf(known), frozenset(vocabulary))
        self.complete[key] = phrase_pattern(known)

    def open(self, sid: int, key: str | None) -> None:
        """Start stream `sid` with grammar `key` (an unknown key means LM only)."""
        stream = _Stream(key if key in self.grammars else None)
        self.streams[sid] = stream
        self.waiting.append(sid)
        self._assign_lm()

    def feed(self, sid: int, pcm: bytes) -> None:
        """Add one frame to stream `sid` and decode what a decoder can take; unknown ids are
        ignored."""
        stream = self.streams.get(sid)
        if stream is None:
            return
        stream.audio.append(pcm)
        self._catch_up(stream)

    def finish(self, sid: int) -> None:
        """End stream `sid` and send its result (an error detail for an unknown id)."""
        stream = self.streams.get(sid)
        if stream is None:
            self.conn.send(("result", sid, "", "pocketsphinx-lm", {"error": "unknown stream"}))
            return
        if stream.grammar_key is not None:
            stream.grammar_hyp = self._decode_grammar(stream.grammar_key, b"".join(stream.audio))
        stream.finishing = True
        if grammar_confirmed(stream.grammar_hyp, None):
            self._reply(sid, stream, None)  # the LM is not waited for
            self._drop(sid)
            return
        if stream.lm is not None and stream.grammar_hyp is not None:
            self._catch_up(stream)
            partial = stream.lm.hyp()  # the LM's forward pass so far: no end_utt needed
            lm_so_far = Hyp(partial.hypstr, partial.score) if partial is not None else None
            if grammar_confirmed(stream.grammar_hyp, lm_so_far):
                self._reply(sid, stream, lm_so_far)  # the LM's final pass is not waited for
                self._drop(sid)
                return
        self._complete_if_ready(sid)

    def _decode_grammar(self, key: str, pcm: bytes) -> Hyp | None:
        decoder = self._grammar()
        self._activate(decoder, key)
        decoder.start_utt()
        decoder.process_raw(pcm, False, True)  # full_utt: the utterance's own cepstral mean
        decoder.end_utt()
        hyp = decoder.hyp()
        if hyp is None:
            return None
        words = [Word(s.word, s.prob, s.end_frame - s.start_frame + 1) for s in decoder.seg()]
        text = without_unsure_units(hyp.hypstr, words)
        return Hyp(text, hyp.score, self.complete[key].fullmatch(text) is not None)

    def cancel(self, sid: int) -> None:
        """Drop stream `sid` without a result."""
        self._drop(sid)

    # ---- bookkeeping -------------------------------------------------------------------------

    def _drop(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if sid in self.waiting:
            self.waiting.remove(sid)
        if stream is not None and stream.lm is not None:
            stream.lm.end_utt()
            self.lm_free.append(stream.lm)
            stream.lm = None
            self._assign_lm()

    def _assign_lm(self) -> None:
        while self.waiting:
            decoder = self._lm_decoder()
            if decoder is None:
                return
            sid = self.waiting.pop(0)
            stream = self.streams[sid]
            stream.lm = decoder
            decoder.start_utt()
            self._catch_up(stream)
            if stream.finishing:
                self._complete_if_ready(sid)

    def _catch_up(self, stream: _Stream) -> None:
        if stream.lm is None:
            return
        while stream.lm_fed < len(stream.audio):
            stream.lm.process_raw(stream.audio[stream.lm_fed])
            stream.lm_fed += 1

    def _complete_if_ready(self, sid: int) -> None:
        stream = self.streams[sid]
        if stream.lm is None:
            return  # served by _assign_lm when an LM decoder is free
        self._catch_up(stream)
        stream.lm.end_utt()
        hyp = stream.lm.hyp()
        self.lm_free.append(stream.lm)
        stream.lm = None
        self._reply(sid, stream, Hyp(hyp.hypstr, hyp.score) if hyp is not None else None)
        self._drop(sid)

    def _reply(self, sid: int, stream: _Stream, lm: Hyp | None) -> None:
        text, engine = choose(stream.grammar_hyp, lm)
        detail = {
            "grammar": stream.grammar_hyp.text if stream.grammar_hyp else None,
            "grammar_score": round(stream.grammar_hyp.score, 3) if stream.grammar_hyp else None,
            "grammar_whole": stream.grammar_hyp.complete if stream.grammar_hyp else None,
            "lm": lm.text if lm else None,
        }
        self.conn.send(("result", sid, text, engine, detail))

    def serve(self) -> None:
        """Answer the parent's commands until the pipe closes."""
        handlers: dict[str, Callable[..., None]] = {
            "grammar": self.add_grammar,
            "open": self.open,
            "feed": self.feed,
            "finish": self.finish,
            "cancel": self.cancel,
        }
        while True:
            try:
                command = self.conn.recv()
            except (EOFError, OSError):
                return
            if command[0] == "stop":
                return
            if command[0] == "ping":
                loaded = (self.lm_count, int(self.grammar_decoder is not None))
                self.conn.send(("pong", command[1], len(self.streams), loaded))
                continue
            try:
                handlers[command[0]](*command[1:])
            except Exception as exc:  # one bad stream must not end the worker
                if command[0] in ("open", "feed", "finish", "cancel"):
                    self._abandon(command[1])
                    self.conn.send(("error", command[1], f"{type(exc).__name__}: {exc}"))

    def _abandon(self, sid: int) -> None:
        try:
            self.cancel(sid)
        except Exception:  # the decoders of a broken stream are lost, not reused
            self.streams.pop(sid, None)
            if sid in self.waiting:
                self.waiting.remove(sid)


def main(conn: Connection, lm_decoders: int) -> None:
    """The process entry point."""
    worker = Worker(conn, lm_decoders)
    try:
        worker.serve()
    finally:
        if worker._dict_path:
            os.unlink(worker._dict_path)
