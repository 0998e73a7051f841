"""Write configs/data/pydoc_preferences.jsonl: preference pairs from the Python documentation that ships with
Python (the text ``configs/char_gpt.yaml`` trains on), for the DPO demo ``configs/dpo_char_gpt.yaml``.

Each pair takes a sentence start as the prompt, its true continuation as ``chosen`` and a corrupted copy of it
(two words swapped and one word's letters shuffled) as ``rejected``. Deterministic: the same file on every
Python whose ``pydoc_data.topics`` is the same.

    python tools/make_preference_data.py [OUT.jsonl] [--pairs N]
"""

import argparse
import json
import random
import re
from pathlib import Path

from pydoc_data.topics import topics

PROMPT_CHARS, COMPLETION_CHARS = 32, 20


def sentences() -> list[str]:
    """Plain one-line sentences of the documentation, long enough for a prompt and a completion."""
    text = "\n\n".join(topics[key] for key in sorted(topics))
    found = []
    # Section underlines (----, ****) run into the next heading's sentence: cut them out first.
    text = re.sub(r"[-=*~^]{3,}", " ", text)
    for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
        if len(sentence) >= PROMPT_CHARS + COMPLETION_CHARS and re.fullmatch(r"[A-Z][A-Za-z ,'-]*\.", sentence):
            found.append(sentence)
    return found


def corrupted(words: list[str], rng: random.Random) -> list[str]:
    """The words with two of them swapped and one's letters shuffled: fluent-looking, but not the text."""
    words = list(words)
    if len(words) >= 2:
        i, j = rng.sample(range(len(words)), 2)
        words[i], words[j] = words[j], words[i]
    k = max(range(len(words)), key=lambda index: len(words[index]))
    letters = list(words[k])
    rng.shuffle(letters)
    words[k] = "".join(letters)
    return words


def pairs(count: int, seed: int = 0) -> list[dict[str, str]]:
    """``count`` pairs from evenly spaced sentences of the documentation."""
    rng, pool = random.Random(seed), sentences()
    chosen_sentences = [pool[index * len(pool) // count] for index in range(count)]
    made = []
    for sentence in chosen_sentences:
        cut = sentence.rfind(" ", 0, PROMPT_CHARS) + 1 or PROMPT_CHARS
        prompt, rest = sentence[:cut], sentence[cut:]
        words = rest[:COMPLETION_CHARS + 10].split(" ")[:-1] or rest[:COMPLETION_CHARS].split(" ")
        chosen = " ".join(words)
        rejected = " ".join(corrupted(words, rng))
        if rejected == chosen:  # a one-word completion whose letters shuffled back into place
            rejected = chosen[::-1]
        made.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="configs/data/pydoc_preferences.jsonl")
    parser.add_argument("--pairs", type=int, default=400)
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(pair) + "\n" for pair in pairs(args.pairs)))
    print(f"wrote {args.pairs} pairs to {out}")


if __name__ == "__main__":
    main()
