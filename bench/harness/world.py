"""A tiny bAbI-style world simulator for the ``babilong`` scenario.

People move between rooms and pick up and drop objects; the simulator keeps the true state and
writes each event as one English sentence. Questions ask where a person is, where an object is
(with its holder, or where it was dropped) and how many objects a person carries. The answers come
from the simulated state, never from a model; :func:`replay` re-reads the sentences alone, which is
how the tests check that the story says what the state holds.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Literal

PEOPLE = ["Mary", "John", "Daniel", "Sandra"]
ROOMS = ["kitchen", "garden", "office", "bathroom", "hallway", "bedroom"]
OBJECTS = ["apple", "football", "milk", "book"]
COUNT_WORDS = ["none", "one", "two", "three", "four"]
_MOVE = ["{p} moved to the {r}.", "{p} went to the {r}.", "{p} travelled to the {r}.", "{p} journeyed to the {r}."]
_TAKE = ["{p} picked up the {o}.", "{p} got the {o}.", "{p} grabbed the {o}."]
_DROP = ["{p} dropped the {o}.", "{p} put down the {o}.", "{p} discarded the {o}."]

QuestionKind = Literal["where_person", "where_object", "count"]


@dataclass
class World:
    where: dict[str, str] = field(default_factory=dict)  # person -> room
    holder: dict[str, str] = field(default_factory=dict)  # object -> person carrying it
    placed: dict[str, str] = field(default_factory=dict)  # object -> room it was dropped in

    def object_room(self, obj: str) -> str | None:
        if obj in self.holder:
            return self.where.get(self.holder[obj])
        return self.placed.get(obj)

    def carrying(self, person: str) -> int:
        return sum(1 for h in self.holder.values() if h == person)


@dataclass
class Task:
    story: list[str]
    question: str
    answer: str
    kind: QuestionKind


def simulate(rng: random.Random, n_events: int, people: int = 3, objects: int = 3) -> tuple[list[str], World]:
    """``n_events`` sentences of a random but legal history, and the world they leave behind. Every
    person appears (moves) before anyone handles an object, so every question has an answer."""
    who = rng.sample(PEOPLE, people)
    things = rng.sample(OBJECTS, objects)
    w = World()
    story: list[str] = []
    for p in who:
        r = rng.choice(ROOMS)
        w.where[p] = r
        story.append(rng.choice(_MOVE).format(p=p, r=r))
    while len(story) < max(n_events, people):
        p = rng.choice(who)
        held = [o for o, h in w.holder.items() if h == p]
        free = [o for o in things if o not in w.holder and w.placed.get(o, w.where[p]) == w.where[p]]
        roll = rng.random()
        if roll < 0.3 and free:
            o = rng.choice(free)
            w.holder[o] = p
            w.placed.pop(o, None)
            story.append(rng.choice(_TAKE).format(p=p, o=o))
        elif roll < 0.45 and held:
            o = rng.choice(held)
            del w.holder[o]
            w.placed[o] = w.where[p]
            story.append(rng.choice(_DROP).format(p=p, o=o))
        else:
            r = rng.choice([x for x in ROOMS if x != w.where[p]])
            w.where[p] = r
            story.append(rng.choice(_MOVE).format(p=p, r=r))
    return story, w


def make_task(rng: random.Random, n_events: int, kind: QuestionKind) -> Task:
    """A story and one question of ``kind`` with its true answer."""
    story, w = simulate(rng, n_events)
    if kind == "where_person":
        question = f"Where is {rng.choice(sorted(w.where))}?"
    elif kind == "where_object":
        known = sorted(o for o in OBJECTS if w.object_room(o) is not None)
        if not known:  # nobody touched anything: ask about a person instead
            return make_task(rng, n_events, "where_person")
        question = f"Where is the {rng.choice(known)}?"
    else:
        question = f"How many objects is {rng.choice(sorted(w.where))} carrying?"
    answer = answer_of(w, question)
    assert answer is not None
    return Task(story, question, answer, kind)


def answer_of(w: World, question: str) -> str | None:
    """The answer the world gives to one of the three question forms (None: it cannot say)."""
    if m := re.fullmatch(r"Where is the (\w+)\?", question):
        return w.object_room(m.group(1))
    if m := re.fullmatch(r"Where is (\w+)\?", question):
        return w.where.get(m.group(1))
    if m := re.fullmatch(r"How many objects is (\w+) carrying\?", question):
        return COUNT_WORDS[w.carrying(m.group(1))] if m.group(1) in w.where else None
    raise ValueError(f"not a world question: {question!r}")


_WORLD_SENTENCE = re.compile(r"\b(?:" + "|".join(PEOPLE) + r") \w+ (?:up |down |to )?the \w+\.")


def answer_from_text(text: str, question: str) -> str | None:
    """The answer that the world sentences found anywhere in ``text`` (in order, filler around them)
    support: how the scenario checks that a prompt, as sent, still holds its whole story."""
    return answer_of(replay(_WORLD_SENTENCE.findall(text)), question)


def replay(story: list[str]) -> World:
    """The world the sentences describe, read back from the text alone."""
    w = World()
    verbs = {"moved": "move", "went": "move", "travelled": "move", "journeyed": "move", "picked": "take",
             "got": "take", "grabbed": "take", "dropped": "drop", "put": "drop", "discarded": "drop"}
    for s in story:
        m = re.match(r"^(\w+) (\w+) (?:up |down |to )?the (\w+)\.$", s)
        if m is None:
            raise ValueError(f"not a world sentence: {s!r}")
        p, verb, thing = m.groups()
        act = verbs[verb]
        if act == "move":
            w.where[p] = thing
        elif act == "take":
            w.holder[thing] = p
            w.placed.pop(thing, None)
        else:
            w.holder.pop(thing, None)
            w.placed[thing] = w.where[p]
    return w


_NUMBERS = {"none": "none", "zero": "none", "0": "none", "no": "none", "nothing": "none", "one": "one", "1": "one",
            "two": "two", "2": "two", "three": "three", "3": "three", "four": "four", "4": "four"}


def extract(text: str, kind: QuestionKind) -> str | None:
    """The answer a reply gives: the first room named (where questions) or the first count word."""
    words = re.findall(r"[a-z0-9]+", text.lower())
    for word in words:
        if kind == "count":
            if word in _NUMBERS:
                return _NUMBERS[word]
        elif word in ROOMS:
            return word
    return None


def is_correct(text: str, task: Task) -> bool:
    """Exact match of the extracted answer."""
    return extract(text, task.kind) == task.answer


def interleave(story: list[str], filler: list[str], rng: random.Random) -> list[str]:
    """The story's sentences in order, spread at random positions among the filler sentences."""
    slots = sorted(rng.choices(range(len(filler) + 1), k=len(story)))
    out: list[str] = []
    it = iter(story)
    j = 0
    for i in range(len(filler) + 1):
        while j < len(slots) and slots[j] == i:
            out.append(next(it))
            j += 1
        if i < len(filler):
            out.append(filler[i])
    return out
