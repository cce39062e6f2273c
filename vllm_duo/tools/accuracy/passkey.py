# SPDX-License-Identifier: Apache-2.0
"""Synthetic passkey prompts: 5-digit keys hidden in varied filler text, placed where a streaming head cannot see them
from the question. One key per prompt for scoring and the eval, several named keys for gate training."""
from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np

from vllm_duo.pattern import PatternError

# The classic passkey test (Landmark Attention), as plain text without a chat template so the same prompt fits base
# and instruct models.
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.")
NEEDLE = "The pass key is {passkey}. Remember it. {passkey} is the pass key."
QUESTION = "What is the pass key? The pass key is"

# The haystack is drawn from these parts (12^4 sentences) rather than the classic "The grass is green. ..." repeated:
# repeated text gives every token an exact copy one period back, which copy (induction) heads latch onto and which is
# far from what the model was trained on. No part holds a digit, so the passkey is the only number in the prompt.
_SUBJECTS = ("The old fisherman", "A young teacher", "The baker", "My neighbour", "The small dog", "A tired traveller",
             "The farmer", "Her brother", "The children", "A quiet student", "The captain", "Our guide")
_VERBS = ("walked to", "looked at", "painted", "cleaned", "talked about", "found", "visited", "carried",
          "wrote about", "waited near", "forgot about", "dreamed of")
_OBJECTS = ("the red barn", "a wooden boat", "the village market", "the garden", "an old map", "the river bank",
            "a basket of apples", "the church tower", "the narrow bridge", "a letter from home", "the green hills",
            "the empty station")
_ENDINGS = ("in the morning", "after lunch", "before the rain", "on a windy day", "with great care",
            "without a word", "at sunset", "during the winter", "for a long time", "once again", "by the lake",
            "under the stars")


@dataclass(frozen=True)
class PasskeyPrompt:
    """One tokenized passkey prompt, teacher-forced: intro, haystack with the needle, question, answer."""

    input_ids: list[int]
    needle: range  # token positions of the needle sentence
    question_start: int  # first token of the question; the scored queries run from here to the end
    answer_start: int  # first token of the answer; generation starts here
    passkey: str


STORY = (_SUBJECTS, _VERBS, _OBJECTS, _ENDINGS)


def haystack_sentences(encode, rng: random.Random, budget: int, parts: tuple[tuple[str, ...], ...] = STORY,
                       period: int | None = None) -> list[list[int]]:
    """Varied haystack sentences drawn by `rng` from `parts`, each encoded, as many as fit in `budget` tokens; with
    `period`, a paragraph of that many sentences repeated (the classic test's kind of haystack)."""
    sentences, length = [], 0
    paragraph = [" ".join(rng.choice(part) for part in parts) + "." for _ in range(period or 0)]
    while True:
        text = paragraph[len(sentences) % period] if period else " ".join(rng.choice(part) for part in parts) + "."
        sentence = encode(" " + text)
        if length + len(sentence) > budget:
            return sentences
        sentences.append(sentence)
        length += len(sentence)


def split_out_of_view(sentences: list[list[int]], prefix_len: int, needle_len: int, question_start: int, depth: float,
                      *, sink: int, recent: int, context_len: int, what: str) -> tuple[list[int], list[int]]:
    """The haystack tokens (before, after) a needle of `needle_len` tokens placed at `depth` (0 = earliest, 1 = latest).

    The needle goes between two sentences, and only where a streaming head with `sink` + `recent` cannot see it from
    the question (at `question_start`): after the first `sink` tokens and more than `recent` tokens before the
    question. `depth` picks among those places; `prefix_len` tokens come before the first sentence.
    """
    starts = np.cumsum([prefix_len] + [len(sentence) for sentence in sentences])  # before sentence i, or at the end
    places = [i for i, start in enumerate(starts) if sink <= start and start + needle_len <= question_start - recent]
    if not places:
        raise PatternError(f"context length {context_len} leaves no place for a {what} outside sink {sink} + recent "
                           f"{recent} tokens: raise the context length or lower sink/recent")
    place = places[min(int(depth * len(places)), len(places) - 1)]
    return ([token for sentence in sentences[:place] for token in sentence],
            [token for sentence in sentences[place:] for token in sentence])


def passkey_prompt(tokenizer, context_len: int, rng: random.Random, depth: float, *, sink: int,
                   recent: int) -> PasskeyPrompt:
    """A prompt of at most `context_len` tokens with a 5-digit passkey at `depth` (0 = earliest, 1 = latest).

    The needle goes between two haystack sentences, and only where a streaming head with `sink` + `recent`
    cannot see it from any question or answer token: after the first `sink` tokens and more than `recent` tokens
    before the question. `depth` picks among those places.
    """
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    passkey = str(rng.randint(10000, 99999))
    intro, needle = encode(INTRO), encode(" " + NEEDLE.format(passkey=passkey))
    question, answer = encode(" " + QUESTION), encode(" " + passkey)
    budget = context_len - len(intro) - len(needle) - len(question) - len(answer)
    sentences = haystack_sentences(encode, rng, budget)
    haystack_len = sum(map(len, sentences))

    question_start = len(intro) + haystack_len + len(needle)
    before, after = split_out_of_view(sentences, len(intro), len(needle), question_start, depth, sink=sink,
                                      recent=recent, context_len=context_len, what="passkey")
    needle_start = len(intro) + len(before)
    return PasskeyPrompt(
        input_ids=intro + before + needle + after + question + answer,
        needle=range(needle_start, needle_start + len(needle)),
        question_start=question_start,
        answer_start=question_start + len(question),
        passkey=passkey,
    )


