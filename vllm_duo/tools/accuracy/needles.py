# SPDX-License-Identifier: Apache-2.0
"""The eval's needle-in-a-haystack prompts: several needle phrasings and haystack styles, in the model's chat template
or as plain text, with the needle where no streaming head can see it from the question.

One phrasing and one filler text would measure how the model copes with that one prompt; several keep a single
phrasing the model happens to fail (or a haystack that happens to echo the needle) from deciding the result."""
from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_duo.tools.accuracy import passkey


@dataclass(frozen=True)
class Needle:
    """A fact with a 5-digit key, the question that asks for it, and the answer's first words (put in the model's
    mouth, so that the next tokens must be the key)."""

    fact: str
    question: str
    answer: str


NEEDLES = {
    "passkey": Needle("The pass key is {key}. Remember it. {key} is the pass key.", "What is the pass key?",
                      "The pass key is"),
    "safe": Needle("The secret code that opens the safe is {key}.", "What is the secret code that opens the safe?",
                   "The secret code that opens the safe is"),
    "magic": Needle("Remember this: the magic number of the day is {key}.", "What is the magic number of the day?",
                    "The magic number of the day is"),
    "phone": Needle("Anna's new phone extension is {key}.", "What is Anna's new phone extension?",
                    "Anna's new phone extension is"),
    "ticket": Needle("The winning lottery ticket number is {key}.", "What is the winning lottery ticket number?",
                     "The winning lottery ticket number is"),
}
# The eval's phrasings: "passkey" is left out, since SmolLM2 often reads it as a physical key ("The pass key is a
# small wooden box"; eval-design-smollm2-cpu-2026-11-25.md).
DEFAULT_NEEDLES = ("safe", "magic", "phone", "ticket")

# Filler text from four parts drawn at random (12^4 sentences per style): varied, so that no token has an exact copy
# one period back for copy heads to latch onto, and without digits, so that the key is the only number in the prompt.
HAYSTACKS = {
    "story": passkey.STORY,
    "weather": (
        ("The wind", "A light rain", "The morning fog", "The afternoon sun", "A cold breeze", "The first snow",
         "A heavy cloud", "The evening mist", "A warm current", "The thunderstorm", "A gentle drizzle", "The frost"),
        ("drifted over", "settled on", "moved slowly across", "fell on", "swept through", "lingered above",
         "rolled toward", "covered", "passed over", "returned to", "faded over", "gathered above"),
        ("the northern valley", "the quiet harbour", "the pine forest", "the coastal road", "the wheat fields",
         "the old lighthouse", "the frozen lake", "the mountain pass", "the sleepy town", "the marshland",
         "the rocky shore", "the open plain"),
        ("as evening came", "before dawn", "for most of the day", "without warning", "late in the season",
         "as the farmers expected", "while the town slept", "after a calm week", "under a grey sky",
         "during the night", "for a few hours", "as the tide turned")),
    "office": (
        ("The committee", "Our manager", "The design team", "The new intern", "The finance office", "The board",
         "A senior engineer", "The sales group", "The legal adviser", "The project lead", "The support desk",
         "The director"),
        ("reviewed", "approved", "postponed", "discussed", "rejected", "summarized", "questioned", "revised",
         "presented", "signed off on", "circulated", "archived"),
        ("the budget proposal", "the quarterly report", "the hiring plan", "the client contract",
         "the travel policy", "the product roadmap", "the safety checklist", "the marketing brief",
         "the office move", "the training schedule", "the supplier list", "the customer survey"),
        ("before the deadline", "in the weekly meeting", "after a long debate", "without much comment",
         "with a few changes", "at the request of the board", "on a busy afternoon", "by email",
         "late on Friday", "with some hesitation", "in a short memo", "as agreed earlier")),
}

INTRO = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about it.")
ASK_FIRST = "There is an important piece of information hidden inside a lot of irrelevant text. {question} Find it."
TEMPLATES = ("plain", "chat")


@dataclass(frozen=True)
class NeedlePrompt:
    """One tokenized eval prompt, ending with the answer's first words; generation continues with the key."""

    input_ids: list[int]
    needle: range  # token positions of the needle
    question_start: int  # first token of the question
    key: str


def needle_prompt(tokenizer, context_len: int, rng: random.Random, depth: float, needle: Needle,
                  haystack: tuple[tuple[str, ...], ...], *, chat: bool, sink: int, recent: int,
                  ask_first: bool = False) -> NeedlePrompt:
    """A prompt of at most `context_len` tokens with a 5-digit key at `depth` of the places a streaming head with
    `sink` + `recent` cannot see from the question (0 = the first after the sink, 1 = the last before the window).

    `chat`: intro, haystack and question are the user's turn of the model's chat template and the answer's first
    words start the assistant's; plain: the same text on its own (question and answer on one line, as passkey.py).
    `ask_first`: the intro already asks the question, so the model can know what to keep while it reads.
    """
    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    key = str(rng.randint(10000, 99999))
    intro = ASK_FIRST.format(question=needle.question) if ask_first else INTRO
    if chat:
        marker = "\x00"
        turn = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                             add_generation_prompt=True)
        head, tail = turn.split(marker)
        head, tail = encode(head + intro), encode("\n\n" + needle.question + tail + needle.answer)
    else:
        head, tail = encode(intro), encode(" " + needle.question + " " + needle.answer)
    fact = encode(" " + needle.fact.format(key=key))
    budget = context_len - len(head) - len(fact) - len(tail) - len(encode(" " + key))  # room for the answer
    sentences = passkey.haystack_sentences(encode, rng, budget, haystack)
    question_start = len(head) + sum(map(len, sentences)) + len(fact)

    before, after = passkey.split_out_of_view(sentences, len(head), len(fact), question_start, depth, sink=sink,
                                              recent=recent, context_len=context_len, what="needle")
    needle_start = len(head) + len(before)
    return NeedlePrompt(input_ids=head + before + fact + after + tail,
                        needle=range(needle_start, needle_start + len(fact)), question_start=question_start, key=key)

