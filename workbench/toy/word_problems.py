"""Arithmetic word problems in the GSM8K format (`question`, and an `answer` holding a worked
solution with `<<a*b=c>>` calculator notes and the final answer after `####`), generated from a
seeded RNG. The repo ships small sets made by this module (workbench/examples/data/
word_problems_{train,test}.jsonl: two steps each; one_step_{train,test}.jsonl: one addition or
subtraction of numbers below 10, easy enough that SmolLM2-135M's samples are sometimes right,
which GRPO needs: notebooks/recipes/real_model_grpo), so the data path and the math recipes run
without any download;
a real GSM8K file in the same format is a drop-in replacement (workbench.data.load_tasks(path,
fields="gsm8k")).

    python -m workbench.toy.word_problems            # rewrites the shipped files (same bytes)
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "examples" / "data"
SPLITS = {"train": (128, 0), "test": (32, 1)}  # split: (problems, seed)

NAMES = ["Ava", "Ben", "Chloe", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kira", "Liam", "Mia", "Noor"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "cards", "shells"]


def _buy_more(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 6), rng.randint(2, 9)
    total = a + b * c
    q = f"{name} has {a} {item}. {name} buys {b} packs with {c} {item} in each pack. How many {item} does {name} have now?"
    s = (f"The packs hold {b} * {c} = <<{b}*{c}={b * c}>>{b * c} {item}.\n"
         f"{name} has {a} + {b * c} = <<{a}+{b * c}={total}>>{total} {item} now.\n#### {total}")
    return q, s


def _share(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends, each, left = rng.randint(2, 5), rng.randint(2, 8), rng.randint(1, 9)
    start = friends * each + left
    q = (f"{name} had {start} {item} and gave {each} to each of {friends} friends. "
         f"How many {item} does {name} have left?")
    s = (f"{name} gave away {friends} * {each} = <<{friends}*{each}={friends * each}>>{friends * each} {item}.\n"
         f"{name} has {start} - {friends * each} = <<{start}-{friends * each}={left}>>{left} {item} left.\n#### {left}")
    return q, s


def _earn(rng):
    name = rng.choice(NAMES)
    rate, hours, spent = rng.randint(3, 12), rng.randint(2, 8), rng.randint(1, 9)
    earned = rate * hours
    q = (f"{name} earns ${rate} an hour and works {hours} hours. {name} then spends ${spent} on lunch. "
         f"How many dollars does {name} have left?")
    s = (f"{name} earns {rate} * {hours} = <<{rate}*{hours}={earned}>>{earned} dollars.\n"
         f"After lunch {name} has {earned} - {spent} = <<{earned}-{spent}={earned - spent}>>{earned - spent} dollars.\n"
         f"#### {earned - spent}")
    return q, s


def _split_evenly(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    boxes, per_box = rng.randint(2, 6), rng.randint(2, 9)
    extra = rng.randint(1, 5) * boxes
    total = boxes * per_box + extra
    q = (f"{name} has {total - extra} {item} and finds {extra} more, then puts them all into {boxes} boxes "
         f"equally. How many {item} go in each box?")
    s = (f"{name} has {total - extra} + {extra} = <<{total - extra}+{extra}={total}>>{total} {item}.\n"
         f"Each box gets {total} / {boxes} = <<{total}/{boxes}={total // boxes}>>{total // boxes} {item}.\n"
         f"#### {total // boxes}")
    return q, s


def _gets_more(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    q = f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"
    return q, f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item} now.\n#### {a + b}"


def _gives_away(rng):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    b, left = rng.randint(2, 9), rng.randint(1, 9)
    q = f"{name} has {b + left} {item} and gives {b} away. How many {item} does {name} have left?"
    return q, f"{name} has {b + left} - {b} = <<{b + left}-{b}={left}>>{left} {item} left.\n#### {left}"


KINDS = (_buy_more, _share, _earn, _split_evenly)
ONE_STEP_KINDS = (_gets_more, _gives_away)


def computation(record: dict) -> tuple[str, ...]:
    """A problem's arithmetic: its solution's calculator notes ("6+3=9"), whatever its names and items."""
    return tuple(re.findall(r"<<([^>]*)>>", record["answer"]))


def word_problems(n: int, seed: int = 0, kinds=KINDS, exclude: frozenset = frozenset()) -> list[dict]:
    """n GSM8K-format records ({"question", "answer"}), the same for the same seed everywhere;
    none whose computation is in `exclude` (a test set's: the training set's computations)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        record = dict(zip(("question", "answer"), rng.choice(kinds)(rng)))
        if computation(record) not in exclude:
            out.append(record)
    return out


def write_shipped(directory: Path = SHIPPED) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for prefix, kinds in (("word_problems", KINDS), ("one_step", ONE_STEP_KINDS)):
        # the test problems are none of the training ones (a name apart: "Mia has 6 pencils and gets 3
        # more" held out beside "Jonas has 6 pencils and gets 3 more" trained on; 11 of the 32 one-step)
        train = word_problems(*SPLITS["train"], kinds)
        n, seed = SPLITS["test"]
        for split, records in (("train", train), ("test", word_problems(n, seed, kinds, frozenset(map(computation, train))))):
            path = directory / f"{prefix}_{split}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
            out.append(path)
    return out


if __name__ == "__main__":
    for p in write_shipped():
        print(p)
