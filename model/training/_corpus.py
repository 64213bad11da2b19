"""A small probabilistic grammar of short English stories, written for this project.

The bundled model is trained only on text this module generates, so it ships
with no licence question. The stories are built so that the structures a
debugger should make visible have something to latch onto:

* names and objects recur within a story ("Lily … her red kite … Lily …"),
  which rewards copying earlier tokens — the job of an induction head;
* word games and a parrot repeat made-up words ("zib tok mura … zib tok mura"),
  and a secret code repeats random digits, so copying must work for arbitrary
  token sequences, not only for common words;
* fixed phrases ("Once upon a time", "one, two, three") reward attending to the
  previous token.
"""

from __future__ import annotations

import random
import re

GIRLS = ["Lily", "Mia", "Sara", "Emma", "Anna", "Zoe", "Lucy", "Ella", "Rosa", "Nina", "Ivy", "Maya"]
BOYS = ["Tom", "Ben", "Max", "Sam", "Leo", "Jack", "Finn", "Noah", "Omar", "Theo", "Kai", "Eli"]
ANIMALS = ["dog", "cat", "bird", "rabbit", "duck", "frog", "fox", "bear", "mouse", "owl"]
PET_NAMES = ["Rex", "Bella", "Coco", "Pip", "Rusty", "Daisy", "Bingo", "Luna", "Mochi", "Biscuit"]
COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "black", "brown"]
SIZES = ["big", "small", "little", "shiny", "soft", "old", "new", "tiny"]
OBJECTS = ["ball", "kite", "hat", "box", "book", "car", "doll", "cup", "boat", "drum", "bike", "shell", "key", "cake"]
PLACES = ["park", "garden", "beach", "forest", "kitchen", "school", "river", "hill", "farm", "zoo", "lake", "market"]
FEELINGS = ["happy", "sad", "excited", "scared", "tired", "proud", "surprised", "angry", "calm", "sleepy"]
TRAITS = ["kind", "curious", "brave", "shy", "funny", "clever", "quiet", "busy"]
HIDING = ["a tree", "a rock", "the bed", "a bench", "the table", "a big leaf", "the stairs", "a bush"]
LOST_IN = ["the river", "a hole", "the tall grass", "the mud", "the lake", "a box of toys"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "snowy"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "sh", "ch", "tr", "bl", "gr", "pl"]
VOWELS = ["a", "e", "i", "o", "u", "oo", "ee", "ai"]
CODAS = ["", "", "", "k", "n", "m", "p", "t", "x", "z"]


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


