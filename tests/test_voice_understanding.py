"""`understanding.settle`: the recognizer's other readings decide what is acted on unasked.

Transcripts here are what Whisper gave on the recognition set (bench/voice_recognition.py);
the device is the simulated firmware's tool list."""

import pytest

from backend.voice.recognition import Transcript
from backend.voice.understanding import AGREEMENT_FLOOR, DeviceWords, Understanding
from testkit.in_process import FirmwareDevice


@pytest.fixture(scope="module")
def words() -> DeviceWords:
    return DeviceWords.of(FirmwareDevice().tool_list(include_user_only=False))


def heard(text: str, *others: str, sure: bool = True, confidence: float = 0.9) -> Transcript:
    return Transcript(text, "whisper-tiny.en", "en", confidence, sure, alternatives=others)


def test_the_device_words_know_which_tools_change_it(words: DeviceWords) -> None:
    assert any("set_volume" in name for name in words.changing)
    assert not any("get_device_status" in name for name in words.changing)


def test_a_reading_that_asks_the_device_is_taken_but_asked_back(words: DeviceWords) -> None:
    settled = Understanding().settle(
        heard("Can you turn the sound out a bit?", "Can you turn the sound down a bit?"), words
    )
    assert settled.text == "Can you turn the sound down a bit?" and not settled.sure


def test_readings_that_agree_on_the_change_make_a_doubtful_reading_sure(
    words: DeviceWords,
) -> None:
    understanding = Understanding()
    doubtful = heard(
        "Set the volume to 70, please.",
        "set the volume to 70 please",
        "Set the volume to 70.",
        sure=False,
        confidence=AGREEMENT_FLOOR * 1.1,
    )
    assert understanding.settle(doubtful, words).sure
    # One reading that wants another value keeps the doubt.
    split = heard(
        "Set the volume to 70, please.",
        "Set the volume to 17, please.",
        sure=False,
        confidence=AGREEMENT_FLOOR * 1.1,
    )
    assert not understanding.settle(split, words).sure
    # Too low a score: agreement does not help.
    low = heard(
        "Set the volume to 70.", "set the volume to 70", sure=False, confidence=AGREEMENT_FLOOR / 2
    )
    assert not understanding.settle(low, words).sure


@pytest.mark.parametrize(
    ("text", "sure"),
    [
        ("Change the volume to 20, I'm.", False),  # "twenty five" half heard
        ("Change the volume to 20 times.", False),
        ("Set the volume to 30 percent please.", True),
        ("Set the volume to 30.", True),
    ],
)
def test_a_number_followed_by_stray_words_is_asked_back(
    words: DeviceWords, text: str, sure: bool
) -> None:
    assert Understanding().settle(heard(text, text.lower()), words).sure is sure


def test_transcripts_without_other_readings_are_left_alone(words: DeviceWords) -> None:
    unsure = Transcript("tăng âm lượng lên", "viet-asr", "vi", None, sure=False)
    assert Understanding().settle(unsure, words) is unsure
    assert Understanding().settle(heard(""), words).text == ""


def test_speech_that_asks_nothing_of_the_device_stays_as_heard(words: DeviceWords) -> None:
    settled = Understanding().settle(heard("Quelle heure est-il?", "Quel heure est il"), words)
    assert settled.text == "Quelle heure est-il?" and settled.sure


def test_a_reading_on_the_assistants_topic_is_preferred(words: DeviceWords) -> None:
    settled = Understanding().settle(
        heard("How do I get rid of black?", "How do I get rid of plaque?"), words
    )
    assert settled.text == "How do I get rid of plaque?"
    # A reading on the topic is kept even when another one is on it too.
    kept = heard("How do I get rid of plaque?", "How do I get rid of plaques?")
    assert Understanding().settle(kept, words).text == kept.text


def test_a_vietnamese_reading_without_tone_marks_reaches_the_router(words: DeviceWords) -> None:
    """viet-asr's commonest slip is a tone mark: "âm lương" for "âm lượng" (volume)."""
    slipped = Transcript(
        "tăng âm lương lên", "viet-asr", "vi", None, sure=False, alternatives=("tang am luong len",)
    )
    understanding = Understanding()
    assert not understanding.intents(slipped.text, words)
    settled = understanding.settle(slipped, words)
    assert settled.text == "tang am luong len" and not settled.sure
    assert understanding.intents(settled.text, words)


def shared(text: str, *others: tuple[str, float], confidence: float = 0.5) -> Transcript:
    """A doubtful transcript with the beam's share of each reading (text's is what is left)."""
    rest = 1.0 - sum(share for _, share in others)
    return Transcript(
        text,
        "whisper-tiny.en",
        "en",
        confidence,
        sure=False,
        alternatives=tuple(other for other, _ in others),
        shares=(rest, *(share for _, share in others)),
    )


def test_the_beams_share_that_agrees_decides(words: DeviceWords) -> None:
    understanding = Understanding()
    mostly = shared("louder please.", ("Louder, please.", 0.3), ("Lager please.", 0.05))
    assert understanding.agreement(mostly, words) == pytest.approx(0.95)
    assert understanding.settle(mostly, words).sure
    split = shared("Set the brightness to 80", ("Set the brightness to 30", 0.35))
    assert understanding.agreement(split, words) == pytest.approx(0.65)
    assert not understanding.settle(split, words).sure
    # Too low a score: agreement does not help.
    low = shared("louder please.", ("Louder, please.", 0.3), confidence=AGREEMENT_FLOOR / 2)
    assert not understanding.settle(low, words).sure


@pytest.mark.parametrize(
    "text",
    [
        "Screen brightness for the 5.",  # "forty five": a value after an article
        "Dark and light mode, light mode",  # two choices of one setting
        "Dark mode, light mode, light mode, light mode",  # a decoder going round
    ],
)
def test_a_text_that_shows_a_mishearing_is_asked_back_however_sure(
    words: DeviceWords, text: str
) -> None:
    assert not Understanding().settle(heard(text, text.lower(), confidence=0.95), words).sure


def test_the_reading_closest_to_what_the_assistant_knows_is_answered(words: DeviceWords) -> None:
    """Both readings are dental; the knowledge base knows bleeding gums, not leading ones."""
    settled = Understanding().settle(
        heard("Why do my gums lead when I brush?", "Why do my gums bleed when I brush?"), words
    )
    assert settled.text == "Why do my gums bleed when I brush?"
    # Speech off the topic stays as heard when no reading is closer.
    other = heard("Tell me a joke.", "Tell me a joke!")
    assert Understanding().settle(other, words).text == "Tell me a joke."
