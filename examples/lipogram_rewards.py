"""The reward functions of configs/grpo_char_gpt.yaml: continue a sentence of the Python documentation in real
words, without the letter e (a lipogram). Each takes TRL's arguments (``prompts``, ``completions``,
``completion_ids`` and the prompts file's columns) and returns one reward per completion."""

import re

from pydoc_data.topics import topics

# Every word of the documentation the char GPT was trained on.
WORDS = frozenset(re.findall(r"[a-z]+", " ".join(topics.values()).lower()))


def no_e(completions, **kwargs):
    """1 when the completion has no e (nor E), else 0."""
    return [float("e" not in text.lower()) for text in completions]


def real_words(completions, **kwargs):
    """The words of the documentation the completion writes on its first line, a quarter for each up to four (its
    last word, which the length limit may cut, is not counted): text, not a few letters and white space."""
    rewards = []
    for text in completions:
        words = text.split("\n")[0].split()[:-1]
        known = sum(word.strip(".,;:()'\"").lower() in WORDS for word in words)
        rewards.append(min(known, 4) / 4)
    return rewards