class StoryGrammar:
    """Draws stories from the grammar; the same seed gives the same stories."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def pick(self, options: list[str]) -> str:
        return self.rng.choice(options)

    def gibberish(self) -> str:
        words = []
        for _ in range(self.rng.randint(2, 6)):
            syllables = self.rng.randint(1, 3)
            words.append("".join(self.pick(ONSETS) + self.pick(VOWELS) + self.pick(CODAS) for _ in range(syllables)))
        return " ".join(words)

    def story(self) -> str:
        r = self.rng
        hero_is_girl = r.random() < 0.5
        hero = self.pick(GIRLS if hero_is_girl else BOYS)
        she, her = ("she", "her") if hero_is_girl else ("he", "his")
        friend_is_girl = r.random() < 0.5
        friend = self.pick([n for n in (GIRLS if friend_is_girl else BOYS) if n != hero])
        animal, pet = self.pick(ANIMALS), self.pick(PET_NAMES)
        color, obj, size = self.pick(COLORS), self.pick(OBJECTS), self.pick(SIZES)
        place = self.pick(PLACES)
        kid = "girl" if hero_is_girl else "boy"

        s: list[str] = []
        opening = r.randrange(3)
        if opening == 0:
            s.append(f"Once upon a time, there was a {self.pick(['little', 'young', 'small'])} {kid} named {hero}.")
        elif opening == 1:
            s.append(f"{hero} was a {self.pick(TRAITS)} {kid} who lived near the {self.pick(PLACES)}.")
        else:
            s.append(f"One {self.pick(WEATHER)} day, a {kid} named {hero} woke up early.")
        s.append(f"{_cap(she)} had a {size} {color} {obj}.")
        if r.random() < 0.6:
            s.append(f"{hero} loved {her} {color} {obj} very much.")
        if r.random() < 0.5:
            s.append(f"{hero} also had a {animal} named {pet}.")
        else:
            pet = ""
        s.append(f"{hero} had a friend named {friend}.")
        s.append(f"One day, {hero} and {friend} went to the {place} with the {color} {obj}.")

        events = [self._share, self._lose, self._echo, self._parrot, self._count, self._code, self._feel]
        r.shuffle(events)
        for event in events[: r.randint(2, 4)]:
            s.extend(event(hero, she, her, friend, color, obj, place, pet, animal))

        ending = r.randrange(3)
        if ending == 0:
            s.append(f"{hero} and {friend} were very {self.pick(['happy', 'proud', 'glad'])}.")
            s.append(f"They played with the {color} {obj} all day.")
        elif ending == 1:
            s.append(f"At the end of the day, {hero} and {friend} walked home from the {place}.")
            s.append(f"{hero} held {her} {color} {obj} and smiled.")
        else:
            s.append(f"That night, {hero} went to sleep with the {color} {obj} next to {her} bed.")
        s.append("The end.")
        return " ".join(s)

    def _share(self, hero, she, her, friend, color, obj, place, pet, animal):
        return [
            f'{friend} said, "Can I play with your {obj}, {hero}?"',
            f'{hero} said, "Yes, you can play with my {color} {obj}."',
            f"{friend} was {self.pick(['happy', 'glad', 'excited'])}.",
        ]

    def _lose(self, hero, she, her, friend, color, obj, place, pet, animal):
        finder = pet if pet and self.rng.random() < 0.5 else friend
        return [
            f"Then the {color} {obj} fell into {self.pick(LOST_IN)}.",
            f"{hero} felt {self.pick(['sad', 'scared', 'angry'])}. {_cap(she)} looked everywhere.",
            f"{finder} found the {color} {obj} under {self.pick(HIDING)}.",
            f'"Thank you, {finder}!" said {hero}.',
        ]

    def _echo(self, hero, she, her, friend, color, obj, place, pet, animal):
        words = self.gibberish()
        return [
            f"{hero} and {friend} played a word game.",
            f'{hero} said, "{words}."',
            f'Then {friend} said, "{words}!"',
            "They laughed and laughed.",
        ]

    def _parrot(self, hero, she, her, friend, color, obj, place, pet, animal):
        words = self.gibberish()
        return [
            f"At the {place}, they met a parrot.",
            f'The parrot said, "{words}."',
            f'{hero} said, "{words}." The parrot was {self.pick(["surprised", "happy", "excited"])}.',
        ]

    def _count(self, hero, she, her, friend, color, obj, place, pet, animal):
        k = self.rng.randint(3, 10)
        return [f"{hero} counted the birds: {', '.join(NUMBERS[:k])}.", f"There were {NUMBERS[k - 1]} birds."]

    def _code(self, hero, she, her, friend, color, obj, place, pet, animal):
        code = " ".join(str(self.rng.randrange(10)) for _ in range(self.rng.randint(3, 6)))
        return [
            f"The box had a secret code: {code}.",
            f"{friend} said the code again: {code}.",
            "The box opened!",
        ]

    def _feel(self, hero, she, her, friend, color, obj, place, pet, animal):
        feeling = self.pick(FEELINGS)
        return [f"{hero} felt {feeling}.", f"{friend} asked, \"Why are you {feeling}, {hero}?\""]


def stories(seed: int, count: int) -> list[str]:
    grammar = StoryGrammar(seed)
    return [grammar.story() for _ in range(count)]


def lexicon() -> set[str]:
    """Every word the grammar can write outside its made-up words and codes (lower-case)."""
    class _NoMadeUpWords(StoryGrammar):
        def gibberish(self) -> str:
            return "blah"

    grammar = _NoMadeUpWords(seed=12345)
    words = set(re.findall(r"[A-Za-z]+", " ".join(grammar.story() for _ in range(4000)).lower()))
    words.discard("blah")
    words.update(w.lower() for group in (GIRLS, BOYS, PET_NAMES) for w in group)
    words.update(NUMBERS + OBJECTS + COLORS + ANIMALS + PLACES + FEELINGS + TRAITS + SIZES + WEATHER)
    return words
