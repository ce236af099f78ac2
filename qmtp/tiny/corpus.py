"""A small synthetic English corpus, generated from templates, for training a toy model.

Every sentence here comes from templates and word lists written for qmtp; nothing is copied from
an existing dataset, so the text carries no licence of its own. The corpus is meant for a model
of hidden size ~64 trained for about an hour on two CPU cores: the vocabulary is a few hundred
words and the grammar is simple, so such a model can learn to produce text that reads as English.

Text comes in *registers* that differ in how predictable the next token is, so that a
Multi-Token-Prediction head can be measured per register:

* ``story``: short children's stories (a character, a place, a small plot, an ending).
* ``dialogue``: two speakers taking turns, ``"Anna: Where is the red ball?"``.
* ``list``: shopping lists, numbered steps, days of the week, months, counting, the alphabet.
  The most predictable register.
* ``arithmetic``: small sums, differences and times tables (``"3 + 4 = 7"``), always correct.
* ``facts``: simple true statements (``"A cow is an animal. A cow has four legs."``).

Determinism: documents come only from :class:`random.Random` instances seeded with integers
derived by SHA-256 from ``(stream, seed, index)``; no ``hash()`` of strings, no set or dict
iteration of unordered data. ``Random.choice``, ``randrange``, ``randint``, ``random`` and
``shuffle`` with integer seeds give the same sequence on every CPython since 3.2, so the same
seed gives byte-identical text across runs, machines and Python versions.

Document *i* of a stream depends only on ``(stream, seed, i)``: asking for more documents
extends the list without changing the ones before it.
"""

from __future__ import annotations

import functools
import hashlib
import random
from collections.abc import Callable, Iterator, Sequence

from ..errors import UsageError

__all__ = [
    "REGISTERS",
    "document",
    "generate",
    "iter_documents",
    "splits",
]

REGISTERS: tuple[str, ...] = ("story", "dialogue", "list", "arithmetic", "facts")

# Default split sizes. A document averages about 215 bytes (stories ~470, dialogues ~250, lists
# and facts ~130, arithmetic ~95), so 100 000 training documents are about 21.5 MB of text.
DEFAULT_N_TRAIN = 100_000
DEFAULT_N_HELDOUT = 2_000


# --------------------------------------------------------------------------------------------
# Small grammar helpers
# --------------------------------------------------------------------------------------------


def _a(word: str) -> str:
    """``word`` with its indefinite article ("an owl", "a fox"). Word lists avoid the exceptions."""
    return ("an " if word[0] in "aeiouAEIOU" else "a ") + word


def _cap(text: str) -> str:
    return text[0].upper() + text[1:]


def _join_and(items: Sequence[str]) -> str:
    """"a", "a and b", "a, b and c"."""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


_NUMBER_WORDS = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
    "nineteen", "twenty",
)
_ORDINALS = (
    "first", "second", "third", "fourth", "fifth", "sixth", "seventh", "eighth", "ninth",
    "tenth", "eleventh", "twelfth",
)

# --------------------------------------------------------------------------------------------
# Word lists
# --------------------------------------------------------------------------------------------

_GIRLS = (
    "Anna", "Lily", "Mia", "Emma", "Lucy", "Rose", "Sara", "Kate", "Nina", "Ella", "Amy",
    "Grace", "Ruby", "Zoe", "Molly", "Daisy", "Holly", "Jane", "Clara", "Alice",
)
_BOYS = (
    "Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Tim", "Dan", "Finn", "Oscar", "Hugo", "Noah",
    "Jake", "Paul", "Luke", "Ned", "Rex", "Bob", "Otto", "Milo",
)
# (subject, object, possessive, reflexive)
_SHE = ("she", "her", "her", "herself")
_HE = ("he", "him", "his", "himself")