# The classic passkey test word for word, as the long-context literature runs it (Mohtashami and Jaggi's Landmark
# Attention prompt; DuoAttention's and LongLoRA's passkey figures): one key in a haystack of one repeated paragraph.
CLASSIC_INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
                 "memorize it. I will quiz you about it.\n")
CLASSIC_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
CLASSIC_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
CLASSIC_QUESTION = "\nWhat is the pass key? The pass key is"


def classic_passkey_text(repeats: int, depth: float, key: str) -> tuple[str, int]:
    """(prompt, needle's character offset): CLASSIC_FILLER `repeats` times, the needle after int(repeats x depth)
    of them. Unlike passkey_prompt, the needle may sit inside a streaming head's window (depth near 1, few repeats):
    this is the test as published."""
    before = CLASSIC_INTRO + CLASSIC_FILLER * int(repeats * depth)
    text = before + CLASSIC_NEEDLE.format(key=key) + CLASSIC_FILLER * (repeats - int(repeats * depth))
    return text + CLASSIC_QUESTION, len(before)


# The multi-key versions of NEEDLE and QUESTION: with several keys each needs a name.
ORDINAL_NEEDLE = "The {ordinal} pass key is {passkey}. Remember it. {passkey} is the {ordinal} pass key."
ORDINAL_QUESTION = "What is the {ordinal} pass key? The {ordinal} pass key is"
ORDINAL_ANSWER = "{passkey}."
ORDINALS = ("first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth", "tenth",
            "eleventh", "twelfth", "thirteenth", "fourteenth", "fifteenth", "sixteenth", "seventeenth",
            "eighteenth", "nineteenth", "twentieth")


@dataclass(frozen=True)
class PasskeySample:
    """One tokenized training prompt; `supervised` are the question and answer token positions the loss reads."""

    input_ids: list[int]
    supervised: list[int]
    passkeys: list[str]
    needle_starts: list[int]


def multi_passkey_prompt(tokenizer, context_len: int, rng: random.Random, num_passkeys: int, *, sink: int,
                         recent: int, period: int | None = None) -> PasskeySample:
    """`num_passkeys` 5-digit passkeys at random depths of a haystack (a paragraph of `period` sentences repeated,
    if given), then a question and answer for each.

    Like passkey_prompt, needles go between haystack sentences and only where a streaming head with
    `sink` + `recent` cannot see them from the questions: after the first `sink` tokens and more than `recent`
    tokens before the first question. So each supervised token needs the full-attention heads to be right.
    """
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    passkeys = [str(rng.randint(10000, 99999)) for _ in range(num_passkeys)]
    ordinals = ORDINALS[:num_passkeys]
    intro = encode(INTRO)
    needles = [encode(" " + ORDINAL_NEEDLE.format(ordinal=o, passkey=p)) for o, p in zip(ordinals, passkeys)]
    qa = [encode(" " + ORDINAL_QUESTION.format(ordinal=o)) + encode(" " + ORDINAL_ANSWER.format(passkey=p))
          for o, p in zip(ordinals, passkeys)]
    budget = context_len - len(intro) - sum(map(len, needles)) - sum(map(len, qa))
    sentences = haystack_sentences(encode, rng, budget, period=period)
    haystack_len = sum(map(len, sentences))

    # Token offset before sentence i counting intro and haystack only; a needle placed there moves by the needles
    # before it, and the last one must still end more than `recent` tokens before the first question.
    starts = np.cumsum([len(intro)] + [len(sentence) for sentence in sentences])
    question_start = len(intro) + haystack_len + sum(map(len, needles))
    last_end_limit = question_start - recent - sum(map(len, needles))
    places = [i for i, start in enumerate(starts) if sink <= start <= last_end_limit]
    if len(places) < num_passkeys:
        raise PatternError(
            f"context length {context_len} leaves {len(places)} places for {num_passkeys} passkeys outside sink "
            f"{sink} + recent {recent} tokens: raise the context length or lower --passkeys, --sink or --recent")
    chosen = sorted(rng.sample(places, num_passkeys))

    input_ids, needle_starts, previous = list(intro), [], 0
    for place, needle in zip(chosen, needles):
        input_ids += [token for sentence in sentences[previous:place] for token in sentence]
        needle_starts.append(len(input_ids))
        input_ids += needle
        previous = place
    input_ids += [token for sentence in sentences[previous:] for token in sentence]
    assert len(input_ids) == question_start
    for block in qa:
        input_ids += block
    return PasskeySample(input_ids=input_ids, supervised=list(range(question_start, len(input_ids))),
                         passkeys=passkeys, needle_starts=needle_starts)
