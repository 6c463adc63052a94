"""RAG examples: the built-in synthetic set and a JSONL reader.

A built-in example is a set of fictional profiles (one chunk each, ~200 tokens) and a question
about one fact in one of them; the facts are invented, so the model can only answer from the
context. The set is generated from a fixed seed: every install has the same examples.

JSONL format, one object per line::

    {"id": str, "system": str, "chunks": [str, ...], "question": str, "answers": [str, ...]}
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from lmcache_backend.data.jsonl import read_jsonl

DEFAULT_SYSTEM = (
    "You are a helpful assistant. Answer the question using only the documents in the context. "
    "Answer with a few words."
)


@dataclass(frozen=True)
class RagExample:
    id: str
    system: str
    chunks: list[str]
    question: str
    answers: list[str]


class DatasetError(ValueError):
    """A dataset line is malformed; the message names the file, line and field."""


_FIRST = [
    "Marlow",
    "Ysolde",
    "Tobiah",
    "Quenna",
    "Dravin",
    "Elspeth",
    "Corwin",
    "Jessamy",
    "Orrin",
    "Thessaly",
    "Brannoc",
    "Liesl",
    "Peregrin",
    "Anwen",
    "Caspian",
    "Ottoline",
    "Fenwick",
    "Rosalind",
    "Idris",
    "Maelis",
    "Stellan",
    "Verity",
    "Alaric",
    "Wrenna",
]
_LAST = [
    "Ashgrove",
    "Pellham",
    "Quarrington",
    "Dunmore",
    "Hollis",
    "Varga",
    "Thornby",
    "Castellane",
    "Merriweather",
    "Oakhurst",
    "Blackwood",
    "Strand",
    "Fairleigh",
    "Kestrel",
    "Lowell",
    "Penrose",
]
_TOWNS = [
    "Brindlemoor",
    "Caskerville",
    "Dunhollow",
    "Elmsworth",
    "Fallowmere",
    "Glenridge",
    "Harrowgate",
    "Ivybridge",
    "Kettlewick",
    "Larkspur",
    "Marrowdale",
    "Northwold",
    "Oxbury",
    "Pennycross",
    "Quillhaven",
    "Ravensholm",
]
_JOBS = [
    "clockmaker",
    "beekeeper",
    "cartographer",
    "glassblower",
    "lighthouse keeper",
    "bookbinder",
    "violin maker",
    "botanist",
    "ferry captain",
    "stonemason",
    "perfumer",
    "astronomer",
]
_PETS = ["dog", "cat", "parrot", "tortoise", "rabbit", "goat", "ferret", "horse"]
_PET_NAMES = [
    "Biscuit",
    "Pepper",
    "Juniper",
    "Mochi",
    "Sprocket",
    "Waffles",
    "Tinder",
    "Clementine",
    "Nutmeg",
    "Pickle",
    "Bramble",
    "Sorrel",
    "Quince",
    "Figaro",
    "Domino",
    "Marzipan",
]
_COLORS = ["green", "crimson", "yellow", "violet", "orange", "teal", "silver", "indigo"]
_FOODS = [
    "plum dumplings",
    "lentil soup",
    "smoked trout",
    "apricot tart",
    "mushroom risotto",
    "barley bread",
    "pear cake",
    "onion pie",
]
_INSTRUMENTS = ["cello", "harp", "accordion", "flute", "banjo", "oboe", "piano", "drums"]
_FILLER = [
    "Neighbours describe the household as quiet and orderly.",
    "The family keeps a small garden with herbs and a few fruit trees.",
    "On weekends there are long walks along the river and visits to the market.",
    "Friends say the best conversations happen over tea in the late afternoon.",
    "The house has a blue door and a narrow staircase that creaks in winter.",
    "Letters from distant relatives arrive every few months and are kept in a wooden box.",
    "A shelf in the hallway holds old maps, postcards and a brass compass.",
    "In the summer the windows stay open and music can be heard from the street.",
]


def _profile(rng: random.Random, name: str) -> tuple[str, dict[str, tuple[str, str]]]:
    """One profile paragraph and its facts: ``fact -> (question, answer)``."""
    first = name.split()[0]
    town, job = rng.choice(_TOWNS), rng.choice(_JOBS)
    pet, pet_name = rng.choice(_PETS), rng.choice(_PET_NAMES)
    color, food, instrument = rng.choice(_COLORS), rng.choice(_FOODS), rng.choice(_INSTRUMENTS)
    year = rng.randint(1951, 1999)
    sibling = rng.choice(_FIRST)
    filler = rng.sample(_FILLER, 3)
    text = (
        f"Profile of {name}. {name} was born in {year} in the town of {town}. "
        f"{first} works as a {job} and has done so for many years. {filler[0]} "
        f"{first} has a {pet} named {pet_name}, who follows {first} everywhere. "
        f"The favourite colour of {first} is {color}, and the front gate is painted {color} too. "
        f"{filler[1]} Every Sunday {first} cooks {food} for the whole family. "
        f"{first} plays the {instrument} in a small local band. "
        f"{first} has a younger sibling called {sibling}, who visits twice a year. {filler[2]}"
    )
    facts = {
        "town": (f"In which town was {name} born?", town),
        "pet": (f"What is the name of the {pet} of {name}?", pet_name),
        "job": (f"What does {name} work as?", job),
        "instrument": (f"Which instrument does {name} play?", instrument),
        "food": (f"What does {name} cook every Sunday?", food),
        "sibling": (f"What is the name of the younger sibling of {name}?", sibling),
        "year": (f"In which year was {name} born?", str(year)),
    }
    return text, facts


def builtin_examples(
    count: int = 12, chunks_per_example: int | None = None, seed: int = 2024
) -> list[RagExample]:
    """``count`` synthetic examples (deterministic for a seed).

    Each has ``chunks_per_example`` profiles, or 3 to 6 (about 550 to 1,100 prompt tokens with
    SmolLM2's tokenizer) when None.
    """
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        n = chunks_per_example or rng.randint(3, 6)
        firsts, lasts = rng.sample(_FIRST, n), rng.sample(_LAST, n)
        profiles = [_profile(rng, f"{f} {s}") for f, s in zip(firsts, lasts)]
        target = rng.randrange(n)
        fact = rng.choice(sorted(profiles[target][1]))
        question, answer = profiles[target][1][fact]
        examples.append(
            RagExample(
                id=f"builtin-{i:02d}",
                system=DEFAULT_SYSTEM,
                chunks=[text for text, _ in profiles],
                question=question,
                answers=[answer],
            )
        )
    return examples


def _require(obj: dict, field: str, kind: type, where: str) -> object:
    if field not in obj:
        raise DatasetError(f"{where}: missing field {field!r}")
    value = obj[field]
    if not isinstance(value, kind):
        raise DatasetError(f"{where}: field {field!r} must be {kind.__name__}, got {value!r:.60}")
    return value


def _str_list(obj: dict, field: str, where: str) -> list[str]:
    values = _require(obj, field, list, where)
    if not values or not all(isinstance(v, str) for v in values):
        raise DatasetError(f"{where}: field {field!r} must be a non-empty list of strings")
    return list(values)


def load_examples(path: str | Path) -> list[RagExample]:
    """Read a JSONL dataset; blank lines are skipped.

    Raises:
        DatasetError: a line is not JSON or lacks/mistypes a field (names file, line, field).
    """
    examples = []
    for where, _, obj in read_jsonl(path, DatasetError):
        if not isinstance(obj, dict):
            raise DatasetError(f"{where}: expected a JSON object")
        examples.append(
            RagExample(
                id=str(_require(obj, "id", str, where)),
                system=str(_require(obj, "system", str, where)),
                chunks=_str_list(obj, "chunks", where),
                question=str(_require(obj, "question", str, where)),
                answers=_str_list(obj, "answers", where),
            )
        )
    if not examples:
        raise DatasetError(f"{path}: holds no examples")
    return examples


def reordered(chunks: list[str], seed: int = 0) -> list[str]:
    """The chunks rotated by ``1 + seed % (n - 1)`` places: never the original order for n > 1,
    and no chunk stays at its original position."""
    if len(chunks) < 2:
        return list(chunks)
    shift = 1 + seed % (len(chunks) - 1)
    return chunks[shift:] + chunks[:shift]