_STORY_ANIMALS = (
    "fox", "rabbit", "bear", "cat", "dog", "mouse", "owl", "duck", "frog", "pig", "goat",
    "horse", "cow", "lion", "tiger", "elephant", "monkey", "squirrel", "hedgehog", "turtle",
    "deer", "wolf", "hen", "bird", "bee", "ant", "zebra", "giraffe", "penguin", "kitten",
    "puppy", "donkey", "badger", "beaver", "otter", "mole", "crab", "lamb", "pony", "snail",
)
_STORY_ADJECTIVES = (
    "little", "small", "big", "young", "old", "brave", "shy", "kind", "clever", "happy",
    "funny", "sleepy", "curious", "gentle", "busy", "quiet", "friendly", "tiny", "brown",
    "white", "grey", "fluffy", "proud", "lazy", "cheerful", "careful",
)
_HOMES = (
    "near the river", "in a small house", "in the big forest", "on a green hill", "by the sea",
    "in a quiet village", "under an old tree", "on a busy farm", "in a hole in the ground",
    "next to the lake", "in the tall grass", "at the edge of the woods", "in a little town",
    "behind the old mill", "in a warm nest", "near the mountains",
)
_FAMILY = (
    "mother", "father", "grandmother", "grandfather", "little brother", "little sister",
    "big brother", "big sister", "aunt", "uncle",
)
_HOBBIES = (
    "play in the garden", "sing songs", "read books", "run in the grass", "look at the stars",
    "swim in the river", "draw pictures", "pick flowers", "jump in puddles", "climb trees",
    "play with {poss} friends", "watch the birds", "build things", "dance in the sun",
    "help {poss} {family}", "collect shiny stones", "bake cakes", "play the drum",
)
_TIMES = (
    "One day", "One morning", "One sunny afternoon", "Early one morning", "One cold evening",
    "One warm summer day", "One windy day", "Later that day", "The next morning",
)
_PLACES = (
    "park", "market", "river", "beach", "forest", "farm", "lake", "hill", "garden", "school",
    "library", "bakery", "pond", "meadow", "playground", "zoo", "town", "field", "bridge",
    "village", "shop", "station",
)
_OBJECTS = (
    "ball", "hat", "kite", "book", "key", "shoe", "scarf", "cup", "spoon", "boat", "blanket",
    "bell", "drum", "basket", "map", "ring", "sock", "umbrella", "bag", "crayon", "teddy bear",
    "whistle", "coat", "box", "letter", "glove", "pencil", "car", "doll", "watch",
)
_COLORS = (
    "red", "blue", "green", "yellow", "orange", "purple", "pink", "black", "white", "brown",
    "grey", "gold",
)
_SEARCH_SPOTS = (
    "under the bed", "behind the door", "in the garden", "near the pond", "on the table",
    "under a big rock", "inside a box", "behind a tree", "in the tall grass",
    "next to the fence", "on the top shelf", "under the bridge", "in the kitchen",
    "by the river", "under the chair", "in a bush", "on the roof", "near the gate",
)
# (word, is_plural): plural nouns and mass nouns, so "some X", "the X" and "Do you like X?" work.
_FOODS = (
    ("apples", True), ("bread", False), ("cheese", False), ("carrots", True), ("honey", False),
    ("soup", False), ("cake", False), ("cookies", True), ("berries", True), ("rice", False),
    ("eggs", True), ("pears", True), ("grapes", True), ("nuts", True), ("corn", False),
    ("pie", False), ("jam", False), ("oranges", True), ("bananas", True), ("peas", True),
    ("potatoes", True), ("tomatoes", True), ("pasta", False), ("pizza", False),
    ("salad", False), ("plums", True), ("cherries", True), ("pancakes", True),
)
_DRINKS = ("juice", "milk", "tea", "lemonade", "water", "apple juice", "hot chocolate")
_WEATHER = ("sunny", "rainy", "windy", "cloudy", "snowy", "cold", "warm", "hot")
_BAD_WEATHER = ("rainy", "windy", "cold", "snowy", "hot")
_DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)
_MONTH_DAYS = (31, "28 or 29", 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
_SEASON_OF_MONTH = (
    "winter", "winter", "spring", "spring", "spring", "summer", "summer", "summer", "autumn",
    "autumn", "autumn", "winter",
)

# --------------------------------------------------------------------------------------------
# story
# --------------------------------------------------------------------------------------------


class _Character:
    __slots__ = ("name", "animal", "adj", "he", "him", "his", "himself")

    def __init__(self, rng: random.Random, avoid: Sequence[str] = ()) -> None:
        while True:
            if rng.random() < 0.5:
                name, pron = rng.choice(_GIRLS), _SHE
            else:
                name, pron = rng.choice(_BOYS), _HE
            if name not in avoid:
                break
        self.name = name
        self.animal = rng.choice(_STORY_ANIMALS)
        self.adj = rng.choice(_STORY_ADJECTIVES)
        self.he, self.him, self.his, self.himself = pron


def _story_opening(c: _Character, rng: random.Random) -> list[str]:
    home = rng.choice(_HOMES)
    kind = rng.randrange(4)
    if kind == 0:
        out = [f"Once upon a time, {_a(c.adj)} {c.animal} named {c.name} lived {home}."]
    elif kind == 1:
        out = [f"There was once {_a(c.adj)} {c.animal} called {c.name}.", f"{_cap(c.he)} lived {home}."]
    elif kind == 2:
        out = [
            f"{c.name} was {_a(c.adj)} {c.animal}.",
            f"{_cap(c.he)} lived {home} with {c.his} {rng.choice(_FAMILY)}.",
        ]
    else:
        out = [f"Long ago, {home}, there lived {_a(c.adj)} {c.animal} named {c.name}."]
    hobby = rng.choice(_HOBBIES).format(poss=c.his, family=rng.choice(_FAMILY))
    form = rng.randrange(3)
    if form == 0:
        out.append(f"{_cap(c.he)} liked to {hobby}.")
    elif form == 1:
        out.append(f"Every day, {c.he} loved to {hobby}.")
    else:
        out.append(f"More than anything, {c.name} liked to {hobby}.")
    return out


def _story_ending(c: _Character, f: _Character, rng: random.Random) -> str:
    return rng.choice((
        f"From that day on, {c.name} and {f.name} were best friends.",
        "It was a very happy day.",
        f"{c.name} never forgot that day.",
        f"That night, {c.name} slept well.",
        "The end.",
        f"{c.name} and {f.name} smiled all the way home.",
    ))


def _plot_lost(c: _Character, f: _Character, rng: random.Random) -> list[str]:
    obj = rng.choice(_OBJECTS)
    spots = list(_SEARCH_SPOTS)
    rng.shuffle(spots)
    out = [
        f"{rng.choice(_TIMES)}, {c.name} went to the {rng.choice(_PLACES)}.",
        f"There {c.he} met {_a(f.adj)} {f.animal} named {f.name}.",
        rng.choice((f"{f.name} looked very sad.", f"{f.name} was crying.")),
        rng.choice((f'"Why are you sad?" asked {c.name}.', f'"What is wrong?" asked {c.name}.')),
        f'"I lost my {rng.choice(_COLORS)} {obj}," said {f.name}.',
        rng.choice((
            f'"Do not worry. I will help you," said {c.name}.',
            f'"I will help you look for it," said {c.name}.',
        )),
        f"They looked {spots[0]}, but it was not there.",
    ]
    if rng.random() < 0.5:
        out.append(f"Then they looked {spots[1]}, but it was not there either.")
    out += [
        f"At last, {c.name} found the {obj} {spots[2]}!",
        f"{f.name} was very happy.",
        f'"Thank you, {c.name}!" {f.he} said.',
    ]
    return out


def _plot_share(c: _Character, f: _Character, rng: random.Random) -> list[str]:
    food, plural = rng.choice(_FOODS)
    it = "them" if plural else "it"
    was = "were" if plural else "was"
    return [
        f"{rng.choice(_TIMES)}, {c.name} found some {food} {rng.choice(_SEARCH_SPOTS)}.",
        f"{_cap(c.he)} was about to eat {it} when {c.he} saw {f.name} the {f.animal}.",
        f"{f.name} looked very hungry.",
        f'"Would you like some {food}?" asked {c.name}.',
        rng.choice((f'"Yes, please!" said {f.name}.', f'"Oh, thank you!" said {f.name}.')),
        f"So {c.name} shared the {food} with {f.name}.",
        f"They sat {rng.choice(('under a tree', 'by the river', 'on the grass', 'near the fire'))} and ate together.",
        f"The {food} {was} {rng.choice(('very good', 'very tasty', 'delicious'))}.",
        "Sharing made them both happy.",
    ]


def _plot_rain(c: _Character, f: _Character, rng: random.Random) -> list[str]:
    shelter = rng.choice(("a big tree", "an old barn", "a small cave", "a little house", "a bridge"))
    return [
        f"{rng.choice(_TIMES)}, {c.name} went for a walk to the {rng.choice(_PLACES)}.",
        "Suddenly, dark clouds filled the sky, and it began to rain.",
        rng.choice((f"{c.name} did not have an umbrella.", f"{c.name} got very wet.")),
        f"{_cap(c.he)} ran to {shelter} to stay dry.",
        f"There {c.he} found {f.name} the {f.animal}, who was hiding from the rain too.",
        f'"Come and sit with me," said {f.name}.',
        f"They sat together and {rng.choice(('told stories', 'sang songs', 'counted the raindrops', 'played a game'))} until the rain stopped.",
        "When the sun came out, they saw a big rainbow in the sky.",
    ]


_SKILLS = (
    "swim", "climb trees", "ride a bike", "read", "sing a song", "dance", "fly a kite",
    "whistle", "bake bread", "count to ten", "jump over the log", "catch a ball", "skip",
    "tie {poss} shoes", "write {poss} name",
)


def _plot_learn(c: _Character, f: _Character, rng: random.Random) -> list[str]:
    skill = rng.choice(_SKILLS).format(poss=c.his)
    return [
        f"{c.name} wanted to learn to {skill}.",
        "At first, it was very hard.",
        f"{_cap(c.he)} tried once, but it did not work.",
        f"{_cap(c.he)} felt {rng.choice(('sad', 'tired', 'angry'))} and wanted to stop.",
        f"Then {f.name} the {f.animal} came by.",
        f'"Do not give up," said {f.name}. "Try again!"',
        f"So {c.name} tried again, and again, and again.",
        f"At last, {c.name} could {skill}!",
        f"{_cap(c.he)} was very proud of {c.himself}.",
    ]


def _plot_party(c: _Character, f: _Character, rng: random.Random) -> list[str]:
    g = _Character(rng, avoid=(c.name, f.name))
    while True:
        food, _ = rng.choice(_FOODS)
        if food != "cake":
            break
    return [
        f"It was {c.name}'s birthday.",
        f"{_cap(c.he)} invited {f.name} the {f.animal} and {g.name} the {g.animal} to a party {rng.choice(('at ' + c.his + ' house', 'in the garden', 'in the park'))}.",
        f"{f.name} brought {_a(rng.choice(_COLORS))} {rng.choice(_OBJECTS)}.",
        f"{g.name} brought {_a(rng.choice(_COLORS))} {rng.choice(_OBJECTS)}.",
        f"They ate cake and {food} and drank {rng.choice(_DRINKS)}.",
        f"Then they played {rng.choice(('hide and seek', 'tag', 'with a ball', 'a game of cards', 'music games'))}.",
        f'{c.name} said, "This is the best birthday ever!"',
    ]


def _plot_build(c: _Character, f: _Character, rng: random.Random) -> list[str]:
    thing = rng.choice(("little house", "boat", "tall tower", "bridge", "tree house", "sand castle", "wall"))
    return [
        f"{c.name} wanted to build {_a(thing)}.",
        f"{_cap(c.he)} found some {rng.choice(('sticks', 'stones', 'boxes', 'blocks', 'leaves'))} {rng.choice(_SEARCH_SPOTS)}.",
        f"{_cap(c.he)} worked all morning, but the {thing} fell down.",
        f"{c.name} was very sad.",
        f'{f.name} the {f.animal} saw {c.him} and said, "Let me help you."',
        f"Together, they built the {thing} again.",
        "This time, it did not fall down.",
        f"It was a very good {thing}.",
    ]


_PLOTS = (_plot_lost, _plot_share, _plot_rain, _plot_learn, _plot_party, _plot_build)


def _story(rng: random.Random) -> str:
    c = _Character(rng)
    f = _Character(rng, avoid=(c.name,))
    sentences = _story_opening(c, rng)
    sentences += rng.choice(_PLOTS)(c, f, rng)
    sentences.append(_story_ending(c, f, rng))
    return " ".join(sentences)


# --------------------------------------------------------------------------------------------
# dialogue
# --------------------------------------------------------------------------------------------

_DOINGS = (
    "reading a book", "drawing a picture", "making a cake", "writing a letter",
    "cleaning my room", "waiting for the bus", "playing with my {obj}", "looking for my {obj}",
    "eating some {food}", "feeding the cat", "watering the flowers", "doing my homework",
)
_ANIMAL_PLURALS = (
    ("cat", "cats"), ("dog", "dogs"), ("fish", "fish"), ("bird", "birds"), ("rabbit", "rabbits"),
    ("hen", "hens"), ("duck", "ducks"), ("horse", "horses"), ("goat", "goats"),
    ("sheep", "sheep"), ("mouse", "mice"), ("frog", "frogs"),
)


_N_EXCHANGES = 16


def _exchange(rng: random.Random, other: str, used: list[int]) -> tuple[str, str]:
    """One question and its answer. ``other`` is the name of the person being asked.

    ``used`` lists the kinds of question already asked in this dialogue; the new one is of
    another kind (so nobody asks the same thing twice) and is appended to it.
    """
    k = rng.choice([i for i in range(_N_EXCHANGES) if i not in used])
    used.append(k)
    if k == 0:
        obj = rng.choice(_OBJECTS)
        q = f"Where is the {rng.choice(_COLORS)} {obj}?"
        a = rng.choice((
            f"It is {rng.choice(_SEARCH_SPOTS)}.",
            f"I think it is {rng.choice(_SEARCH_SPOTS)}.",
            "I do not know.",
        ))
    elif k == 1:
        food, _ = rng.choice(_FOODS)
        q = "What do you want to eat?"
        a = rng.choice((f"I want some {food}.", f"Some {food}, please."))
    elif k == 2:
        food, _ = rng.choice(_FOODS)
        q = f"Do you like {food}?"
        a = rng.choice((
            f"Yes, I like {food} very much.", f"No, I do not like {food}.", "Yes, I do.",
            "No, I do not.",
        ))
    elif k == 3:
        obj = rng.choice(_OBJECTS)
        q = f"What color is your {obj}?"
        a = f"My {obj} is {rng.choice(_COLORS)}."
    elif k == 4:
        q = rng.choice(("How are you today?", f"How are you, {other}?"))
        if rng.random() < 0.7:
            a = f"I am {rng.choice(('fine', 'very well', 'happy', 'good', 'great'))}, thank you."
        else:
            a = f"Not so good. I am {rng.choice(('sad', 'tired', 'hungry', 'sleepy', 'cold', 'bored'))}."
    elif k == 5:
        q = f"Can we go to the {rng.choice(_PLACES)}?"
        a = rng.choice((
            "Yes, we can go after lunch.", f"No, it is too {rng.choice(_BAD_WEATHER)} today.",
            "Not today. Maybe tomorrow.",
        ))
    elif k == 6:
        q = "What day is it today?"
        a = f"It is {rng.choice(_DAYS)}."
    elif k == 7:
        q = "What is the weather like?"
        a = f"It is {rng.choice(_WEATHER)} today."
    elif k == 8:
        q = "Where are you going?"
        a = f"I am going to the {rng.choice(_PLACES)}."
    elif k == 9:
        q = "What is your favorite animal?"
        sing, plural = rng.choice(_ANIMAL_PLURALS)
        a = rng.choice((f"My favorite animal is the {sing}.", f"I like {plural} best."))
    elif k == 10:
        sing, plural = rng.choice(_ANIMAL_PLURALS)
        q = f"How many {plural} do you have?"
        n = rng.randint(0, 6)
        if n == 0:
            a = f"I do not have any {plural}."
        elif n == 1:
            a = f"I have one {sing}."
        else:
            a = f"I have {_NUMBER_WORDS[n]} {plural}."
    elif k == 11:
        q = "What are you doing?"
        doing = rng.choice(_DOINGS).format(obj=rng.choice(_OBJECTS), food=rng.choice(_FOODS)[0])
        a = f"I am {doing}."
    elif k == 12:
        food, plural = rng.choice(_FOODS)
        q = f"Can I have some {food}?"
        a = rng.choice((
            "Yes, here you are.",
            f"Sorry, there {'are' if plural else 'is'} no more {food}.",
        ))
    elif k == 13:
        q = "What time is it?"
        a = f"It is {_NUMBER_WORDS[rng.randint(1, 12)]} o'clock."
    elif k == 14:
        obj = rng.choice(_OBJECTS)
        q = f"Can I play with your {obj}?"
        a = rng.choice(("Yes, you can.", f"Yes, but be careful with my {obj}.", "No, I am playing with it now."))
    else:
        q = "Where do you live?"
        a = f"I live {rng.choice(_HOMES)}."
    return q, a


def _dialogue(rng: random.Random) -> str:
    names = list(_GIRLS + _BOYS)
    first = rng.choice(names)
    while True:
        second = rng.choice(names)
        if second != first:
            break
    speakers = (first, second)
    n_questions = rng.randint(2, 6)
    greet = rng.random() < 0.5
    lines: list[str] = []
    pending: str | None = None  # the answer the current speaker owes
    asked = 0
    used: list[int] = []
    turn = 0
    while asked < n_questions or pending is not None:
        me, you = speakers[turn % 2], speakers[(turn + 1) % 2]
        parts: list[str] = []
        if greet and turn == 0:
            parts.append(rng.choice((f"Hello, {you}!", f"Hi, {you}!", f"Good morning, {you}!")))
        elif greet and turn == 1:
            parts.append(rng.choice((f"Hello, {you}.", f"Hi, {you}.", f"Oh, hello, {you}.")))
        if pending is not None:
            parts.append(pending)
            pending = None
        # A turn that answers may also ask; a turn that has nothing to answer always asks.
        if asked < n_questions and (not parts or rng.random() < 0.6):
            question, pending = _exchange(rng, you, used)
            parts.append(question)
            asked += 1
        lines.append(f"{me}: {' '.join(parts)}")
        turn += 1
    if rng.random() < 0.4:
        me, you = speakers[turn % 2], speakers[(turn + 1) % 2]
        lines.append(f"{me}: {rng.choice(('Goodbye', 'Bye', 'See you later'))}, {you}.")
        lines.append(f"{you}: {rng.choice(('Goodbye', 'Bye', 'See you tomorrow'))}, {me}.")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# list
# --------------------------------------------------------------------------------------------

_GROCERIES = (
    "milk", "eggs", "bread", "butter", "cheese", "apples", "rice", "flour", "sugar", "salt",
    "tea", "coffee", "jam", "soap", "carrots", "onions", "potatoes", "tomatoes", "bananas",
    "oranges", "yogurt", "fish", "chicken", "pasta", "beans", "juice", "honey", "lemons",
    "grapes", "peas", "oil", "pepper", "cereal", "lettuce",
)
_PACKING = {
    "the beach": ("a towel", "a hat", "sun cream", "a swimsuit", "a bucket", "a spade",
                  "a bottle of water", "a book", "sunglasses", "a ball"),
    "a trip to the mountains": ("warm socks", "a coat", "boots", "a map", "a torch",
                                "a bottle of water", "a hat", "gloves", "a blanket", "some food"),
    "school": ("a pencil", "a pen", "a ruler", "a book", "a lunch box", "a bottle of water",
               "a coat", "crayons", "a notebook", "an eraser"),
    "a picnic": ("a blanket", "sandwiches", "apples", "juice", "cups", "plates", "a ball",
                 "a cake", "napkins", "a basket"),
}
_PACKING_KEYS = ("the beach", "a trip to the mountains", "school", "a picnic")
_CHORES = (
    "make the bed", "feed the cat", "water the plants", "wash the dishes", "sweep the floor",
    "buy some bread", "call grandmother", "clean the windows", "walk the dog",
    "take out the rubbish", "read a chapter of my book", "fold the clothes", "tidy my desk",
    "write a letter",
)
_SANDWICH_FILLINGS = ("cheese", "ham", "jam", "egg", "tomato", "honey", "chicken")


def _steps_sandwich(rng: random.Random) -> tuple[str, list[str]]:
    filling = rng.choice(_SANDWICH_FILLINGS)
    return "How to make a sandwich:", [
        "Take two slices of bread.",
        "Spread butter on the bread.",
        f"Put some {filling} on one slice.",
        "Put the other slice on top.",
        "Cut the sandwich in half.",
        "Eat and enjoy!",
    ]


def _steps_seed(rng: random.Random) -> tuple[str, list[str]]:
    plant = rng.choice(("a bean", "a sunflower", "a tomato", "a pea", "a pumpkin"))
    return f"How to plant {plant} seed:", [
        "Fill a small pot with soil.",
        "Make a hole with your finger.",
        "Put the seed in the hole.",
        "Cover the seed with soil.",
        "Water the soil a little.",
        "Put the pot in a sunny place.",
        "Wait for the plant to grow.",
    ]


def _steps_tea(rng: random.Random) -> tuple[str, list[str]]:
    extra = rng.choice(("milk", "honey", "lemon", "sugar"))
    return "How to make a cup of tea:", [
        "Boil some water.",
        "Put a tea bag in a cup.",
        "Pour the hot water into the cup.",
        "Wait for three minutes.",
        "Take out the tea bag.",
        f"Add some {extra} if you like.",
    ]


def _steps_hands(rng: random.Random) -> tuple[str, list[str]]:
    return "How to wash your hands:", [
        "Turn on the tap.",
        "Make your hands wet.",
        "Put some soap on your hands.",
        "Rub your hands together for twenty seconds.",
        "Rinse off the soap.",
        "Turn off the tap.",
        "Dry your hands with a towel.",
    ]


def _steps_teeth(rng: random.Random) -> tuple[str, list[str]]:
    return "How to brush your teeth:", [
        "Put some toothpaste on your brush.",
        "Brush your top teeth.",
        "Brush your bottom teeth.",
        "Brush for two minutes.",
        "Spit out the toothpaste.",
        "Rinse your mouth with water.",
    ]


def _steps_school(rng: random.Random) -> tuple[str, list[str]]:
    breakfast = rng.choice(("some toast", "an egg", "a bowl of cereal", "some porridge", "a banana"))
    return "How to get ready for school:", [
        "Wake up and get out of bed.",
        "Wash your face.",
        "Put on your clothes.",
        f"Eat {breakfast} for breakfast.",
        "Brush your teeth.",
        "Pack your school bag.",
        "Put on your shoes and coat.",
    ]


def _steps_cookies(rng: random.Random) -> tuple[str, list[str]]:
    extra = rng.choice(("chocolate chips", "raisins", "nuts", "oats"))
    return "How to bake cookies:", [
        "Mix butter and sugar in a bowl.",
        "Add an egg and stir.",
        "Add flour and mix well.",
        f"Add some {extra}.",
        "Make small balls of dough.",
        "Put them on a tray.",
        "Bake them for ten minutes.",
        "Let them cool before you eat them.",
    ]


_STEPS = (
    _steps_sandwich, _steps_seed, _steps_tea, _steps_hands, _steps_teeth, _steps_school,
    _steps_cookies,
)

_WEEK_ACTIVITIES = (
    "goes swimming", "reads a book", "visits {poss} grandmother", "plays football",
    "bakes bread", "goes to the market", "cleans the house", "paints a picture",
    "rests at home", "plays the piano", "goes to the library", "helps in the garden",
    "rides {poss} bike", "goes to the park", "writes a letter", "has a music lesson",
)

_ALPHABET = (
    ("A", ("apple", "ant")), ("B", ("ball", "bear")), ("C", ("cat", "cake")),
    ("D", ("dog", "duck")), ("E", ("egg", "elephant")), ("F", ("fish", "frog")),
    ("G", ("goat", "grapes")), ("H", ("hat", "horse")), ("I", ("ice cream", "insect")),
    ("J", ("jam", "jug")), ("K", ("kite", "king")), ("L", ("lion", "lemon")),
    ("M", ("moon", "mouse")), ("N", ("nest", "nose")), ("O", ("owl", "orange")),
    ("P", ("pig", "pen")), ("Q", ("queen", "quilt")), ("R", ("rabbit", "rain")),
    ("S", ("sun", "sock")), ("T", ("tree", "tiger")), ("U", ("umbrella", "uncle")),
    ("V", ("van", "violin")), ("W", ("water", "wolf")), ("X", ("x-ray", "xylophone")),
    ("Y", ("yak", "yo-yo")), ("Z", ("zebra", "zoo")),
)


def _list(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind == 0:  # shopping list
        items = list(_GROCERIES)
        rng.shuffle(items)
        items = items[: rng.randint(3, 9)]
        header = rng.choice((
            "Shopping list:", "Things to buy:", "To buy at the market:",
            f"{rng.choice(_GIRLS + _BOYS)}'s shopping list:",
        ))
        if rng.random() < 0.5:
            body = [f"- {item}" for item in items]
        else:
            body = [f"{i}. {item}" for i, item in enumerate(items, 1)]
        return "\n".join([header] + body)
    if kind in (1, 2):  # numbered steps
        title, steps = rng.choice(_STEPS)(rng)
        return "\n".join([title] + [f"{i}. {s}" for i, s in enumerate(steps, 1)])
    if kind == 3:  # days of the week
        form = rng.randrange(4)
        if form == 0:
            return f"The days of the week are {_join_and(_DAYS)}."
        if form == 1:
            return "\n".join(["Days of the week:"] + [f"{i}. {d}" for i, d in enumerate(_DAYS, 1)])
        if form == 2:
            start = rng.randrange(7)
            n = rng.randint(3, 7)
            return " ".join(
                f"After {_DAYS[(start + i) % 7]} comes {_DAYS[(start + i + 1) % 7]}." for i in range(n)
            )
        name, pron = (rng.choice(_GIRLS), _SHE) if rng.random() < 0.5 else (rng.choice(_BOYS), _HE)
        acts = list(_WEEK_ACTIVITIES)
        rng.shuffle(acts)
        lines = [f"{name}'s week:"]
        for i, day in enumerate(_DAYS):
            lines.append(f"On {day}, {name} {acts[i].format(poss=pron[2])}.")
        return "\n".join(lines)
    if kind == 4:  # months
        form = rng.randrange(4)
        if form == 0:
            return f"The months of the year are {_join_and(_MONTHS)}."
        if form == 1:
            return "\n".join(["Months of the year:"] + [f"{i}. {m}" for i, m in enumerate(_MONTHS, 1)])
        start = rng.randrange(12)
        n = rng.randint(3, 7)
        idx = [(start + i) % 12 for i in range(n)]
        if form == 2:
            return " ".join(f"{_MONTHS[i]} is the {_ORDINALS[i]} month of the year." for i in idx)
        return " ".join(
            f"{_MONTHS[i]} has {_MONTH_DAYS[i]} days and is in {_SEASON_OF_MONTH[i]}." for i in idx
        )
    if kind == 5:  # counting
        form = rng.randrange(3)
        if form == 0:
            end = rng.randint(5, 20)
            return f"Let us count to {_NUMBER_WORDS[end]}: " + ", ".join(_NUMBER_WORDS[1 : end + 1]) + "."
        if form == 1:
            start = rng.randint(1, 50)
            end = start + rng.randint(4, 14)
            numbers = [str(i) for i in range(start, end + 1)]
            return f"The numbers from {start} to {end} are {_join_and(numbers)}."
        step = rng.choice((2, 3, 5, 10))
        n = rng.randint(5, 10)
        return f"Counting in {step}s: " + ", ".join(str(step * i) for i in range(1, n + 1))
    if kind == 6:  # packing list
        where = rng.choice(_PACKING_KEYS)
        items = list(_PACKING[where])
        rng.shuffle(items)
        items = items[: rng.randint(3, 7)]
        return "\n".join([f"Things to take to {where}:"] + [f"- {it}" for it in items])
    if kind == 7:  # to-do list
        chores = list(_CHORES)
        rng.shuffle(chores)
        chores = chores[: rng.randint(3, 7)]
        header = rng.choice(("Things to do today:", "To do:", f"Things to do on {rng.choice(_DAYS)}:"))
        return "\n".join([header] + [f"{i}. {_cap(c)}" for i, c in enumerate(chores, 1)])
    if kind == 8:  # alphabet
        start = rng.randrange(20)
        n = rng.randint(4, 26 - start)
        return " ".join(
            f"{letter} is for {rng.choice(words)}." for letter, words in _ALPHABET[start : start + n]
        )
    # colors / seasons
    if rng.random() < 0.5:
        colors = list(_COLORS[:8])
        rng.shuffle(colors)
        return "Colors: " + ", ".join(colors[: rng.randint(3, 8)]) + "."
    return "The four seasons are spring, summer, autumn and winter."


# --------------------------------------------------------------------------------------------
# arithmetic
# --------------------------------------------------------------------------------------------


def _arith_line(rng: random.Random) -> str:
    if rng.random() < 0.5:
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        return f"{a} + {b} = {a + b}"
    a = rng.randint(0, 20)
    b = rng.randint(0, a)
    return f"{a} - {b} = {a - b}"


def _arith_word_line(rng: random.Random) -> str:
    k = rng.randrange(3)
    if k == 0:
        a = rng.randint(0, 10)
        b = rng.randint(0, 10)
        return f"{_cap(_NUMBER_WORDS[a])} plus {_NUMBER_WORDS[b]} is {_NUMBER_WORDS[a + b]}."
    if k == 1:
        a = rng.randint(0, 20)
        b = rng.randint(0, a)
        return f"{_cap(_NUMBER_WORDS[a])} minus {_NUMBER_WORDS[b]} is {_NUMBER_WORDS[a - b]}."
    a = rng.randint(1, 5)
    b = rng.randint(0, 20 // a)
    return f"{_cap(_NUMBER_WORDS[a])} times {_NUMBER_WORDS[b]} is {_NUMBER_WORDS[a * b]}."


def _arithmetic(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind <= 1:  # mixed sums and differences
        return "\n".join(_arith_line(rng) for _ in range(rng.randint(4, 10)))
    if kind == 2:  # times table
        t = rng.randint(2, 10)
        lines = [f"The {t} times table:"] + [f"{t} x {i} = {t * i}" for i in range(1, 11)]
        return "\n".join(lines)
    if kind == 3:  # repeated addition: 4 + 3 = 7, 7 + 3 = 10, ...
        step = rng.randint(1, 5)
        x = rng.randint(0, 10)
        lines = []
        for _ in range(rng.randint(4, 8)):
            lines.append(f"{x} + {step} = {x + step}")
            x += step
        return "\n".join(lines)
    return "\n".join(_arith_word_line(rng) for _ in range(rng.randint(3, 6)))


# --------------------------------------------------------------------------------------------
# facts
# --------------------------------------------------------------------------------------------

# name, plural, class, legs, sound verb (or ""), home (or ""), size rank (or -1), food (or ""),
# abilities, feature (or "")
_FACT_ANIMALS = (
    ("cat", "cats", "animal", 4, "meows", "in a house", 3, "fish", ("climb", "run", "jump"), "soft fur"),
    ("dog", "dogs", "animal", 4, "barks", "in a house", 4, "meat", ("run", "swim"), "a good nose"),
    ("cow", "cows", "animal", 4, "moos", "on a farm", 8, "grass", ("walk",), "four stomachs"),
    ("horse", "horses", "animal", 4, "neighs", "on a farm", 8, "hay", ("run fast", "jump"), "a long tail"),
    ("pig", "pigs", "animal", 4, "oinks", "on a farm", 5, "almost anything", ("run",), "a curly tail"),
    ("sheep", "sheep", "animal", 4, "bleats", "on a farm", 5, "grass", ("run",), "thick wool"),
    ("goat", "goats", "animal", 4, "bleats", "on a farm", 5, "grass", ("climb", "jump"), "a beard"),
    ("duck", "ducks", "bird", 2, "quacks", "near a pond", 3, "seeds", ("swim", "fly"), "webbed feet"),
    ("owl", "owls", "bird", 2, "hoots", "in a tree", 3, "mice", ("fly", "see at night"), "big eyes"),
    ("hen", "hens", "bird", 2, "clucks", "on a farm", 3, "seeds", ("lay eggs",), "feathers"),
    ("frog", "frogs", "animal", 4, "croaks", "near a pond", 1, "flies", ("jump", "swim"), "long back legs"),
    ("bee", "bees", "insect", 6, "buzzes", "in a hive", 0, "nectar", ("fly", "make honey"), "wings"),
    ("ant", "ants", "insect", 6, "", "in an anthill", 0, "seeds", ("carry heavy things",), "six legs"),
    ("fish", "fish", "animal", 0, "", "in the water", -1, "small plants", ("swim",), "fins"),
    ("lion", "lions", "animal", 4, "roars", "in the grasslands", 7, "meat", ("run fast",), "sharp teeth"),
    ("tiger", "tigers", "animal", 4, "roars", "in the jungle", 7, "meat", ("swim", "run fast"), "stripes"),
    ("elephant", "elephants", "animal", 4, "trumpets", "in the grasslands", 10, "leaves", ("swim",), "a long trunk"),
    ("giraffe", "giraffes", "animal", 4, "", "in the grasslands", 9, "leaves", ("run fast",), "a long neck"),
    ("monkey", "monkeys", "animal", 4, "chatters", "in the jungle", 4, "fruit", ("climb", "swing from trees"), "a long tail"),
    ("rabbit", "rabbits", "animal", 4, "", "in a burrow", 3, "carrots", ("hop", "run fast"), "long ears"),
    ("mouse", "mice", "animal", 4, "squeaks", "in a small hole", 1, "seeds", ("run", "climb"), "a thin tail"),
    ("bear", "bears", "animal", 4, "growls", "in the forest", 8, "berries", ("climb", "swim"), "thick fur"),
    ("wolf", "wolves", "animal", 4, "howls", "in the forest", 5, "meat", ("run fast",), "sharp teeth"),
    ("snake", "snakes", "animal", 0, "hisses", "in the grass", 2, "mice", ("swim",), "no legs"),
    ("zebra", "zebras", "animal", 4, "", "in the grasslands", 8, "grass", ("run fast",), "black and white stripes"),
    ("penguin", "penguins", "bird", 2, "", "where it is cold", 4, "fish", ("swim",), "black and white feathers"),
)
# name, plural, kind, color sentence
_PRODUCE = (
    ("apple", "apples", "fruit", "can be red or green"), ("banana", "bananas", "fruit", "are yellow"),
    ("lemon", "lemons", "fruit", "are yellow"), ("orange", "oranges", "fruit", "are orange"),
    ("grape", "grapes", "fruit", "can be green or purple"), ("strawberry", "strawberries", "fruit", "are red"),
    ("cherry", "cherries", "fruit", "are red"), ("plum", "plums", "fruit", "are purple"),
    ("pear", "pears", "fruit", "are green or yellow"), ("blueberry", "blueberries", "fruit", "are blue"),
    ("carrot", "carrots", "vegetable", "are orange"), ("pea", "peas", "vegetable", "are green"),
    ("potato", "potatoes", "vegetable", "are brown outside"), ("pumpkin", "pumpkins", "vegetable", "are orange"),
    ("cucumber", "cucumbers", "vegetable", "are green"), ("onion", "onions", "vegetable", "can be white or red"),
)
_NATURE_FACTS = (
    "The sun is hot.", "Ice is cold.", "Snow is white.", "The sky is blue.", "Grass is green.",
    "Fire is hot.", "The moon shines at night.", "Rain falls from the clouds.",
    "Fish live in water.", "Trees have leaves.", "A week has seven days.",
    "A year has twelve months.", "A day has twenty-four hours.", "An hour has sixty minutes.",
    "Water freezes when it is very cold.", "The sun rises in the morning.",
    "The sun sets in the evening.", "Stars shine in the night sky.", "Birds build nests.",
    "Bees make honey.", "Cows give milk.", "Hens lay eggs.", "Plants need water and light.",
    "We see with our eyes.", "We hear with our ears.", "We smell with our nose.",
    "We taste with our tongue.", "A hand has five fingers.", "A square has four sides.",
    "A triangle has three sides.", "Summer is warmer than winter.", "Leaves fall in autumn.",
    "Flowers grow in spring.", "The sea is salty.", "Rocks are hard.", "Feathers are light.",
)
_OPPOSITES = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("day", "night"), ("fast", "slow"),
    ("happy", "sad"), ("open", "closed"), ("old", "new"), ("wet", "dry"), ("light", "dark"),
    ("full", "empty"), ("tall", "short"), ("early", "late"), ("in", "out"), ("left", "right"),
    ("loud", "quiet"), ("hard", "soft"), ("first", "last"),
)


def _animal_facts(rng: random.Random, an: tuple) -> list[str]:
    name, plural, cls, legs, sound, home, _size, food, abilities, feature = an
    subj = _cap(_a(name))
    out = [f"{subj} is {_a(cls)}."]
    out.append(f"{subj} has {_NUMBER_WORDS[legs]} legs." if legs else f"{subj} has no legs.")
    if sound:
        out.append(f"{subj} {sound}.")
    out.append(f"{subj} lives {home}.")
    out.append(f"{_cap(plural)} eat {food}.")
    out.append(f"{_cap(plural)} can {_join_and(abilities)}.")
    if feature != "no legs" and feature != "six legs":
        out.append(f"{subj} has {feature}.")
    return out


def _facts(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:  # several facts about one animal, in a fixed order with a random subset
        facts = _animal_facts(rng, rng.choice(_FACT_ANIMALS))
        keep = [facts[0]] + [s for s in facts[1:] if rng.random() < 0.75]
        return " ".join(keep)
    if kind == 1:  # fruit and vegetables
        items = list(_PRODUCE)
        rng.shuffle(items)
        out = []
        for name, plural, cls, color in items[: rng.randint(2, 4)]:
            out.append(f"{_cap(_a(name))} is {_a(cls)}.")
            out.append(f"{_cap(plural)} {color}.")
        return " ".join(out)
    if kind == 2:  # comparisons and opposites
        out = []
        for _ in range(rng.randint(3, 6)):
            if rng.random() < 0.5:
                x, y = rng.choice(_OPPOSITES)
                if rng.random() < 0.5:
                    x, y = y, x
                out.append(f"The opposite of {x} is {y}.")
            else:
                while True:
                    a, b = rng.choice(_FACT_ANIMALS), rng.choice(_FACT_ANIMALS)
                    if a[6] >= 0 and b[6] >= 0 and abs(a[6] - b[6]) >= 2:
                        break
                if a[6] < b[6]:
                    a, b = b, a
                if rng.random() < 0.5:
                    out.append(f"{_cap(_a(a[0]))} is bigger than {_a(b[0])}.")
                else:
                    out.append(f"{_cap(_a(b[0]))} is smaller than {_a(a[0])}.")
        return " ".join(out)
    # mixed facts about the world and animals
    pool = list(_NATURE_FACTS)
    rng.shuffle(pool)
    out = pool[: rng.randint(2, 5)]
    for _ in range(rng.randint(1, 3)):
        an = rng.choice(_FACT_ANIMALS)
        out.insert(rng.randrange(len(out) + 1), rng.choice(_animal_facts(rng, an)))
    return " ".join(out)


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------

_GENERATORS: dict[str, Callable[[random.Random], str]] = {
    "story": _story,
    "dialogue": _dialogue,
    "list": _list,
    "arithmetic": _arithmetic,
    "facts": _facts,
}


def _check_registers(registers: Sequence[str]) -> tuple[str, ...]:
    if isinstance(registers, str):
        raise UsageError(
            f"registers must be a sequence of register names, not the string {registers!r}; "
            f"did you mean ({registers!r},)?"
        )
    regs = tuple(registers)
    if not regs:
        raise UsageError(f"registers is empty; choose from {', '.join(REGISTERS)}")
    for r in regs:
        if r not in _GENERATORS:
            raise UsageError(f"unknown register {r!r}; known registers: {', '.join(REGISTERS)}")
    return regs


def _check_count(name: str, n: int) -> int:
    if isinstance(n, bool) or not isinstance(n, int):
        raise UsageError(f"{name} must be an integer, got {n!r}")
    if n < 0:
        raise UsageError(f"{name} must be >= 0, got {n}")
    return n


def _doc_seed(stream: str, seed: int, index: int) -> int:
    # The module's name before it moved into qmtp.tiny: part of every document's seed, so it stays as it was
    # (another string would generate another corpus than the one the bundled model was trained on).
    digest = hashlib.sha256(f"qmtp.corpus/{stream}/{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big")


def document(register: str, rng: random.Random) -> str:
    """One document of ``register``, drawn with ``rng``. The text has no trailing newline.

    Raises :class:`~qmtp.errors.UsageError` for an unknown register or a non-``random.Random`` rng.
    """
    gen = _GENERATORS.get(register) if isinstance(register, str) else None
    if gen is None:
        raise UsageError(f"unknown register {register!r}; known registers: {', '.join(REGISTERS)}")
    if not isinstance(rng, random.Random):
        raise UsageError(f"rng must be a random.Random, got {type(rng).__name__}")
    return gen(rng)


def iter_documents(
    n_documents: int,
    seed: int = 0,
    registers: Sequence[str] = REGISTERS,
    *,
    stream: str = "train",
) -> Iterator[tuple[str, str]]:
    """Yield ``n_documents`` ``(register, text)`` pairs lazily; see :func:`generate`."""
    _check_count("n_documents", n_documents)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"seed must be an integer, got {seed!r}")
    regs = _check_registers(registers)
    if not isinstance(stream, str) or not stream:
        raise UsageError(f"stream must be a non-empty string, got {stream!r}")

    def _gen() -> Iterator[tuple[str, str]]:
        for i in range(n_documents):
            rng = random.Random(_doc_seed(stream, seed, i))
            reg = regs[rng.randrange(len(regs))]
            yield reg, _GENERATORS[reg](rng)

    return _gen()


def generate(
    n_documents: int,
    seed: int = 0,
    registers: Sequence[str] = REGISTERS,
    *,
    stream: str = "train",
) -> list[tuple[str, str]]:
    """``n_documents`` ``(register, text)`` pairs.

    Each document's register is drawn uniformly from ``registers`` by that document's own
    random stream, so registers are mixed randomly (not round-robin) and each appears about
    ``n_documents / len(registers)`` times. Document *i* depends only on ``(stream, seed, i)``,
    so ``generate(n)`` is a prefix of ``generate(m)`` for ``n <= m``. ``stream`` names an
    independent sequence; :func:`splits` uses ``"train"`` and ``"heldout"``.
    """
    return list(iter_documents(n_documents, seed, registers, stream=stream))


def splits(
    seed: int = 0,
    n_train: int = DEFAULT_N_TRAIN,
    n_heldout: int = DEFAULT_N_HELDOUT,
    registers: Sequence[str] = REGISTERS,
) -> dict[str, list[tuple[str, str]]]:
    """``{"train": [...], "heldout": [...]}`` lists of ``(register, text)`` pairs.

    The two splits come from different streams (``"train"`` and ``"heldout"``), so each
    held-out document is drawn with its own seed that no training document uses: there is no
    overlap by construction. The same *text* can still come out of both streams by chance,
    because some templates have few variants: the fixed lists ("The days of the week are ..."),
    numbered steps with one slot, and times tables repeat often in both splits; stories and
    dialogues practically never coincide. With seed 0 and the default sizes, about 55% of the
    held-out ``list`` documents, 40% of ``arithmetic`` and 35% of ``facts`` also occur verbatim
    in the training split, and no ``story`` or ``dialogue`` does. That is the point of those
    registers (they are the predictable ones), but a held-out loss on them partly measures
    memorisation. ``splits(seed)["train"] == generate(n_train, seed)``.
    """
    _check_count("n_train", n_train)
    _check_count("n_heldout", n_heldout)
    return {
        "train": generate(n_train, seed, registers, stream="train"),
        "heldout": generate(n_heldout, seed, registers, stream="heldout"),
    }


@functools.lru_cache(maxsize=4)  # every chapter and test asks for the same split; generating it takes seconds
def unseen_heldout(
    seed: int = 0,
    n_train: int = DEFAULT_N_TRAIN,
    n_heldout: int = DEFAULT_N_HELDOUT,
    registers: Sequence[str] = REGISTERS,
) -> tuple[tuple[str, str], ...]:
    """The held-out documents whose text never occurs in the training split (a tuple: it is cached).

    Predictable registers repeat documents by chance (see `splits`); a held-out document that is also a
    training document measures memory, not generalisation, so evaluation uses only the unseen ones.
    """
    parts = splits(seed, n_train, n_heldout, tuple(registers))
    return tuple(drop_seen(parts["heldout"], parts["train"]))


def drop_seen(heldout: list[tuple[str, str]], train: list[tuple[str, str]]) -> list[tuple[str, str]]:
    seen = {text for _, text in train}
    return [(register, text) for register, text in heldout if text not in seen]


if __name__ == "__main__":  # pragma: no cover - a quick look at the registers
    _rng = random.Random(0)
    for _reg in REGISTERS:
        print(f"== {_reg} ==")
        print(document(_reg, _rng))
        print()
